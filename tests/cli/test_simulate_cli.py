"""`fedmf simulate`: presets, overrides, outputs, resume, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedmf.cli import main
from fedmf.errors import FedmfError
from fedmf.run.simulate import PRESETS, preset_values


def test_tiny_preset_runs_writes_its_outputs_and_resumes(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--preset", "tiny", "--rounds", "6", "--epsilon", "6", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rounds_done"] == 6 and result["stopped"] == "horizon"
    assert result["epsilon"] == pytest.approx(6.0, rel=1e-6) and result["accuracy"] is not None
    assert {"ledger.db", "results.json", "progress.png", "run.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "results.json").read_text())["run_id"] == result["run_id"]
    assert result["audit"] == f"fedmf audit --ledger {out / 'ledger.db'} --run {result['run_id']}"
    # the audit command it prints works on what it wrote
    assert main(["audit", "--ledger", str(out / "ledger.db"), "--json"]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in audit["rounds"]] == ["committed"] * 6
    assert max(r["epsilon_worst_user"] for r in audit["rounds"]) <= 6.0 * (1 + 1e-9)
    # same command again: the run is complete and resumes to the same end
    assert main(["simulate", "--preset", "tiny", "--rounds", "6", "--epsilon", "6", "--out", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["run_id"] == result["run_id"] and again["rounds_done"] == 6


def test_presets_are_valid_configurations():
    from fedmf.config import RunConfig

    for name in PRESETS:
        config = RunConfig.from_mapping(preset_values(name, {"run-dir": "x"}))
        assert config.rounds >= 1 and config.task


def test_a_presets_bands_give_way_to_another_mechanism_or_geometry():
    """so-small's 32 bands are for its banded-toeplitz over 200 rounds with min-sep 40: another
    kind, or fewer rounds / a smaller min-sep, gets the default instead of an error about a flag
    the user never gave; bands the user gives are kept (and checked)."""
    from fedmf.config import RunConfig

    def bands(overrides):
        return RunConfig.from_mapping(preset_values("so-small", {"run-dir": "x", **overrides})).num_bands

    assert bands({}) == 32 and bands({"mechanism": "bsr"}) == 32 and bands({"min-sep": 32}) == 32
    for overrides in ({"mechanism": "dp-sgd"}, {"mechanism": "blt"}, {"mechanism": "tree"},
                      {"rounds": 20, "min-sep": 10}, {"min-sep": 31}):
        assert bands(overrides) is None, overrides  # the mechanism's default, min(b, 64, n)
    assert bands({"num-bands": 8, "mechanism": "bsr"}) == 8
    RunConfig.from_mapping(preset_values("so-small", {"run-dir": "x", "mechanism": "dp-sgd"})).build_plan()
    with pytest.raises(FedmfError, match="does not apply to dp-sgd"):
        RunConfig.from_mapping(preset_values("so-small", {"run-dir": "x", "mechanism": "dp-sgd",
                                                          "num-bands": 3})).build_plan()


@pytest.mark.parametrize("argv", [
    ["--preset", "nope"], ["--rounds", "0"], ["--epsilon", "1", "--noise-multiplier", "1"],
    ["--clients-per-round", "-1"], ["--sampling", "bminsep:7"],
    # the flower backend refuses before any Flower process starts (tests/flower/test_simulate_backends.py runs it)
    ["--backend", "flower", "--rounds", "2", "--min-sep", "4"],  # a min-sep the user gives is checked: 4 > 2 rounds
    ["--clients-per-round", "41"], ["--backend", "flower", "--clients-per-round", "41"],  # tiny has 40 users
    ["--backend", "flower", "--timeout", "0"], ["--backend", "flower", "--delta", "0.9"],
    ["--device", "cpu"], ["--vectorized", "--backend", "flower"], ["--vectorized", "--device", "tpu"],
    ["--workers", "0"], ["--workers", "2", "--vectorized"], ["--workers", "2", "--backend", "flower"],
    ["--workers", "two"], ["--chunk-users", "2"], ["--vectorized", "--chunk-users", "0"],
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, argv):
    done = subprocess.run([sys.executable, "-m", "fedmf.cli", "simulate", "--preset", "tiny", "--out",
                           str(tmp_path / "o"), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("fedmf: error:") or "usage:" in done.stderr
    assert "Traceback" not in done.stderr


def test_vectorized_clients_give_the_one_at_a_time_model_within_float_tolerance(tmp_path, capsys, monkeypatch):
    """--vectorized trains a round's users together (train(local_updates=...)); with the same
    secrets (the same noise and selection: repeatable noise, tests only) the final model equals the
    sequential run's within float tolerance, and the ledger records the same participations."""
    import torch

    from fedmf.run.private_run import REPEATABLE_NOISE_ENV
    from tests._federated_task import share_secrets

    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")

    argv = ["simulate", "--preset", "tiny", "--rounds", "6", "--epsilon", "6", "--json", "--no-plot"]
    assert main([*argv, "--out", str(tmp_path / "seq")]) == 0
    share_secrets(tmp_path / "seq", tmp_path / "vec")
    assert main([*argv, "--out", str(tmp_path / "vec"), "--vectorized", "--device", "cpu"]) == 0
    seq_out, vec_out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert seq_out["rounds_done"] == vec_out["rounds_done"] == 6
    a = torch.load(tmp_path / "seq" / "final-model.pt")
    b = torch.load(tmp_path / "vec" / "final-model.pt")
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    for run in ("seq", "vec"):
        assert main(["audit", "--ledger", str(tmp_path / run / "ledger.db"), "--json"]) == 0
    audits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fields = ("round", "status", "selected", "contributed", "dropped", "rejected", "noise_std")
    assert [[r[f] for f in fields] for r in audits[0]["rounds"]] == [[r[f] for f in fields] for r in audits[1]["rounds"]]


def test_parallel_clients_give_the_one_at_a_time_model_bit_for_bit(tmp_path, capsys, monkeypatch):
    """--workers N trains N users at a time (threads): with the same secrets (and repeatable noise,
    tests only) the final model and the ledger are the one-at-a-time run's, bit for bit."""
    import torch

    from fedmf.run.private_run import REPEATABLE_NOISE_ENV
    from tests._federated_task import share_secrets

    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")

    argv = ["simulate", "--preset", "tiny", "--rounds", "6", "--epsilon", "6", "--json", "--no-plot"]
    assert main([*argv, "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    share_secrets(tmp_path / "one", tmp_path / "three")
    assert main([*argv, "--out", str(tmp_path / "three"), "--workers", "3"]) == 0
    one, three = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert one["accuracy"] == three["accuracy"] and one["rounds_done"] == three["rounds_done"] == 6
    a = torch.load(tmp_path / "one" / "final-model.pt")
    b = torch.load(tmp_path / "three" / "final-model.pt")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    for run in ("one", "three"):
        assert main(["audit", "--ledger", str(tmp_path / run / "ledger.db"), "--json"]) == 0
    audits = [json.loads(line)["rounds"] for line in capsys.readouterr().out.splitlines()]
    fields = ("round", "status", "selected", "contributed", "dropped", "rejected", "noise_std", "checkpoint_sha256")
    assert [[r[f] for f in fields] for r in audits[0]] == [[r[f] for f in fields] for r in audits[1]]


def test_train_takes_exactly_one_kind_of_client_function(tmp_path):
    from fedmf.errors import ConfigError
    from fedmf.run.federated import train
    from tests import _federated_task as task

    plan = task.plan(rounds=4)
    with pytest.raises(ConfigError, match="exactly one"):
        train(task.Tiny(), task.users(), plan, task.local_update, local_updates=lambda p, u, t: {},
              checkpoint_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="exactly one"):
        train(task.Tiny(), task.users(), plan, None, checkpoint_dir=tmp_path / "b")


def test_a_batch_hook_answering_for_users_not_asked_is_refused(tmp_path):
    """local_updates keyed differently from the user ids (here str vs int) would make every user
    silently drop out: the round is refused with one line instead (and nothing is committed)."""
    import torch

    from fedmf.errors import ConfigError
    from fedmf.run.federated import train
    from tests import _federated_task as task

    users = list(range(20))

    def by_string(params, asked, t):
        return {str(u): {k: torch.zeros_like(v) for k, v in params.items()} for u in asked}

    with pytest.raises(ConfigError, match="not asked for in round 0"):
        train(task.Tiny(), users, task.plan(rounds=6), None, local_updates=by_string, checkpoint_dir=tmp_path)


@pytest.mark.parametrize("backend", ["inprocess", "flower"])
def test_repeatable_noise_is_announced_on_stderr_for_both_backends_even_quiet(tmp_path, backend):
    """FEDMF_UNSAFE_REPEATABLE_NOISE=1 is never silent: the warning is the first stderr line with
    --quiet --json, on either backend (here the run then stops at its plan: a given min-sep 4 > 2 rounds)."""
    import os

    from fedmf.run.private_run import REPEATABLE_NOISE_ENV, REPEATABLE_NOISE_WARNING

    argv = [sys.executable, "-m", "fedmf.cli", "simulate", "--preset", "tiny", "--out", str(tmp_path / "o"),
            "--backend", backend, "--rounds", "2", "--min-sep", "4", "--quiet", "--json"]
    for value, warned in (("1", True), ("0", False)):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              env={**os.environ, REPEATABLE_NOISE_ENV: value})
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and lines[-1].startswith("fedmf: error:"), done.stderr
        assert (lines[0] == f"fedmf: warning: {REPEATABLE_NOISE_WARNING}") is warned, done.stderr
        assert len(lines) == 1 + warned


def test_eval_every_evaluates_every_nth_round_and_the_last(tmp_path, capsys):
    """``--eval-every 3`` on 7 rounds: held-out scores after rounds 2 and 5 (0-based) and the last, 6;
    the other rounds are released without them. A bad value, or the Flower backend, is one line."""
    import json

    from fedmf.cli import main

    out = tmp_path / "run"
    assert main(["simulate", "--preset", "tiny", "--rounds", "7", "--min-sep", "2", "--eval-every", "3",
                 "--out", str(out), "--json", "--no-plot"]) == 0
    history = json.loads(capsys.readouterr().out)["history"]
    assert [h["round"] for h in history if "accuracy" in h["metrics"]] == [2, 5, 6]
    assert len(history) == 7
    assert main(["simulate", "--preset", "tiny", "--eval-every", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--eval-every must be an integer >= 1" in capsys.readouterr().err
    assert main(["simulate", "--preset", "tiny", "--eval-every", "2", "--backend", "flower",
                 "--out", str(tmp_path / "y")]) == 2
    assert "--eval-every is for --backend inprocess" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
