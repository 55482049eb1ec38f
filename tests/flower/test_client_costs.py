"""What a client can cost the server is bounded (issue 34, item 4): enrolled keys are validated once,
at load, so a bogus proof costs one signature verification; a node that misses its TRAIN reply backs
off like a node that fails an identity query, and that changes only who is reachable, never whom the
scheduler samples (it still counts as sampled); the in-process loop redoes a round whose budget charge
lost to a concurrent run, as the Flower strategy does."""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import MessageType
from sqlalchemy import select
from sqlalchemy.orm import Session

from fedmf import enrollment as enrollment_module
from fedmf.budgets import ConcurrentChargeError, RunBudget
from fedmf.enrollment import EnrolledKey, Enrollment, EnrollmentFile, generate_key_pair, sign_proof, verify_proof
from fedmf.ledger import Ledger, LedgerError
from fedmf.ledger.budgets import load_budget_secret
from fedmf.ledger.models import BudgetCharge, Participation
from fedmf.run import ledger_retry as retry_module
from fedmf.run.federated import train
from fedmf.run.ledger_retry import ledger_retry
from fedmf.run.loop import ROUND
from fedmf.run.private_run import PrivateRun
from fedmf.schedule import make_scheduler
from server.config import ServerConfig
from server.identity import BACKOFF_MAX_S, BACKOFF_S, IdentityPolicy, NodeDirectory
from server.local_grid import LocalGrid
from server.strategy import DPMFStrategy
from tests import _federated_task as task
from tests.flower.test_identity import RUN, Clock, CountingGrid, _node, _raw
from tests.flower.test_server_strategy import honest_node
from tests.ledger.test_lifetime_budgets import USERS, _plan, _setup, _update

# ---- item 4a: enrolled keys are validated once ------------------------------------------------------


def test_an_enrolled_key_is_validated_once_at_load_and_never_per_proof(tmp_path, monkeypatch):
    keys = {u: tmp_path / f"{u}.key" for u in ("alice", "bob", "mallory")}
    publics = {u: generate_key_pair(p) for u, p in keys.items()}
    path = tmp_path / "enrollment.json"
    Enrollment(publics).save(path)
    calls = []
    real = enrollment_module.check_public_key
    monkeypatch.setattr(enrollment_module, "check_public_key", lambda raw: calls.append(raw) or real(raw))
    source = EnrollmentFile(path)
    assert sorted(calls) == sorted(publics.values())  # each key once, when the file is read
    calls.clear()
    policy = IdentityPolicy("enrolled", source, frozenset(keys))
    directory = NodeDirectory(policy, run=RUN, clock=Clock())
    impostor_path = tmp_path / "impostor.key"  # mallory is enrolled; this key is not hers: a bogus proof
    generate_key_pair(impostor_path)
    nodes = {1: _node(1, "alice", keys["alice"]), 2: _node(2, "bob", keys["bob"])}
    nodes.update({10 + i: _node(10 + i, "mallory", impostor_path) for i in range(20)})  # 20 bogus proofs
    grid = CountingGrid(nodes)
    assert directory.refresh(grid, 0) == {"alice": 1, "bob": 2}
    assert len(grid.exchanges) == 1 and len(grid.exchanges[0][0]) == 22
    assert calls == []  # 22 proofs checked, no key validated again
    # the verdicts equal those of the raw-key path, which validates the key on every call
    fields = (RUN, 3, 5, bytes(32), "alice")
    good = sign_proof(Ed25519PrivateKey.generate(), *fields)
    key = Ed25519PrivateKey.generate()
    signature = sign_proof(key, *fields)
    for sig, wanted in ((signature, True), (good, False), (bytes(64), False), (signature[:63], False)):
        assert verify_proof(_raw(key), sig, *fields) is wanted
        assert verify_proof(EnrolledKey(_raw(key)), sig, *fields) is wanted
    assert verify_proof(EnrolledKey(_raw(key)), signature, RUN, 3, 6, bytes(32), "alice") is False


# ---- item 4b: a node that misses its TRAIN reply backs off ------------------------------------------

def test_a_node_missing_train_replies_is_asked_again_only_after_a_growing_backoff(tmp_path):
    keys = {u: tmp_path / f"{u}.key" for u in ("alice", "bob")}
    path = tmp_path / "enrollment.json"
    Enrollment({u: generate_key_pair(p) for u, p in keys.items()}).save(path)
    clock = Clock()
    grid = CountingGrid({1: _node(1, "alice", keys["alice"]), 2: _node(2, "bob", keys["bob"])})
    directory = NodeDirectory(IdentityPolicy("enrolled", EnrollmentFile(path), frozenset(keys)), run=RUN,
                              clock=clock)
    start = clock.now
    assert directory.refresh(grid, 0) == {"alice": 1, "bob": 2}
    reachable_at: list[float] = []
    misses = 0
    while clock.now - start < 4000:
        reachable = directory.refresh(grid, 0)
        if "bob" in reachable:  # bob's node proves its identity but never answers TRAIN
            reachable_at.append(clock.now - start)
            directory.missed([2], 20.0)
            misses += 1
            if misses == 7:  # ... until it answers once: its backoff starts again from 30 s
                directory.answered([2])
        assert reachable["alice"] == 1
        clock.now += 5.0
    # missed at m, backoff b: back at the first multiple of b (on the directory's clock) at least b later
    backoffs = [min(BACKOFF_MAX_S, BACKOFF_S * 2 ** i) for i in range(7)]
    backoffs += [BACKOFF_S * 2 ** i for i in range(len(reachable_at) - 8)]  # the 7th miss was answered: 30 s again
    gaps = [b - a for a, b in zip(reachable_at, reachable_at[1:])]
    assert len(gaps) == len(backoffs) >= 9, (reachable_at, backoffs)
    assert all(b <= g < 2 * b and t % b == 0 for g, b, t in zip(gaps, backoffs, reachable_at[1:])), gaps
    assert reachable_at[:8] == [0.0, 30.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 2880.0]
    # each return costs one identity exchange with bob's node (a proof), never one per refresh
    assert sum(1 for nodes, _ in grid.exchanges if nodes == [2]) == len(reachable_at) - 1


def test_in_process_nodes_never_back_off(tmp_path):
    directory = NodeDirectory(IdentityPolicy("in-process"), run=RUN, clock=Clock())
    grid = LocalGrid({5: honest_node("u05")})
    assert directory.refresh(grid, 0) == {"u05": 5}
    directory.missed([5], 20.0)
    assert directory.refresh(grid, 1) == {"u05": 5}  # Flower's simulation stays the in-process loop's


SILENT = "u05"


class TimedGrid(LocalGrid):
    """A deployment's grid on a fake clock: a round costs 5 s, or the whole reply timeout when a node
    it sent a TRAIN message to stays silent; records (clock, round) of each TRAIN message to SILENT."""

    def __init__(self, nodes, clock: Clock, timeout: float) -> None:
        super().__init__(nodes)
        self.clock, self.timeout, self.to_silent = clock, timeout, []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if train:
            answered = {int(r.metadata.src_node_id) for r in replies}
            for m in train:
                if m.content.config_records["config"]["user-id"] == SILENT:
                    self.to_silent.append((self.clock.now, m.content.config_records["config"]["round"]))
            silent = any(int(m.metadata.dst_node_id) not in answered for m in train)
            self.clock.now += self.timeout if silent else 5.0
        return replies


def _silent_run(directory, sampling, expected, rounds):
    plan = task.plan(rounds=rounds, sampling=sampling, expected_users=expected, delta=1e-2 if sampling else 1e-5)
    config = ServerConfig.from_mapping({"noise-multiplier": 0.8, "reply-timeout": 20.0, "task-options": "{}"})
    clock = Clock()
    nodes = {7000 + i: honest_node(u, "silent" if u == SILENT else "honest") for i, u in enumerate(task.users())}
    grid = TimedGrid(nodes, clock, 20.0)
    task.write_secrets(directory)
    with PrivateRun.open(task.Tiny(), plan, directory, population=task.users(), repeatable_noise=True) as run:
        strategy = DPMFStrategy(run, config, identity=IdentityPolicy("declared-insecure",
                                                                     population=frozenset(task.users())))
        strategy.nodes = NodeDirectory(strategy.identity, run=RUN, clock=clock)
        strategy.start(grid)
        names = {run.user_key(u): u for u in task.users()}
        with Session(run._book.engine) as session:
            rows = session.execute(select(Participation.round_index, Participation.client_key,
                                          Participation.status)).all()
    by_round: dict[int, dict[str, str]] = defaultdict(dict)
    for t, key, status in rows:
        by_round[int(t)][names[bytes(key)]] = status
    return plan, grid, by_round


@pytest.mark.parametrize("sampling, expected, rounds", [(None, 10.0, 24), ("bminsep:0.3", 60 * 0.3 / 1.9, 24)])
def test_a_silent_train_node_backs_off_and_still_counts_as_sampled(tmp_path, sampling, expected, rounds):
    plan, grid, by_round = _silent_run(tmp_path / "run", sampling, expected, rounds)
    silent_rounds = sorted(t for t, users in by_round.items() if SILENT in users)
    sent_rounds = [t for _, t in grid.to_silent]
    assert len(sent_rounds) >= 2 and all(by_round[t][SILENT] == "dropped" for t in silent_rounds)
    # after each miss, no TRAIN message to it before its backoff has passed: 30 s, then 60 s, ...
    times = [c for c, _ in grid.to_silent]
    for i, (a, b) in enumerate(zip(times, times[1:])):
        assert b - a >= min(BACKOFF_MAX_S, BACKOFF_S * 2 ** i) + 20.0, (times, i)  # + the timeout it cost
    others = {u for users in by_round.values() for u, s in users.items() if s == "dropped"} - {SILENT}
    assert others <= {task.DROPOUT_USER}
    if sampling is None:
        # MinSep: while it backs off the user is not available, so it is selected only when reachable:
        # every selection of it is a TRAIN message (and so a recorded dropout)
        assert silent_rounds == sent_rounds
    else:
        # amplified: availability never changes the sample — the ledger holds exactly the scheduler's
        # decisions with every user available, and the backed-off user sampled is a dropout, sent nothing
        key = (tmp_path / "run" / "secrets" / "schedule_key").read_bytes()
        scheduler = make_scheduler(plan.schema, plan.sampling, key=key, rounds=plan.rounds, users_per_round=None,
                                   population=task.users())
        for t in range(rounds):
            assert set(by_round.get(t, {})) == set(map(str, scheduler.select(t, task.users()).selected)), t
        assert set(sent_rounds) < set(silent_rounds)  # sampled while backing off: counted, not sent to


# ---- item 4c: the in-process loop redoes a round a concurrent budget charge aborted ------------------

def test_ledger_retry_redoes_only_its_errors_and_gives_up_after_its_retries():
    calls, waits = [], []

    def failing(times, error):
        def step():
            calls.append(1)
            if len(calls) <= times:
                raise error("round 3: a concurrent run has spent ...")
            return "done"
        return step

    retry = ledger_retry((ConcurrentChargeError,), retries=2, backoff_s=1.0, backoff_max_s=1.5, sleep=waits.append)
    assert retry(3, failing(2, ConcurrentChargeError), ROUND) == "done" and len(calls) == 3 and waits == [1.0, 1.5]
    calls.clear()
    with pytest.raises(ConcurrentChargeError):
        retry(3, failing(5, ConcurrentChargeError), ROUND)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(LedgerError):  # another ledger failure: not retried in process
        retry(3, failing(1, LedgerError), ROUND)
    assert len(calls) == 1


def test_train_redoes_a_round_whose_budget_charge_lost_to_a_concurrent_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(retry_module, "LEDGER_BACKOFF_S", 0.01)
    url = str(tmp_path / "ledger.db")
    key = _setup(url, tmp_path, [1 / 0.64], {})  # room for one run of z = 0.8 per user
    plan = _plan(0.8)
    task.write_secrets(tmp_path / "run")
    events: list[tuple[str, int]] = []
    state = {}

    def concurrent(event, t):
        events.append((event, t))
        if (event, t) == ("selected", 2) and "other" not in state:
            # another run, between this round's selection and its charge, takes every user it can
            with Ledger.open(url, secret=b"o" * 32) as book:
                other = book.create_run(plan.mechanism, noise_multiplier=0.8, clip_norm=1.0, delta=1e-5,
                                        schema=plan.schema).id
                budget = RunBudget.open(book, load_budget_secret(key), plan, other)
                state["other"] = other
                state["taken"] = budget.admissible(2, USERS)
                budget.charge(2, state["taken"])

    with caplog.at_level(logging.WARNING, logger="fedmf"):
        result = train(task.Tiny(), USERS, plan, _update, checkpoint_dir=tmp_path / "run", ledger=url,
                       budget_key=key, rounds=4, on_event=concurrent, repeatable_noise=True)
    assert result.rounds_done == 4
    assert events.count(("selected", 2)) == 2  # round 2 aborted at its charge and redone
    assert any("concurrent run" in r.getMessage() and "retry 1/8" in r.getMessage() for r in caplog.records)
    secret = load_budget_secret(key)
    with Ledger.open(url) as book, Session(book.engine) as session:
        charges = session.execute(select(BudgetCharge.lifetime_key, BudgetCharge.run_id)).all()
    runs_of: dict[bytes, set[int]] = defaultdict(set)
    for lifetime_key, run_id in charges:
        runs_of[bytes(lifetime_key)].add(run_id)
    assert all(len(runs) == 1 for runs in runs_of.values())  # nobody charged by both runs: no overspending
    taken = {secret.lifetime_key(u) for u in state["taken"]}
    ours = {k for k, runs in runs_of.items() if result.run_id in runs}
    assert taken and ours and not taken & ours
    assert sum(r.selected for r in result.history[2:]) > 0  # the redone rounds selected users it had charged
    assert torch.isfinite(torch.tensor([r.epsilon for r in result.history])).all()
