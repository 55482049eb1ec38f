"""README.md's Flower blocks work exactly as written: extracted from the README and run with bash in a
copy of the app, then the README's own stop commands leave no process behind. Every process the
blocks start carries the harness's environment tag, so whatever survives is found, killed by PID and
fails the test (launcher/processes.py's ProcessTracker)."""

from __future__ import annotations

import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from fedmf.ledger import Ledger
from launcher.processes import ProcessTracker, flower_env

ROOT = Path(__file__).resolve().parents[1]
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
    for package in ("fedmf", "server", "client"):
        shutil.copytree(ROOT / package, app / package, ignore=shutil.ignore_patterns("__pycache__"))
    return app


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
    """The SuperLink, two SuperNodes and `flwr run` as the README gives them: the block waits for
    the SuperLink before `flwr run` (which would fail otherwise), the run commits every round, and
    `kill $pids` leaves no SuperLink, SuperNode or flower-superexec running."""
    ports = [9093, 9100, 9101]
    assert all(_port_free(p) for p in ports), f"the README's ports {ports} must be free on 127.0.0.1"
    script = "\n".join(["set -e", _block("export FLWR_HOME"), _block("flower-superlink"), _block("kill $pids")])
    output, left = _run_blocks(tmp_path, script, timeout=300)
    assert _committed(tmp_path / "app" / "fedmf-run") == [0, 1], output[-4000:]
    assert left == [], "the README's stop line left processes running"


@pytest.mark.heavy  # Ray and 20 simulated SuperNodes: about a minute on 2 cores
def test_the_simulation_block_runs_as_written_and_its_stop_line_stops_the_local_superlink(tmp_path):
    script = "\n".join(["set -e", _block("export FLWR_HOME"), _block("--federation-config"),
                        _block("local-superlink/")])
    output, left = _run_blocks(tmp_path, script, timeout=500)
    assert _committed(tmp_path / "app" / "fedmf-run") == [0, 1, 2, 3, 4], output[-4000:]
    assert left == [], "the README's stop line left the local SuperLink or its SuperExec running"
