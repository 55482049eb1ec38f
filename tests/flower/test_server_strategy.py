"""The Flower strategy driven in process (server.local_grid): bit-identical to the in-process loop,
bad replies rejected and recorded, never aggregated, never fatal."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from sqlalchemy import select

from fedmf.ledger.models import Participation
from fedmf.run.federated import train
from fedmf.run.private_run import PrivateRun
from server.config import ServerConfig
from server.local_grid import LocalGrid
from server.strategy import DPMFStrategy
from tests import _federated_task as task

ROUNDS = 10
CONFIG = ServerConfig.from_mapping({"noise-multiplier": 0.8, "reply-timeout": 5.0,
                                 "task-options": "{}"})  # the task options the strategy sends its clients


def honest_node(user: str, behaviour: str = "honest"):
    """A node answering as ``user`` with the task's deterministic local update."""

    def node(message: Message):
        if message.metadata.message_type == MessageType.QUERY:
            return Message(RecordDict({"identity": ConfigRecord({"user-id": user})}), reply_to=message)
        config = message.content.config_records["config"]
        params = message.content.array_records["arrays"].to_torch_state_dict()
        t = config["round"]
        update = task.local_update(params, user, t)
        if update is None or behaviour == "silent":
            return None
        reply_config = {"round": t, "run-nonce": config["run-nonce"], "user-id": user}
        if behaviour == "error":
            return Message(Error(code=1, reason="boom"), reply_to=message)
        if behaviour == "nan":
            update = {k: torch.full_like(v, float("nan")) for k, v in update.items()}
        if behaviour == "shape":
            update = {k: torch.zeros(3) for k in update}
        if behaviour == "extra":
            update = {**update, "intruder": torch.zeros(2)}
        if behaviour == "old-round":
            reply_config["round"] = t - 1
        if behaviour == "other-nonce":
            reply_config["run-nonce"] = "0" * 32
        if behaviour == "impostor":
            reply_config["user-id"] = "u00"
        if behaviour == "no-arrays":
            return Message(RecordDict({"config": ConfigRecord(reply_config)}), reply_to=message)
        arrays = ArrayRecord(update)
        if behaviour == "corrupt":  # right names, shapes and dtype; damaged bytes
            name = next(iter(update))
            good = arrays[name]
            arrays[name] = Array(good.dtype, good.shape, good.stype, good.data[:5])
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(reply_config),
                              "metrics": MetricRecord({"num-examples": 8, "train-loss": 1.0})})
        return Message(content, reply_to=message)

    return node


def _strategy_run(directory, nodes, rounds=ROUNDS, grid_class=LocalGrid):
    model = task.Tiny()
    plan = task.plan(rounds=rounds)
    # repeatable noise: the tests compare the aggregate with another run's on the same secrets
    with PrivateRun.open(model, plan, directory, population=task.users(), repeatable_noise=True) as run:
        strategy = DPMFStrategy(run, CONFIG)
        strategy.start(grid_class(nodes))
        return model.state_dict(), strategy


def _nodes(behaviours=None):
    behaviours = behaviours or {}
    return {7000 + i: honest_node(u, behaviours.get(u, "honest")) for i, u in enumerate(task.users())}


def test_flower_strategy_matches_the_in_process_loop_bit_for_bit(tmp_path):
    reference = task.Tiny()
    train(reference, task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=tmp_path / "loop",
          repeatable_noise=True)
    task.share_secrets(tmp_path / "loop", tmp_path / "flower")
    final, strategy = _strategy_run(tmp_path / "flower", _nodes())
    for name, value in reference.state_dict().items():
        assert torch.equal(final[name], value), name
    assert [r.round for r in strategy.history] == list(range(ROUNDS))
    assert strategy.stopped == "horizon"


BAD = {"u01": "nan", "u02": "shape", "u03": "error", "u04": "old-round", "u05": "other-nonce", "u06": "impostor",
       "u08": "no-arrays", "u09": "extra", "u10": "silent", "u11": "corrupt"}


class TamperingGrid(LocalGrid):
    """Adds, to every round's replies, a second reply from the first replying user and a reply
    from a node of a known user that was not selected."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        train_messages = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if not train_messages:
            return replies
        selected = {m.metadata.dst_node_id for m in train_messages}
        first = train_messages[0]
        duplicate = self.nodes[first.metadata.dst_node_id](first)
        if duplicate is not None:
            replies.append(duplicate)
        outsider = next(n for n in self.nodes if n not in selected)
        forged = Message(first.content, dst_node_id=outsider, message_type=MessageType.TRAIN)
        reply = self.nodes[outsider](forged)
        if reply is not None:
            replies.append(reply)
        return replies


def test_bad_replies_are_rejected_recorded_and_never_aggregated(tmp_path):
    clean_dir, dirty_dir = tmp_path / "clean", tmp_path / "dirty"
    silent = {u: "silent" for u in BAD}
    task.write_secrets(clean_dir)  # a fixed schedule: every bad user below is selected at least once
    clean, _ = _strategy_run(clean_dir, _nodes(silent))
    task.share_secrets(clean_dir, dirty_dir)
    dirty, strategy = _strategy_run(dirty_dir, _nodes(BAD), grid_class=TamperingGrid)
    # the aggregate is exactly what it is when the bad users send nothing at all
    for name, value in clean.items():
        assert torch.equal(dirty[name], value), name
    run = strategy.run
    with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), dirty_dir, population=task.users()) as reopened:
        names = {reopened.user_key(u): u for u in task.users()}
        with reopened._book.engine.connect() as conn:
            rows = conn.execute(select(Participation.round_index, Participation.client_key, Participation.status,
                                       Participation.reason)).all()
    assert run.run_id == 1
    reasons = defaultdict(set)
    for _, key, status, reason in rows:
        user = names[bytes(key)]
        if status == "rejected" and "not selected" in reason:
            reasons["outsider"].add(reason)
        elif user in BAD and status != "dropped":
            reasons[user].add(reason)
        elif user not in BAD and user not in (task.NAN_USER, task.SHAPE_USER, task.DROPOUT_USER):
            assert status == "contributed", (user, status, reason)
    expected = {"u01": "non-finite", "u02": "shape", "u03": "client error", "u04": "another round",
                "u05": "another round", "u06": "another user", "u08": "no arrays", "u09": "differ",
                "u11": "not a mapping"}
    for user, fragment in expected.items():
        assert reasons[user] and all(fragment in r for r in reasons[user]), (user, reasons[user])
    assert any("not selected" in r for r in reasons["outsider"])
    assert "u10" not in reasons  # silent: dropped, not rejected


def test_round_metrics_carry_the_planned_rho(tmp_path):
    plan = task.plan(rounds=4)
    with PrivateRun.open(task.Tiny(), plan, tmp_path, population=task.users(), repeatable_noise=True) as run:
        result = DPMFStrategy(run, CONFIG).start(LocalGrid(_nodes()))
    rhos = [result.train_metrics_clientapp[t + 1]["rho"] for t in range(4)]
    assert rhos == [plan.rho_after(t) for t in range(4)] and rhos == sorted(rhos)
    # un-amplified: ρ = 1/(2z²) at the end (Bun & Steinke 2016, Prop. 1.6)
    assert rhos[-1] == pytest.approx(0.5 / 0.8**2, rel=1e-12)
