"""A run that is not learning says so (fedmf.run.learning_check): a non-finite model stops the run with one
line, a held-out loss above the initial one by 20% for 3 evaluations gives one line (and stops it with
--stop-when-diverging); results.json records it."""

from __future__ import annotations

import json

import pytest
import torch

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.run.learning_check import (
    DIVERGENCE_EVALUATIONS,
    DIVERGENCE_MARGIN,
    INITIAL_EVALUATION_FILE,
    NOT_FINITE_FILE,
    LearningCheck,
    model_is_finite,
)
from tests import _federated_task as task


def test_divergence_needs_the_margin_for_consecutive_evaluations(tmp_path):
    assert (DIVERGENCE_MARGIN, DIVERGENCE_EVALUATIONS) == (0.2, 3)  # the README states these
    said = []
    check = LearningCheck(settings={"server-lr": 4.0, "clip-norm": 0.5}, announce=said.append)
    assert check.start(tmp_path, 0, lambda: {"loss": 2.0, "accuracy": 0.1}) is None
    assert json.loads((tmp_path / INITIAL_EVALUATION_FILE).read_text()) == {"loss": 2.0, "accuracy": 0.1}
    # 2.4 is the limit (2.0 · 1.2): at it is not above; a lower loss resets the count
    for t, loss in enumerate([2.5, 2.41, 2.4, 2.5, 2.6, 1.0, 2.5, 2.5]):
        assert check.observe(t, {"loss": loss}) is None
        assert check.status == "learning", t
    assert check.observe(8, {"loss": 3.0}) is None  # the third in a row (rounds 6-8): said, not stopped
    assert check.status == "diverging" and check.round == 8 and len(said) == 1 and said[0] == check.line
    assert check.line.startswith("not learning: the held-out loss has been above the initial 2 by more than 20% "
                                 "for 3 evaluations (rounds 6-8; now 3)")
    assert "--server-lr 4" in check.line and "--clip-norm 0.5" in check.line and check.line.endswith("the run goes on")
    check.observe(9, {"loss": 3.0})
    assert len(said) == 1  # one line, once
    # a resumed invocation reads the initial loss back (the model now is not the initial one)
    again = LearningCheck(stop_when_diverging=True)
    assert again.start(tmp_path, 5, lambda: {"loss": 9.0}) is None and again.initial_loss == 2.0
    assert [again.observe(t, {"loss": 2.5}) for t in (5, 6)] == [None, None]
    assert again.observe(7, {"loss": 2.5}) == again.line and again.line.endswith("the run stopped (--stop-when-diverging)")
    assert again.to_dict() == {"status": "diverging", "line": again.line, "round": 7, "initial_loss": 2.0,
                               "last_loss": 2.5, "margin": 0.2, "evaluations": 3, "stop_when_diverging": True}


def test_a_model_that_is_not_finite_stops_and_a_resume_does_not_play_on_it(tmp_path):
    assert model_is_finite([torch.ones(2)]) and not model_is_finite([torch.ones(2), torch.tensor([float("inf")])])
    check = LearningCheck(flag="")
    check.start(tmp_path, 0, lambda: {"loss": 1.0})
    bad = [torch.tensor([1.0, float("nan")])]
    why = check.observe(2, {"loss": 1.1}, bad)
    assert why == check.line and check.status == "not-finite" and check.round == 2
    assert why.startswith("not learning: the model is not finite (NaN or inf) after round 2")
    assert "server-lr" in why and "--" not in why  # a run config's names
    nan_loss = LearningCheck().observe(0, {"loss": float("nan")}, [torch.ones(1)])
    assert nan_loss.startswith("not learning: the held-out loss is not finite")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    resumed = LearningCheck()
    assert resumed.start(fresh, 3, None, bad).startswith("not learning: the model committed in round 2")
    # a resume evaluates nothing, and its finite model plays on ...
    never = lambda: pytest.fail("a resume evaluated the model")  # noqa: E731
    clean = tmp_path / "clean"
    clean.mkdir()
    assert LearningCheck().start(clean, 3, never, [torch.ones(1)]) is None
    # ... unless an earlier invocation found the model or its held-out loss not finite (kept on disk)
    assert json.loads((tmp_path / NOT_FINITE_FILE).read_text()) == {"round": 2}
    assert LearningCheck().start(tmp_path, 3, never, [torch.ones(1)]) is not None
    lossy = tmp_path / "lossy"
    lossy.mkdir()
    checked = LearningCheck()
    checked.start(lossy, 0, lambda: {"loss": 1.0})
    assert checked.observe(0, {"loss": float("inf")}, [torch.ones(1)]) is not None
    assert LearningCheck().start(lossy, 1, never, [torch.ones(1)]) is not None


def _simulate(tmp_path, capsys, name, *args):
    from fedmf.cli import main

    out = tmp_path / name
    code = main(["simulate", "--preset", "tiny", "--rounds", "4", "--noise-multiplier", "1", "--no-plot", "--quiet",
                 "--out", str(out), *args])
    text = capsys.readouterr()
    return code, text.out, json.loads((out / "results.json").read_text())


def test_a_huge_server_learning_rate_is_said_to_diverge(tmp_path, capsys):
    from fedmf.tasks import get_task

    tiny = get_task("tiny", num_users=40)
    with torch.no_grad():
        initial = float(tiny.evaluate(tiny.model())["loss"])
    code, out, results = _simulate(tmp_path, capsys, "warn", "--server-lr", "50")
    assert code == 0 and results["rounds_done"] == 4 and results["stopped"] == "horizon"
    learning = results["learning"]
    assert learning["status"] == "diverging" and learning["round"] == 2 and learning["initial_loss"] == initial
    losses = [h["metrics"]["loss"] for h in results["history"]]
    assert all(loss > initial * 1.2 for loss in losses[:3])  # what the rule saw
    lines = [line for line in out.splitlines() if line.startswith("learning ")]
    assert len(lines) == 1 and learning["line"] in lines[0] and "--server-lr 50" in lines[0]
    code, out, results = _simulate(tmp_path, capsys, "stop", "--server-lr", "50", "--stop-when-diverging")
    assert code == 0 and results["rounds_done"] == 3 and results["stopped"].startswith("learning: not learning:")
    assert results["learning"]["status"] == "diverging" and "(learning)" in out


def test_a_non_finite_model_stops_the_run_with_its_line(tmp_path, capsys):
    code, out, results = _simulate(tmp_path, capsys, "nan", "--server-lr", "1e30")
    assert code == 0 and results["rounds_done"] == 1
    assert results["stopped"].startswith("learning: not learning: the held-out loss is not finite (NaN or inf) "
                                         "after round 0")
    assert results["learning"]["status"] == "not-finite" and results["history"][0]["metrics"]["loss"] is None
    stopped = [line for line in out.splitlines() if line.startswith("stopped ")]
    assert len(stopped) == 1 and "--server-lr 1e+30" in stopped[0]
    # the same command again: no round is played on that model
    code, out, results = _simulate(tmp_path, capsys, "nan", "--server-lr", "1e30")
    assert code == 0 and results["rounds_done"] == 1 and "resuming cannot help" in results["stopped"]


def test_a_deployment_stops_on_a_non_finite_model_without_sending_it(tmp_path, caplog):
    import logging

    from flwr.app import MessageType

    from fedmf.run.private_run import PrivateRun
    from server.config import ServerConfig
    from server.local_grid import LocalGrid
    from server.strategy import DPMFStrategy
    from tests.flower.test_server_strategy import honest_node

    nodes = {7000 + i: honest_node(u) for i, u in enumerate(task.users())}
    config = ServerConfig.from_mapping({"noise-multiplier": 0.8, "reply-timeout": 5.0, "task-options": "{}",
                                     "server-lr": 1e10, "clip-norm": 1e30})
    grid = LocalGrid(nodes)
    # ζ = 1e30: noise of std ~1e30 in the sum; × server-lr 1e10 ÷ 10 users overflows float32 (3.4e38)
    schema = MinSep(task.MIN_SEP, task.PARTICIPATIONS)
    plan = RunPlan.create(build("bsr", 4, schema, Workload(momentum=0.5), num_bands=task.MIN_SEP), schema,
                          clip_norm=1e30, delta=1e-5, expected_users=10, noise_multiplier=0.8)
    task.write_secrets(tmp_path / "run", b"overflow")
    with caplog.at_level(logging.INFO, logger="fedmf.server"), \
            PrivateRun.open(task.Tiny(), plan, tmp_path / "run", population=task.users(), server_lr=1e10,
                            repeatable_noise=True) as run:
        strategy = DPMFStrategy(run, config)  # no server-side evaluation: the finiteness check needs none
        strategy.start(grid)
        assert run.next_round == 1 and not model_is_finite(run.model.parameters())
    assert strategy.stopped.startswith("learning: not learning: the model is not finite (NaN or inf) after round 0")
    assert "lower the server learning rate (server-lr 1e+10) or the clip norm (clip-norm 1e+30)" in strategy.stopped
    trained = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert {m.content.config_records["config"]["round"] for m in trained} == {0}  # the model of round 1 never left
    assert sum("not learning" in r.getMessage() for r in caplog.records if r.levelname == "WARNING") == 1
