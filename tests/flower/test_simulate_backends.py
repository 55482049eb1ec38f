"""`fedmf simulate --backend flower` (the Flower app on the Flower simulation engine, through
launcher/flower_backend.py, launcher/flower_cli.py and launcher/processes.py) against `--backend
inprocess`: the same preset, overrides and secrets give the same model bit for bit; failures are one
line, exit 2; no Flower process is left behind."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch

import launcher.flower_cli as launcher
import launcher.processes as supervisor
from fedmf.cli import main
from fedmf.config import RunConfig
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.run.simulate import preset_values
from launcher.flower_backend import flower_population, flower_run_config
from server.config import APP_DEFAULTS, ServerConfig
from tests import _federated_task as fixed

TINY_2 = ["simulate", "--preset", "tiny", "--rounds", "2", "--min-sep", "1", "--json", "--no-plot"]


@pytest.fixture
def launches(monkeypatch, tmp_path):
    """Every launcher.run_simulation of the test, with its tag (the backend calls it through its module)."""
    seen = []
    real = launcher.run_simulation

    def spy(*args, **kwargs):
        work = tmp_path / f"launch{len(seen)}"
        env = launcher.flower_env(work)
        seen.append((env[supervisor.TAG_VAR], None))
        result = real(*args, env=env, tmp_path=work, **kwargs)
        seen[-1] = (env[supervisor.TAG_VAR], result)
        return result

    monkeypatch.setattr(launcher, "run_simulation", spy)
    return seen


def _assert_nothing_left(launches):
    assert launches, "no Flower launch happened"
    for tag, result in launches:
        assert supervisor.tagged_pids(tag) == []
        if result is not None:
            assert len(result.pids_seen) >= 3  # SuperLink, SuperExec, flwr-simulation (+ Ray) were tracked...
            assert [p for p in result.pids_seen if supervisor.pid_alive(p)] == []  # ...and are all gone


#: so-tiny, 2 rounds: its 800 users are 800 simulated SuperNodes; 8 of them train the small LSTM per round
SO_TINY_2 = ["simulate", "--preset", "so-tiny", "--rounds", "2", "--min-sep", "1", "--clients-per-round", "8",
             "--json", "--no-plot"]


#: shakespeare, 2 rounds: users are speaking roles (partition i -> the i-th role), 879 simulated SuperNodes
SHAKESPEARE_2 = ["simulate", "--preset", "shakespeare", "--rounds", "2", "--min-sep", "1", "--clients-per-round", "8",
                 "--json", "--no-plot"]


@pytest.mark.parametrize("argv", [TINY_2, pytest.param(SO_TINY_2, marks=pytest.mark.heavy, id="so-tiny"),
                                  pytest.param(SHAKESPEARE_2, marks=pytest.mark.heavy, id="shakespeare")],
                         ids=["tiny", "so-tiny", "shakespeare"])
def test_both_backends_with_the_same_secrets_give_the_same_model(tmp_path, capsys, launches, argv, monkeypatch):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: the same noise in both backends' runs
    flower_dir, local_dir = tmp_path / "flower", tmp_path / "inprocess"
    fixed.write_secrets(flower_dir)
    fixed.write_secrets(local_dir)
    started = time.perf_counter()
    assert main([*argv, "--backend", "flower", "--out", str(flower_dir)]) == 0, capsys.readouterr().err[-3000:]
    flower = json.loads(capsys.readouterr().out)
    flower_s = time.perf_counter() - started
    assert main([*argv, "--backend", "inprocess", "--out", str(local_dir)]) == 0
    local = json.loads(capsys.readouterr().out)
    print(f"flower backend {flower_s:.1f} s, in process {time.perf_counter() - started - flower_s:.1f} s")
    _assert_nothing_left(launches)

    a = torch.load(flower_dir / "final-model.pt", weights_only=True)
    b = torch.load(local_dir / "final-model.pt", weights_only=True)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the same summary, read back from the Flower run's ledger and final model
    assert set(flower) == set(local)
    for key in ("rounds_done", "stopped", "epsilon", "rho", "delta", "noise_multiplier", "accuracy", "run_id"):
        assert flower[key] == local[key], key
    assert flower["rounds_done"] == 2 and flower["stopped"] == "horizon"
    assert flower["audit"] == f"fedmf audit --ledger {flower_dir / 'ledger.db'} --run {flower['run_id']}"
    assert json.loads((flower_dir / "results.json").read_text())["accuracy"] == flower["accuracy"]
    assert [h["round"] for h in flower["history"]] == [0, 1]
    assert [h["contributed"] for h in flower["history"]] == [h["contributed"] for h in local["history"]]
    # every round's metrics, exact (the ServerApp's round log), as the in-process run reports them
    assert [h["metrics"]["accuracy"] for h in flower["history"]] == [h["metrics"]["accuracy"] for h in local["history"]]
    assert (flower_dir / "flower.log").stat().st_mode & 0o077 == 0


@pytest.mark.heavy  # about 25 s: a SuperLink, Ray and the teardown for a run that fails at once
def test_a_failed_flower_run_is_one_line_and_exit_2(tmp_path):
    """The ServerApp refuses a damaged run.json; under the simulation engine the run still ends
    "finished:completed" (a ServerApp SystemExit is not a failure there): the CLI tells anyway."""
    out = tmp_path / "out"
    fixed.write_secrets(out)
    (out / "run.json").write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "fedmf.cli", *TINY_2, "--backend", "flower", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmf: error: Flower run "), done.stderr[-3000:]
    assert "run.json" in lines[0] and "damaged" in lines[0] and str(out / "flower.log") in lines[0]
    assert done.stdout == ""
    log = (out / "flower.log").read_text(errors="replace")  # Flower's own record of the stop: one line too
    assert "Simulation stopped: fedmf: error: " in log and "Traceback" not in log, log[-3000:]


@pytest.mark.heavy  # two Flower runs, about 50 s
def test_a_killed_flower_run_resumed_reports_the_whole_run(tmp_path, capsys, launches, monkeypatch):
    """The ServerApp is SIGKILLed after round 1's release: the CLI fails in one line; the same command
    again resumes, and results.json lists every round with the values of an uninterrupted run."""
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: both runs draw the same (unsalted) noise
    argv = ["simulate", "--preset", "tiny", "--rounds", "4", "--min-sep", "1", "--json", "--backend", "flower"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    fixed.write_secrets(ref)
    fixed.write_secrets(out)
    assert main([*argv, "--no-plot", "--out", str(ref)]) == 0, capsys.readouterr().err[-3000:]
    reference = json.loads(capsys.readouterr().out)["history"]
    monkeypatch.setenv("FEDMF_KILL_AT", "released:1")
    assert main([*argv, "--out", str(out)]) == 2
    capsys.readouterr()
    monkeypatch.delenv("FEDMF_KILL_AT")
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err[-3000:]
    resumed = json.loads(capsys.readouterr().out)["history"]
    _assert_nothing_left(launches)
    costs = ("seconds", "checkpoint_bytes")
    assert [h["round"] for h in resumed] == [0, 1, 2, 3]
    assert [{k: v for k, v in h.items() if k not in costs} for h in resumed] == \
        [{k: v for k, v in h.items() if k not in costs} for h in reference]
    assert json.loads((out / "results.json").read_text())["history"] == resumed


# ---- no Flower process needed ------------------------------------------------------------------


def test_the_run_config_is_complete_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = preset_values("tiny", {"run-dir": "rel", "rounds": 3})
    config = RunConfig.from_mapping(values)
    rc = flower_run_config(values, config)
    assert set(rc) == set(APP_DEFAULTS)  # the app's pyproject defaults (noise-multiplier 0.5, ...) fill in nothing
    assert rc["run-dir"] == str(tmp_path / "rel")
    assert (rc["noise-multiplier"], rc["target-epsilon"]) == (0.0, 8.0)  # the preset's calibration, not the table's z
    assert json.loads(rc["task-options"]) == {"num_users": 40}
    server = ServerConfig.from_mapping(rc)  # what the ServerApp reads: the same engine configuration
    assert all(getattr(server, f.name) == getattr(config, f.name) for f in dataclasses.fields(RunConfig))


def test_population_is_one_supernode_per_distinct_user():
    assert flower_population("tiny", [str(i) for i in range(5)][::-1]) == 5
    assert flower_population("shakespeare", ["ROMEO", "JULIET", "NURSE"]) == 3  # partition i -> the i-th role
    for users in (["0", "0"], []):
        with pytest.raises(Exception, match="one distinct user per SuperNode"):
            flower_population("t", users)


class _Roles:
    def __init__(self, task):
        self._task = task

    def users(self):
        return ["ROMEO", "ROMEO"]

    def __getattr__(self, name):
        return getattr(self._task, name)


def test_a_task_with_repeated_user_ids_is_refused_before_any_process(tmp_path, capsys, monkeypatch):
    import fedmf.tasks

    real = fedmf.tasks.get_task
    monkeypatch.setattr(fedmf.tasks, "get_task", lambda name, **kw: _Roles(real(name, **kw)))
    monkeypatch.setattr(launcher, "run_simulation", lambda *a, **k: pytest.fail("launched"))
    assert main([*TINY_2, "--backend", "flower", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not distinct" in err[0], err


def test_without_the_source_tree_the_flower_backend_is_one_line(tmp_path, capsys, monkeypatch):
    def missing():
        raise launcher.AppDirError("the Flower app's source tree is not installed: no pyproject.toml here")

    monkeypatch.setattr(launcher, "app_dir", missing)
    monkeypatch.setattr(launcher, "run_simulation", lambda *a, **k: pytest.fail("launched"))
    assert main([*TINY_2, "--backend", "flower", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedmf: error: the Flower app's source tree is not installed: no pyproject.toml here"]


def test_app_dir_is_the_source_tree_and_the_launcher_imports_no_flower():
    root = launcher.app_dir()
    assert (root / "launcher" / "flower_cli.py").samefile(launcher.__file__)
    code = ("import sys, launcher.flower_backend, fedmf.cli.simulate; "
            "assert not any(m.startswith('flwr') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_backend_that_is_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    """The CLI finds --backend flower through the fedmf.simulate_backends entry point (the engine
    imports no adapter); without it: one line, exit 2, nothing launched."""
    import importlib.metadata

    from fedmf.cli.simulate import BACKENDS_GROUP

    assert [ep.value for ep in importlib.metadata.entry_points(group=BACKENDS_GROUP, name="flower")] == \
        ["launcher.flower_backend:simulate_flower"]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: importlib.metadata.EntryPoints(()))
    monkeypatch.setattr(launcher, "run_simulation", lambda *a, **k: pytest.fail("launched"))
    assert main([*TINY_2, "--backend", "flower", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedmf: error: --backend flower is not installed"), err
