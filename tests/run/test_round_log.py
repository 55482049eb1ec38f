"""results.json and progress.png cover the whole run, rebuilt from what is durable: the ledger's
committed rounds and the round log (rounds.jsonl) that each release appends after its commit —
across a stop, a resume and a re-run, on the in-process backend and on the ServerApp's code path."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest

import fedmf.run.simulate
from fedmf.cli import main
from fedmf.errors import RoundOrderError
from fedmf.run.federated import train
from fedmf.run.private_run import REPEATABLE_NOISE_ENV, PrivateRun, RoundRecord
from fedmf.run.round_log import ROUND_LOG, append_round, read_rounds
from server.config import ServerConfig
from tests import _federated_task as task

SIMULATE = ["simulate", "--preset", "tiny", "--rounds", "6", "--epsilon", "6", "--json"]


def _without_timing(history: list[dict]) -> list[dict]:
    """The rounds' values without what they cost this process (time, bytes written: a resumed round
    writes the noise state a fresh process needs)."""
    return [{k: v for k, v in h.items() if k not in ("seconds", "checkpoint_bytes")} for h in history]


def _stop_at(monkeypatch, t_stop: int, *, before_release: bool = False) -> None:
    """Interrupt the run (Ctrl-C) at round ``t_stop``: after its release, or between its commit and release."""
    real = PrivateRun.released

    def released(self, t):
        if t == t_stop and before_release:
            raise KeyboardInterrupt
        real(self, t)
        if t == t_stop:
            raise KeyboardInterrupt

    monkeypatch.setattr(PrivateRun, "released", released)


def test_results_cover_the_whole_run_across_a_stop_a_resume_and_a_rerun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: both runs draw the same (unsalted) noise
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main([*SIMULATE, "--no-plot", "--out", str(ref)]) == 0
    reference = json.loads(capsys.readouterr().out)["history"]
    assert [h["round"] for h in reference] == list(range(6)) and all("accuracy" in h["metrics"] for h in reference)
    task.share_secrets(ref, out)  # the same noise and selection: the same rounds

    with monkeypatch.context() as patch:
        _stop_at(patch, 2)
        assert main([*SIMULATE, "--out", str(out)]) == 130  # Ctrl-C
    assert not (out / "results.json").exists()
    logged = (out / ROUND_LOG).read_bytes()
    assert logged.count(b"\n") == 3 and (out / ROUND_LOG).stat().st_mode & 0o077 == 0
    with open(out / ROUND_LOG, "ab") as f:  # a crash in the middle of appending round 3's line
        f.write(b'{"checkpoint_sha256": "sha256:')

    plotted = []
    real_plot = fedmf.run.simulate._plot
    monkeypatch.setattr(fedmf.run.simulate, "_plot", lambda history, path: (plotted.append(
        [h["round"] for h in history]), real_plot(history, path)))
    for attempt in ("resume", "re-run"):  # the second is the README's first command again: nothing left to run
        assert main([*SIMULATE, "--out", str(out)]) == 0, attempt
        result = json.loads(capsys.readouterr().out)
        written = json.loads((out / "results.json").read_text())
        assert _without_timing(result["history"]) == _without_timing(reference), attempt
        assert written["history"] == result["history"] and written["accuracy"] == reference[-1]["metrics"]["accuracy"]
        assert plotted[-1] == list(range(6)), attempt
        # rounds 0-2 are what the interrupted run released, to the bit (its time and bytes included)
        assert result["history"][:3] == [json.loads(line)["record"] for line in logged.splitlines()], attempt
    assert (out / "progress.png").stat().st_size > 0
    assert (out / ROUND_LOG).read_bytes().startswith(logged) and (out / ROUND_LOG).read_bytes().count(b"\n") == 6


def test_a_round_committed_but_not_released_gets_its_record_and_evaluation_on_resume(tmp_path, capsys, monkeypatch):
    """Stopped between round 2's commit and its release: round 2 has no log line; the resume writes it
    before round 3, evaluated from round 2's checkpoint (the model a resume loads), so the whole history
    equals an uninterrupted run's with the same secrets (repeatable noise, tests only). A log that lacks
    an older round (a run directory from before this recovery) gets that round with the ledger's
    counts and no metrics; the last round's missing line is evaluated again, to the same values."""
    from fedmf.run.private_run import RECOVERED_EVALUATED, RECOVERED_UNEVALUATED

    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main([*SIMULATE, "--no-plot", "--out", str(ref)]) == 0
    reference = json.loads(capsys.readouterr().out)["history"]
    task.share_secrets(ref, out)
    with monkeypatch.context() as patch:
        _stop_at(patch, 2, before_release=True)
        assert main([*SIMULATE, "--no-plot", "--out", str(out)]) == 130  # Ctrl-C
    lines = [json.loads(line) for line in (out / ROUND_LOG).read_text().splitlines()]
    assert [line["round"] for line in lines] == [0, 1]
    assert main([*SIMULATE, "--no-plot", "--out", str(out)]) == 0
    history = json.loads(capsys.readouterr().out)["history"]
    assert _without_timing(history) == _without_timing(reference)
    assert history[2]["metrics"]["accuracy"] == reference[2]["metrics"]["accuracy"] and history[2]["seconds"] is None
    lines = [json.loads(line) for line in (out / ROUND_LOG).read_text().splitlines()]
    assert [line["round"] for line in lines] == list(range(6))  # round 2 before round 3: written on resume
    assert [line.get("recovered") for line in lines] == [None, None, RECOVERED_EVALUATED, None, None, None]

    kept = [line for line in (out / ROUND_LOG).read_text().splitlines() if json.loads(line)["round"] not in (0, 5)]
    (out / ROUND_LOG).write_text("".join(line + "\n" for line in kept))
    assert main([*SIMULATE, "--no-plot", "--out", str(out)]) == 0  # nothing left to run: the records only
    history = json.loads(capsys.readouterr().out)["history"]
    assert history[0]["metrics"] == {} and history[0]["contributed"] == reference[0]["contributed"] == 8
    assert _without_timing(history[1:]) == _without_timing(reference[1:])  # round 5 evaluated again: equal
    lines = {json.loads(line)["round"]: json.loads(line) for line in (out / ROUND_LOG).read_text().splitlines()}
    assert lines[0]["recovered"] == RECOVERED_UNEVALUATED and lines[5]["recovered"] == RECOVERED_EVALUATED


def test_the_server_apps_rounds_survive_its_restart(tmp_path, monkeypatch):
    """The ServerApp's code path (LocalGrid, the real ClientApp) appends the same round log: a run
    interrupted after round 1 and resumed gives flower_result the whole run, equal to an
    uninterrupted ServerApp run with the same secrets (the clients' train-loss included, as its private
    release: client-metrics = "private")."""
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: both runs draw the same (unsalted) noise
    from client.app import app as client_app
    from fedmf.tasks import get_task
    from launcher.flower_backend import flower_result
    from server.app import run_server
    from server.local_grid import LocalGrid, client_node

    def values(name):
        return {"task": "tiny", "task-options": '{"num_users": 8}', "rounds": 4, "min-sep": 2,
                "clients-per-round": 3, "noise-multiplier": 0.7, "client-lr": 0.2, "batch-size": 8,
                "run-dir": str(tmp_path / name), "reply-timeout": 5.0, "client-metrics": "private"}

    def serve(name):
        nodes = {100 + i: client_node(client_app, {"partition-id": i}, 100 + i) for i in range(8)}
        run_server(LocalGrid(nodes), values(name))
        config = ServerConfig.from_mapping(values(name))
        tiny = get_task("tiny", num_users=8)
        return flower_result(config, model=tiny.model(), evaluate=tiny.evaluate, plot=False)

    reference = serve("ref").history
    task.share_secrets(tmp_path / "ref", tmp_path / "run")
    with monkeypatch.context() as patch:
        _stop_at(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            serve("run")
    resumed = serve("run").history
    assert [h["round"] for h in resumed] == [0, 1, 2, 3]
    assert all("noisy-train-loss" in h["metrics"] and "accuracy" in h["metrics"] for h in resumed)
    assert not any("train-loss" in h["metrics"] for h in resumed)  # never the clients' values as sent
    assert _without_timing(resumed) == _without_timing(reference)


# ---- the round log itself ----------------------------------------------------------------------


def _record(t: int, accuracy: float) -> RoundRecord:
    return RoundRecord(t, 0.5 * (t + 1), 4, 3, 1, 0, 0, 0, 0.1, 100, {"accuracy": accuracy})


def test_the_reader_keeps_only_what_the_ledger_committed(tmp_path):
    committed = {0: "sha256:a", 1: "sha256:b"}
    append_round(tmp_path, 1, "sha256:a", _record(0, 0.1))
    append_round(tmp_path, 1, "sha256:stale", _record(1, 0.9))  # a rolled-back attempt of round 1
    append_round(tmp_path, 2, "sha256:b", _record(1, 0.8))  # another run
    append_round(tmp_path, 1, "sha256:b", _record(1, 0.2))
    append_round(tmp_path, 1, "sha256:c", _record(2, 0.3))  # a round the ledger does not have
    with open(tmp_path / ROUND_LOG, "ab") as f:
        f.write(b"not json\n" + b'{"run_id": 1, "round": 1')  # garbage, then a torn last line
    rounds = read_rounds(tmp_path, 1, committed)
    assert sorted(rounds) == [0, 1]
    assert rounds[0]["metrics"] == {"accuracy": 0.1} and rounds[1]["metrics"] == {"accuracy": 0.2}
    assert rounds[1] == asdict(_record(1, 0.2))
    append_round(tmp_path, 1, "sha256:c", _record(2, 0.4))  # the torn tail is cut before appending
    assert read_rounds(tmp_path, 1, {**committed, 2: "sha256:c"})[2]["metrics"] == {"accuracy": 0.4}
    lines = (tmp_path / ROUND_LOG).read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 8 and lines[5] == b"not json"  # the fragment is gone
    assert all(json.loads(line)["record"] for i, line in enumerate(lines[:-1]) if i != 5)
    assert read_rounds(tmp_path / "missing", 1, committed) == {}


def test_only_the_round_just_committed_can_be_released(tmp_path):
    """PrivateRun.released appends the record commit() returned, after the ledger commit; a round
    that is open, aggregated or already released is refused and nothing is logged."""
    plan = task.plan(rounds=8)
    with PrivateRun.open(task.Tiny(), plan, tmp_path, population=task.users()) as run:
        with pytest.raises(RoundOrderError):
            run.released(0)  # nothing committed yet
        selection = run.select(task.users())
        run.aggregate({u: task.local_update(run.global_params(), u, 0) for u in selection.reachable})
        with pytest.raises(RoundOrderError):
            run.released(0)  # aggregated, not committed
        assert not (tmp_path / ROUND_LOG).exists()
        record = run.commit()
        record.metrics["accuracy"] = 0.25  # what a driver adds (its evaluation) before releasing
        run.released(0)
        with pytest.raises(RoundOrderError):
            run.released(0)  # released once
    lines = (tmp_path / ROUND_LOG).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["record"]["metrics"] == {"accuracy": 0.25}
    assert os.stat(tmp_path / ROUND_LOG).st_mode & 0o777 == 0o600


def test_train_logs_every_released_round(tmp_path):
    result = train(task.Tiny(), task.users(), task.plan(rounds=8), task.local_update, checkpoint_dir=tmp_path,
                   rounds=3, evaluate=lambda model: {"norm": float(model.linear.weight.detach().norm())})
    from fedmf.ledger import Ledger

    with Ledger.open(tmp_path / "ledger.db", secret=(tmp_path / "secrets" / "ledger_secret").read_bytes()) as book:
        run = book.run(result.run_id)
        committed = {t: run.round(t).checkpoint_sha256 for t in range(run.next_round)}
    logged = read_rounds(tmp_path, result.run_id, committed)
    assert [logged[t] for t in range(3)] == [asdict(r) for r in result.history]


def test_the_server_app_records_a_round_a_stop_cut_off_and_says_it_resumed(tmp_path, monkeypatch, caplog):
    """The ServerApp's code path stopped between round 1's commit and its release: the restart logs the
    round it resumed from, writes round 1's record evaluated from its checkpoint (the same evaluation
    as an uninterrupted run; the clients' train-loss and the strategy's observed-ε metric of that round
    are lost, the record says so), and
    logs the ledger head to record."""
    import logging

    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: both runs draw the same (unsalted) noise
    from client.app import app as client_app
    from fedmf.run.private_run import RECOVERED_EVALUATED
    from fedmf.tasks import get_task
    from launcher.flower_backend import flower_result
    from server.app import run_server
    from server.local_grid import LocalGrid, client_node

    def values(name):
        return {"task": "tiny", "task-options": '{"num_users": 8}', "rounds": 3, "min-sep": 2,
                "clients-per-round": 3, "noise-multiplier": 0.7, "client-lr": 0.2, "batch-size": 8,
                "run-dir": str(tmp_path / name), "reply-timeout": 5.0}

    def serve(name):
        nodes = {100 + i: client_node(client_app, {"partition-id": i}, 100 + i) for i in range(8)}
        run_server(LocalGrid(nodes), values(name))
        tiny = get_task("tiny", num_users=8)
        return flower_result(ServerConfig.from_mapping(values(name)), model=tiny.model(), evaluate=tiny.evaluate,
                             plot=False)

    reference = serve("ref").history
    task.share_secrets(tmp_path / "ref", tmp_path / "run")
    with monkeypatch.context() as patch:
        _stop_at(patch, 1, before_release=True)
        with pytest.raises(KeyboardInterrupt):
            serve("run")
    with caplog.at_level(logging.INFO, logger="fedmf.server"):
        resumed = serve("run")
    messages = [r.getMessage() for r in caplog.records if r.name == "fedmf.server"]
    assert "fedmf: resumed run 1 at round 2: rounds 0-1 of 3 were committed before" in messages
    assert any(m.startswith(f"fedmf: ledger head {resumed.chain_head} (record it outside the ledger") for m in messages)
    history = resumed.history
    lost = ("epsilon-worst-user-run",)  # the strategy's own round metric: not rebuilt
    assert history[1]["metrics"] == {k: v for k, v in reference[1]["metrics"].items() if k not in lost}
    assert "accuracy" in history[1]["metrics"] and "epsilon-worst-user-run" in reference[1]["metrics"]
    assert "train-loss" not in reference[1]["metrics"]  # no client-reported value is published
    assert _without_timing(history[::2]) == _without_timing(reference[::2])
    lines = [json.loads(line) for line in (tmp_path / "run" / ROUND_LOG).read_text().splitlines()]
    assert [(line["round"], line.get("recovered")) for line in lines] == [(0, None), (1, RECOVERED_EVALUATED),
                                                                           (2, None)]
