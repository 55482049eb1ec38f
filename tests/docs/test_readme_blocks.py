"""README.md's Flower blocks work exactly as written: extracted from the README and run with bash in a
copy of the app, then the README's own stop commands leave no process behind. Every process the
blocks start carries the harness's environment tag, so whatever survives is found, killed by PID and
fails the test (launcher/processes.py's ProcessTracker). Each block writes its own run directory, a
run directory given to another plan stops the ServerApp with one line and a non-zero
``deploy/fedmf-run.sh``, and nothing a block writes enters the Flower app bundle (FAB)."""

from __future__ import annotations

import io
import re
import shutil
import socket
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from fedmf.ledger import Ledger
from launcher.flower_cli import flower_env
from launcher.processes import ProcessTracker

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```bash\n(.*?)^```", README, flags=re.M | re.S)


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"README.md has {len(found)} bash blocks containing {marker!r}"
    return found[0]


def _app(tmp_path: Path) -> Path:
    """The Flower app (what `flwr run .` packages) copied to a directory of its own, so that the
    blocks' `$PWD/fedmf-run` lands in the test's directory."""
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", app / "pyproject.toml")
    shutil.copy2(ROOT / ".gitignore", app / ".gitignore")
    for package in ("fedmf", "server", "client"):
        shutil.copytree(ROOT / package, app / package, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "deploy").mkdir()
    shutil.copy2(ROOT / "deploy" / "fedmf-run.sh", app / "deploy" / "fedmf-run.sh")
    return app


def _fab_names(app: Path) -> list[str]:
    """The files of the FAB that `flwr run` builds from ``app`` (flwr.cli.build, as `flwr run` calls it)."""
    from flwr.cli.build import build_fab_from_disk

    return zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))).namelist()


def _only_code(names: list[str]) -> list[str]:
    """The FAB entries that are not the app's code (pyproject.toml, the manifest, *.py of its packages)."""
    return [n for n in names if n not in ("pyproject.toml", ".info/CONTENT")
            and not (n.endswith(".py") and n.split("/")[0] in ("fedmf", "server", "client"))]


def _committed(run_dir: Path) -> list[int]:
    secret = (run_dir / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(run_dir / "ledger.db", secret=secret) as book:
        run = book.run(book.runs()[-1].id)
        return [t for t in range(run.info.rounds) if run.round(t).status == "committed"]


def _run_blocks(tmp_path: Path, script: str, timeout: float) -> tuple[str, list[int]]:
    """Run ``script`` with bash in a copy of the app; return its output and the processes it left
    running 20 s after it ended (then kill them all by PID)."""
    app = _app(tmp_path)
    env = flower_env(tmp_path / "harness")  # the tag (and private local-SuperLink ports); the README sets the rest
    # the README's $(mktemp -d), short: Ray's AF_UNIX socket paths below it must stay under 108 bytes
    env["TMPDIR"] = short = tempfile.mkdtemp(prefix="fedmf-readme-", dir="/tmp")
    tracker = ProcessTracker(env, tmp_path / "logs")
    try:
        rc, out, err, timed_out = tracker.run(["bash", "-c", script], timeout=timeout, cwd=app)
        output = out + err
        assert not timed_out and rc == 0, output[-4000:]
        end = time.monotonic() + 20
        while tracker.live_pids() and time.monotonic() < end:
            time.sleep(0.5)
        return output, tracker.live_pids()
    finally:
        try:
            tracker.cleanup()
        finally:
            shutil.rmtree(short, ignore_errors=True)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_deployment_quick_start_runs_as_written_and_its_stop_line_stops_everything(tmp_path):
    """The SuperLink, two SuperNodes and the run as the README gives them: the block waits for the
    SuperLink before `flwr run` (which would fail otherwise), the run commits every round, and
    `kill $pids` leaves no SuperLink, SuperNode or flower-superexec running. Before the stop line,
    the same run line with another plan (3 rounds) on the block's run directory: one `fedmf: error:`
    line, no traceback, and `deploy/fedmf-run.sh` exits 1. The FAB built afterwards from the app
    directory (which now holds the run directory) carries only code."""
    ports = [9093, 9100, 9101]
    assert all(_port_free(p) for p in ports), f"the README's ports {ports} must be free on 127.0.0.1"
    run_block = _block("fedmf user keygen")
    run_line = run_block[run_block.index("deploy/fedmf-run.sh"):]
    assert "rounds=2" in run_line
    other_plan = run_line.replace("rounds=2", "rounds=3").strip()
    script = "\n".join(["set -e", _block("export FLWR_HOME"), run_block,
                        f"if {other_plan}\nthen echo 'SECOND RUN rc=0'\nelse echo \"SECOND RUN rc=$?\"\nfi",
                        _block("kill $pids")])
    output, left = _run_blocks(tmp_path, script, timeout=400)
    app = tmp_path / "app"
    assert _committed(app / "fedmf-deploy") == [0, 1], output[-4000:]
    assert left == [], "the README's stop line left processes running"
    second = output[output.index("SECOND RUN") - 3000:] if "SECOND RUN" in output else output
    assert "SECOND RUN rc=1" in output, output[-4000:]
    assert "was written for another plan" in output and "fedmf: error: " in output, output[-4000:]
    assert "Traceback" not in output, second
    assert (app / "fedmf-deploy").is_dir() and _only_code(_fab_names(app)) == []


@pytest.mark.heavy  # Ray and 20 simulated SuperNodes: about a minute on 2 cores
def test_the_simulation_block_runs_as_written_and_its_stop_line_stops_the_local_superlink(tmp_path):
    script = "\n".join(["set -e", _block("export FLWR_HOME"), _block("--federation-config"),
                        _block("kill $simlink")])
    output, left = _run_blocks(tmp_path, script, timeout=500)
    assert _committed(tmp_path / "app" / "fedmf-flower-sim") == [0, 1, 2, 3, 4], output[-4000:]
    assert left == [], "the README's stop line left the local SuperLink or its SuperExec running"


def test_the_readme_blocks_write_distinct_run_directories():
    """The main job, the Flower simulation and the deployment each write their own run directory."""
    setup = next(b for b in BLOCKS if "fedmf simulate --preset so-tiny" in b)
    dirs = [re.search(r"--out (\S+)", setup).group(1),
            *(re.search(r"run-dir='\$PWD/([^']+)'", _block(m)).group(1) for m in ("--federation-config", "fedmf user keygen"))]
    assert len(set(dirs)) == 3, dirs


def test_generated_output_stays_out_of_git_and_of_the_fab(tmp_path, monkeypatch, capsys):
    """What the README's commands write into the app directory is ignored by git and by `flwr build`:
    a real `fedmf simulate` run's directory, mechanism files, a ledger and keys beside the app's
    code, and the FAB holds only the code."""
    from fedmf.cli import main

    app = _app(tmp_path)
    monkeypatch.chdir(app)
    assert main(["simulate", "--preset", "tiny", "--rounds", "2", "--out", "fedmf-sim", "--quiet", "--no-plot"]) == 0
    assert (app / "fedmf-sim" / "results.json").is_file() and (app / "fedmf-sim" / "run.json").is_file()
    for name in ("so.mech.json", "bsr.mech.json", "budget.key", "budgets.db", "run-a/results.json",
                 "fedmf-flower-sim/rounds.jsonl", "fedmf-deploy/outcome.json", "fedmf-audit/canaries.json"):
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text("{}")
    assert _only_code(_fab_names(app)) == []
    generated = ["fedmf-sim/results.json", "fedmf-sim/run.json", "so.mech.json", "bsr.mech.json", "so.dense.json",
                 "budget.key", "budgets.db", "run-a/results.json", "run-b/results.json", "fedmf-flower-sim/ledger.db",
                 "fedmf-deploy/ledger.db", "fedmf-audit/canaries.json", "so-small-ray/results.json"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *generated], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert sorted(ignored.stdout.split()) == sorted(generated), ignored.stdout + ignored.stderr
