"""The one round loop (fedmf.run.loop) that both drivers run — the in-process ``train`` and the
Flower strategy's ``start``: the order of a round's steps (commit before anything is released), how
the guard ends it, the observed guard's default, the retry hook, and both drivers going through it
with the same outcome."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedmf.errors import HorizonReached, PrivacyBudgetExceeded
from fedmf.ledger.db import LedgerError
from fedmf.run import loop as round_loop
from fedmf.run.federated import train
from fedmf.run.loop import GUARD, ROUND, LoopEnd, observed_accounting, observed_guard, run_rounds
from fedmf.run.private_run import PrivateRun, RoundRecord
from fedmf.schedule import Selection
from server.local_grid import LocalGrid
from server.strategy import DPMFStrategy
from tests import _federated_task as task
from tests.flower.test_server_strategy import CONFIG, _nodes

#: one round as the loop runs it: PrivateRun's events, the cohort step and the driver's hooks
ROUND_STEPS = ("guarded", "selected", "cohort", "updates", "noised", "stepped", "checkpointed", "committed", "witnessed",
               "committed-hook", "evaluate", "released", "on_round")


def _zeros(selection: Selection):
    return {user: {"linear.weight": torch.zeros(2, 4), "linear.bias": torch.zeros(2)}
            for user in selection.reachable}, None


def _traced(run: PrivateRun, trace: list, end: int, history: list, observed: bool | None = None) -> LoopEnd:
    def cohort(selection):
        trace.append(("cohort", selection.round))
        return _zeros(selection)

    def evaluate(record):
        trace.append(("evaluate", record.round))
        return {"score": record.round}

    return run_rounds(run, end, lambda t: task.users(), cohort, history=history, observed=observed,
                      committed=lambda record, report: trace.append(("committed-hook", record.round)),
                      evaluate=evaluate, on_round=lambda record: trace.append(("on_round", record.round)))


def test_each_round_is_committed_before_anything_of_it_is_released(tmp_path):
    """Guard → select → cohort → aggregate → commit, then (only then) the driver's metrics,
    evaluation, the release mark and the per-round callback; resumed, the loop goes on from the
    committed round and ends at the horizon."""
    trace: list = []
    history: list[RoundRecord] = []
    plan = task.plan(rounds=6)
    with PrivateRun.open(task.Tiny(), plan, tmp_path, population=task.users(),
                         on_event=lambda event, t: trace.append((event, t))) as run:
        end = _traced(run, trace, 4, history)
    assert end == LoopEnd("rounds") and end.stopped == "rounds"
    assert trace == [(step, t) for t in range(4) for step in ROUND_STEPS]
    assert [r.round for r in history] == [0, 1, 2, 3]
    assert [r.metrics for r in history] == [{"score": float(t)} for t in range(4)]
    trace.clear()
    with PrivateRun.open(task.Tiny(), plan, tmp_path, population=task.users(),
                         on_event=lambda event, t: trace.append((event, t))) as run:
        end = _traced(run, trace, plan.rounds, history)
    assert end == LoopEnd("horizon") and end.stopped == "horizon"
    assert trace == [(step, t) for t in (4, 5) for step in ROUND_STEPS]


def _budget_plan(rounds: int = 12):
    """A plan whose target ε stops the run before its horizon: the planned ε at ``stop`` (the
    observed guard, the worst user's ε over the whole run, may stop it earlier)."""
    curve = task.plan(rounds=rounds).epsilon_by_round()
    stop = next(t for t in range(4, rounds) if curve[t] > curve[t - 1] * (1 + 1e-6))
    return task.plan(rounds=rounds, target_epsilon=float(curve[stop - 1] + curve[stop]) / 2), stop


def test_the_guard_ends_the_loop_before_anything_of_the_round(tmp_path):
    plan, stop = _budget_plan()
    trace: list = []
    history: list[RoundRecord] = []
    with PrivateRun.open(task.Tiny(), plan, tmp_path, population=task.users(),
                         on_event=lambda event, t: trace.append((event, t))) as run:
        end = _traced(run, trace, plan.rounds, history, observed=False)  # the planned ε only
        assert run.next_round == stop
    assert end.reason == "guard" and isinstance(end.stop, PrivacyBudgetExceeded)
    assert end.stopped == f"guard: {end.stop}" and f"round {stop} would spend" in end.stopped
    assert trace == [(step, t) for t in range(stop) for step in ROUND_STEPS]  # nothing of round `stop`
    assert len(history) == stop


class FakeRun:
    """PrivateRun's round interface, recording the loop's calls; the guard stops at ``stop_at``
    (HorizonReached at the plan's horizon), the ledger fails ``failures`` times in round 1."""

    def __init__(self, plan, stop_at: int | None = None, failures: int = 0) -> None:
        self.plan, self.next_round, self.stop_at, self.failures = plan, 0, stop_at, failures
        self.calls: list = []

    def missing_records(self) -> list:
        return []  # every committed round has its record (recover_records: test_round_log.py)

    def guard(self, observed: bool = False) -> None:
        self.calls.append(("guard", self.next_round, observed))
        if self.next_round == self.stop_at:
            raise HorizonReached("stop here")

    def select(self, available):
        self.calls.append(("select", self.next_round))
        users = tuple(sorted(available))
        return Selection(self.next_round, users, users, ())

    def aggregate(self, updates, rejected):
        self.calls.append(("aggregate", self.next_round, sorted(updates), rejected))
        if self.next_round == 1 and self.failures:
            self.failures -= 1
            raise LedgerError("down")
        return "report"

    def commit(self) -> RoundRecord:
        self.calls.append(("commit", self.next_round))
        self.next_round += 1
        return RoundRecord(self.next_round - 1, 0.0, 2, 2, 0, 0, 0, 0, 0.0, 0)

    def released(self, t: int) -> None:
        self.calls.append(("released", t))


def _plans():
    unamplified_target = task.plan(rounds=8, target_epsilon=50.0)
    return {"no target": task.plan(rounds=8), "unamplified, target": unamplified_target,
            "amplified, target": task.plan(rounds=8, sampling="bminsep:0.5", target_epsilon=50.0)}


def test_the_observed_guard_is_on_for_unamplified_runs_with_a_target_only():
    plans = _plans()
    assert {name: observed_guard(p) for name, p in plans.items()} == {
        "no target": False, "unamplified, target": True, "amplified, target": False}
    assert {name: observed_accounting(p) for name, p in plans.items()} == {
        "no target": True, "unamplified, target": True, "amplified, target": False}
    for name, plan in plans.items():  # the loop's default, and a driver's explicit choice
        for given, used in ((None, observed_guard(plan)), (True, True), (False, False)):
            run = FakeRun(plan, stop_at=2)
            assert run_rounds(run, 8, lambda t: ["a", "b"], lambda s: ({u: 0 for u in s.reachable}, None),
                              observed=given).reason == "guard"
            assert [c[2] for c in run.calls if c[0] == "guard"] == [used] * 3, name


def test_the_retry_hook_wraps_the_guard_and_the_round_up_to_its_commit():
    """``retry`` gets the guard and the round (select → cohort → aggregate → commit) as separate
    steps; a round redone after a ledger failure selects again; what follows the commit (metrics,
    evaluation, release) runs once, outside it."""
    stages: list = []

    def retry(t, step, stage):
        stages.append((t, stage))
        try:
            return step()
        except LedgerError:
            stages.append((t, "again"))
            return step()

    run = FakeRun(task.plan(rounds=8), failures=1)
    cohorts: list = []
    end = run_rounds(run, 3, lambda t: ["b", "a"], lambda s: cohorts.append(s.round) or ({"a": 1}, {"b": "bad"}),
                     evaluate=lambda record: None, retry=retry)
    assert end == LoopEnd("rounds")
    assert stages == [(0, GUARD), (0, ROUND), (1, GUARD), (1, ROUND), (1, "again"), (2, GUARD), (2, ROUND)]
    assert cohorts == [0, 1, 1, 2]
    assert [c for c in run.calls if c[0] != "guard"] == [
        ("select", 0), ("aggregate", 0, ["a"], {"b": "bad"}), ("commit", 0), ("released", 0),
        ("select", 1), ("aggregate", 1, ["a"], {"b": "bad"}),  # the ledger failed: redone
        ("select", 1), ("aggregate", 1, ["a"], {"b": "bad"}), ("commit", 1), ("released", 1),
        ("select", 2), ("aggregate", 2, ["a"], {"b": "bad"}), ("commit", 2), ("released", 2)]
    horizon = FakeRun(task.plan(rounds=8), stop_at=0)
    end = run_rounds(horizon, 8, lambda t: ["a"], lambda s: pytest.fail("no round may start"))
    assert end.reason == "guard" and isinstance(end.stop, HorizonReached) and end.stopped == "guard: stop here"


def test_both_drivers_run_the_shared_loop_to_the_same_outcome(tmp_path, monkeypatch, caplog):
    """``train`` and ``DPMFStrategy.start`` on a target-ε plan: every round goes through
    ``round_loop.play_round``, every guard checks the observed ε (on by default for this plan),
    both stop at the same round on the same guard message (train: ``guard: <message>``, the
    strategy: the message, and its "stopping" line) with bit-identical models."""
    played: list = []
    play = round_loop.play_round

    def spy_play(run, available, cohort):
        played.append((run.directory.name, run.next_round))
        return play(run, available, cohort)

    guarded: list = []
    guard = PrivateRun.guard

    def spy_guard(self, observed=False):
        guarded.append((self.directory.name, observed))
        return guard(self, observed)

    monkeypatch.setattr(round_loop, "play_round", spy_play)
    monkeypatch.setattr(PrivateRun, "guard", spy_guard)
    plan, planned_stop = _budget_plan()
    reference = task.Tiny()
    task.write_secrets(tmp_path / "loop")  # a fixed schedule: where the observed guard stops is fixed
    result = train(reference, task.users(), plan, task.local_update, checkpoint_dir=tmp_path / "loop",
                   repeatable_noise=True)
    task.share_secrets(tmp_path / "loop", tmp_path / "flower")
    model = task.Tiny()
    with caplog.at_level(logging.INFO, logger="fedmf.server"):
        with PrivateRun.open(model, plan, tmp_path / "flower", population=task.users(),
                             repeatable_noise=True) as run:
            strategy = DPMFStrategy(run, CONFIG)
            strategy.start(LocalGrid(_nodes()))
    stop = result.rounds_done
    assert 0 < stop <= planned_stop
    for side in ("loop", "flower"):
        assert [t for name, t in played if name == side] == list(range(stop)), side
        assert [observed for name, observed in guarded if name == side] == [True] * (stop + 1), side
    assert result.rounds_done == len(result.history) == len(strategy.history) == stop
    assert result.stopped == f"guard: {strategy.stopped}"
    assert f"round {stop} " in strategy.stopped and "above the target" in strategy.stopped
    assert f"fedmf: stopping: {strategy.stopped}" in caplog.messages
    assert [r.epsilon for r in result.history] == [r.epsilon for r in strategy.history]
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_flower_hooks_driven_by_hand_give_starts_rounds(tmp_path):
    """``configure_train`` → ``send_and_receive`` → ``aggregate_train`` (what benchmarks/server.py
    drives, with the guard before and the release after, as their docstrings ask) commit the same
    rounds, bit for bit, as ``start``'s loop; ``aggregate_train`` with no round configured is refused."""
    plan = task.plan(rounds=5)
    task.write_secrets(tmp_path / "start")
    task.share_secrets(tmp_path / "start", tmp_path / "hooks")
    models = {}
    for side in ("start", "hooks"):
        models[side] = task.Tiny()
        with PrivateRun.open(models[side], plan, tmp_path / side, population=task.users(),
                             repeatable_noise=True) as run:
            strategy, grid = DPMFStrategy(run, CONFIG), LocalGrid(_nodes())
            if side == "start":
                strategy.start(grid)
                continue
            with pytest.raises(RuntimeError):
                strategy.aggregate_train(1, [])
            while run.next_round < plan.rounds:
                t = run.next_round
                run.guard()
                messages = strategy.configure_train(t + 1, ArrayRecord(run.model.state_dict()), ConfigRecord(), grid)
                arrays, metrics = strategy.aggregate_train(t + 1, grid.send_and_receive(messages, timeout=5.0))
                run.released(t)
                assert metrics["epsilon"] == strategy.history[-1].epsilon and metrics["selected"] > 0
            assert [r.round for r in strategy.history] == list(range(plan.rounds))
    for name, value in models["start"].state_dict().items():
        assert torch.equal(models["hooks"].state_dict()[name], value), name
