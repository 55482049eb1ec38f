"""The plain-PyTorch federated loop: ledger = scheduler, schema kept, bad updates rejected,
noise enters once per round in the right place, crash-exact resume, the guard."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import select

from fedmf.errors import CheckpointError, PlanMismatch
from fedmf.ledger import Ledger
from fedmf.ledger.models import Participation
from fedmf.round.noise import NoiseGenerator
from fedmf.run.federated import train
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.schedule import make_scheduler
from tests import _federated_task as task

TASK = Path(__file__).resolve().parents[1] / "_federated_task.py"


_share_secrets = task.share_secrets


def _ledger_rows(directory: Path, run_id: int):
    secret = (directory / "secrets" / "ledger_secret").read_bytes()
    book = Ledger.open(directory / "ledger.db", secret=secret)
    run = book.run(run_id)
    with book.engine.connect() as conn:
        rows = conn.execute(select(Participation.round_index, Participation.client_key, Participation.status,
                                   Participation.reason).where(Participation.run_id == run_id)).all()
    return book, run, rows


@pytest.mark.parametrize("diagnostics", [False, True])
def test_update_norms_reach_the_ledger_only_with_diagnostics(tmp_path, diagnostics):
    from fedmf.audit.replay import audit
    from fedmf.audit.report import DIAGNOSTIC_COLUMNS
    from fedmf.ledger.models import UpdateNorm

    result = train(task.Tiny(), task.users(), task.plan(), task.local_update, checkpoint_dir=tmp_path, rounds=3,
                   ledger_diagnostics=diagnostics)
    book, run, rows = _ledger_rows(tmp_path, result.run_id)
    with book:
        with book.engine.connect() as conn:
            norms = conn.execute(select(UpdateNorm.update_norm)).scalars().all()
        recorded_clipped = [run.round(t).clipped for t in range(3)]
    contributed = sum(1 for _, _, status, _ in rows if status == "contributed")
    assert contributed == sum(r.contributed for r in result.history) > 0
    report = audit(tmp_path / "ledger.db", verify=True)
    assert report.chain.ok and report.run["diagnostics"] is diagnostics
    if diagnostics:
        assert len(norms) == contributed and all(n > 0 for n in norms)
        assert [r["clipped"] for r in report.rounds] == recorded_clipped == [r.clipped for r in result.history]
    else:
        assert norms == [] and recorded_clipped == [None] * 3 and not set(DIAGNOSTIC_COLUMNS) & set(report.columns)
        assert all(set(DIAGNOSTIC_COLUMNS).isdisjoint(r) for r in report.rounds)


@pytest.mark.parametrize("sampling, expected", [(None, 10.0), ("bminsep:0.3", 60 * 0.3 / (1 + 3 * 0.3))])
def test_ledger_equals_the_schedulers_decisions_and_bad_updates_are_rejected(tmp_path, sampling, expected):
    plan = task.plan(sampling=sampling, expected_users=expected, delta=1e-2 if sampling else 1e-5)
    model = task.Tiny()
    # diagnostics: the round records carry the zeroed count (outside the DP guarantee, so opted into)
    result = train(model, task.users(), plan, task.local_update, checkpoint_dir=tmp_path, ledger_diagnostics=True)
    assert result.rounds_done == task.ROUNDS and len(result.history) == task.ROUNDS
    book, run, rows = _ledger_rows(tmp_path, result.run_id)
    try:
        # replay the scheduler with the run's key: the ledger holds exactly its decisions
        key = (tmp_path / "secrets" / "schedule_key").read_bytes()
        scheduler = make_scheduler(plan.schema, plan.sampling, key=key, rounds=plan.rounds,
                                   users_per_round=None if sampling else 10, population=task.users())
        by_round = defaultdict(dict)
        for t, client_key, status, reason in rows:
            by_round[t][bytes(client_key)] = (status, reason)
        names = {run.key(u): u for u in task.users()}
        rounds_of = defaultdict(list)
        for t in range(task.ROUNDS):
            selection = scheduler.select(t, task.users())
            assert set(by_round[t]) == set(run.keys(selection.selected)), f"round {t}"
            for client_key, (status, reason) in by_round[t].items():
                user = names[client_key]
                rounds_of[user].append(t)
                if user == task.NAN_USER:
                    assert status == "rejected" and "non-finite" in reason
                elif user == task.SHAPE_USER:
                    assert status == "rejected" and "shape" in reason
                elif user == task.DROPOUT_USER:
                    assert status == "dropped"
                else:
                    assert status == "contributed"
        # no user broke the planned schema (selections, dropouts and rejections included)
        for user, rounds in rounds_of.items():
            assert plan.schema.allows(rounds, plan.rounds), (user, rounds)
        planted = {task.NAN_USER, task.SHAPE_USER, task.DROPOUT_USER, task.HUGE_USER}
        assert planted <= set(rounds_of), "every planted fault must have been selected at least once"
        zeroed = sum(r.zeroed for r in result.history)
        assert zeroed == len(rounds_of[task.HUGE_USER])
    finally:
        book.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_zero_updates_give_theta0_plus_lr_A_noise_over_m(tmp_path, device):
    """Noise enters exactly once per round, after the sum, before the optimizer: with all-zero
    updates θ_{t+1} = θ_0 + η·(A·σ C⁻¹Z / m)_t for the generator's own Z — salted per round by
    the salts the last checkpoint holds, drawn on the model's device (on a GPU when the model
    is there)."""
    plan = task.plan(rounds=16)
    model = task.Tiny(torch.float64).to(device)
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    trajectory = []
    zeros = lambda params, user, t: {k: torch.zeros_like(v) for k, v in params.items()}  # noqa: E731
    train(model, task.users(), plan, zeros, server_lr=0.3, checkpoint_dir=tmp_path,
          on_round=lambda r: trajectory.append({k: v.detach().clone() for k, v in model.named_parameters()}))
    seed = (tmp_path / "secrets" / "noise_seed").read_bytes()[:32]  # after it: the binding to its run
    layout = {k: tuple(v.shape) for k, v in theta0.items()}
    salts = task.checkpoint_salts(tmp_path)
    assert len(salts) == 16 and len(set(salts)) == 16 and all(len(s) == 16 for s in salts)
    gen = NoiseGenerator(plan.mechanism, layout, plan.noise_std, dtype=torch.float64, device=device, seed=seed,
                         salted=True)
    noise = np.stack([torch.cat([v.reshape(-1) for v in gen.next(salt=s).values()]).cpu().numpy() for s in salts])
    a = plan.mechanism.workload.matrix(16)
    expected = torch.cat([v.reshape(-1) for v in theta0.values()]).cpu().numpy() + 0.3 * (a @ noise) / 10
    got = np.stack([torch.cat([v.reshape(-1) for v in step.values()]).cpu().numpy() for step in trajectory])
    assert all(v.device.type == device for step in trajectory for v in step.values())
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_guard_stops_before_the_first_round_over_budget(tmp_path):
    free = task.plan()
    curve = free.epsilon_by_round()
    jumps = [t for t in range(5, task.ROUNDS) if curve[t] > curve[t - 1] * (1 + 1e-6)]
    target = float(curve[jumps[0] - 1] + curve[jumps[0]]) / 2
    plan = task.plan(target_epsilon=target)
    result = train(task.Tiny(), task.users(), plan, task.local_update, checkpoint_dir=tmp_path)
    assert result.rounds_done == jumps[0] and result.stopped.startswith("guard")
    assert len(result.history) == jumps[0]
    assert max(r.epsilon for r in result.history) <= target


def test_another_plan_is_refused_on_resume(tmp_path):
    train(task.Tiny(), task.users(), task.plan(rounds=8), task.local_update, checkpoint_dir=tmp_path, rounds=3)
    with pytest.raises(PlanMismatch):
        train(task.Tiny(), task.users(), task.plan(rounds=8, zero_threshold=None), task.local_update,
              checkpoint_dir=tmp_path)


def test_resume_after_a_clean_stop_is_bit_identical(tmp_path):
    straight = task.Tiny()
    train(straight, task.users(), task.plan(rounds=10), task.local_update, checkpoint_dir=tmp_path / "a",
          repeatable_noise=True)
    _share_secrets(tmp_path / "a", tmp_path / "b")
    resumed = task.Tiny()
    first = train(resumed, task.users(), task.plan(rounds=10), task.local_update, checkpoint_dir=tmp_path / "b",
                  rounds=4, repeatable_noise=True)
    assert first.rounds_done == 4
    resumed = task.Tiny()  # a fresh process would start from θ_0: the checkpoint restores round 3's state
    train(resumed, task.users(), task.plan(rounds=10), task.local_update, checkpoint_dir=tmp_path / "b",
          repeatable_noise=True)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def _run_task(directory: Path, out: Path, *kill: str) -> subprocess.CompletedProcess:
    env = {**os.environ, REPEATABLE_NOISE_ENV: "1"}  # bit-identical to the reference even for a redone round
    return subprocess.run([sys.executable, str(TASK), str(directory), str(out), *kill], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same task run in this process, without interruption (repeatable noise)."""
    directory = tmp_path_factory.mktemp("straight")
    model = task.Tiny()
    train(model, task.users(), task.plan(rounds=12), task.local_update, checkpoint_dir=directory,
          repeatable_noise=True)
    return directory, model.state_dict()


@pytest.mark.parametrize("event, t", [
    pytest.param("updates", 3, marks=pytest.mark.heavy),  # inside the round, before the noise
    ("checkpointed", 5),   # after the noise draw and the checkpoint, before the ledger commit
    ("committed", 6),      # after the commit, before the release and the pruning
    pytest.param("selected", 0, marks=pytest.mark.heavy),
    pytest.param("noised", 4, marks=pytest.mark.heavy),
    pytest.param("stepped", 11, marks=pytest.mark.heavy),
])
def test_sigkill_then_resume_is_bit_identical(tmp_path, uninterrupted, event, t):
    reference_dir, reference = uninterrupted
    _share_secrets(reference_dir, tmp_path / "run")
    out = tmp_path / "model.pt"
    killed = _run_task(tmp_path / "run", out, event, str(t))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists()
    finished = _run_task(tmp_path / "run", out)
    assert finished.returncode == 0, finished.stderr[-2000:]
    final = torch.load(out, weights_only=True)
    for name, value in reference.items():
        assert torch.equal(final[name], value), name
    book, run, rows = _ledger_rows(tmp_path / "run", 1)
    try:
        assert run.next_round == 12
        per_round = defaultdict(list)
        for r, client_key, _, _ in rows:
            per_round[r].append(bytes(client_key))
        assert all(len(keys) == len(set(keys)) for keys in per_round.values())  # nothing written twice
        killed_round = run.round(t)
        assert killed_round.status == "committed"
        # killed before the round was opened, or after its commit: one attempt; else redone once
        assert killed_round.attempts == (1 if event in ("selected", "committed") else 2)
    finally:
        book.close()


def test_a_lost_run_file_never_starts_a_second_run_with_the_same_noise(tmp_path):
    train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, checkpoint_dir=tmp_path, rounds=2)
    (tmp_path / "run.json").unlink()
    with pytest.raises(CheckpointError, match="noise is never reused"):
        train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, checkpoint_dir=tmp_path)


def test_an_abort_that_cannot_restore_leaves_nothing_releasable(tmp_path):
    from fedmf.errors import RoundOrderError
    from fedmf.run.private_run import PrivateRun

    with PrivateRun.open(task.Tiny(), task.plan(rounds=6), tmp_path, population=task.users()) as run:
        selection = run.select(task.users())
        run.aggregate({u: task.local_update(run.global_params(), u, 0) for u in selection.reachable
                       if u not in (task.DROPOUT_USER,)})
        with pytest.raises(RoundOrderError):
            run.global_params()  # aggregated but not committed: nothing may leave
        (tmp_path / "initial.pt").unlink()
        with pytest.raises(CheckpointError):
            run.abort("test")
        with pytest.raises(RoundOrderError, match="cannot continue"):
            run.global_params()
        with pytest.raises(RoundOrderError, match="cannot continue"):
            run.select(task.users())


def test_abort_restores_the_committed_state_and_the_redo_is_identical(tmp_path):
    from fedmf.run.private_run import PrivateRun

    task.write_secrets(tmp_path / "a")
    task.share_secrets(tmp_path / "a", tmp_path / "b")
    results = []
    for name, fail in (("a", False), ("b", True)):
        model = task.Tiny()
        with PrivateRun.open(model, task.plan(rounds=6), tmp_path / name, population=task.users(),
                             repeatable_noise=True) as run:
            for t in range(3):
                for attempt in range(2 if (fail and t == 1) else 1):
                    selection = run.select(task.users())
                    run.aggregate({u: task.local_update(run.global_params(), u, t) for u in selection.reachable})
                    if fail and t == 1 and attempt == 0:
                        run.abort("simulated failure before the commit")
                        continue
                    run.commit()
        results.append(model.state_dict())
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def test_a_lost_run_file_and_ledger_still_never_reuse_the_noise_seed(tmp_path):
    train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, checkpoint_dir=tmp_path, rounds=2)
    (tmp_path / "run.json").unlink()
    (tmp_path / "ledger.db").unlink()
    with pytest.raises(CheckpointError, match="noise is never reused"):
        train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, checkpoint_dir=tmp_path)
    for name in list(tmp_path.iterdir()):  # even with every checkpoint gone: the seed is marked as used
        if name.is_file():
            name.unlink()
    with pytest.raises(CheckpointError, match="noise is never reused"):
        train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, checkpoint_dir=tmp_path)
