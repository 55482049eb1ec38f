"""Bad client messages against the real DP-MF strategy (issue 13 item 6).

Every kind of bad reply below is sent through ``DPMFStrategy`` over an in-process ``LocalGrid``,
mixed into rounds with honest users, and checked three ways:

(a) it is rejected with a reason recorded in the ledger (senders with no known user: not
    recordable, so counted by ``RoundReplies.unknown`` and, where the code logs, logged);
(b) it is never aggregated: the final model is bit-for-bit the model of a run with the same
    fixed secrets in which those users sent nothing (``_federated_task.write_secrets`` /
    ``share_secrets``);
(c) the server never crashes: every round is committed.

The same replies at random (a hypothesis fuzz): test_fuzzed_replies.py. The last tests here are
bugs these tests found, fixed.
"""

from __future__ import annotations

import io
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from sqlalchemy import select

from fedmf.ledger.models import Participation, UpdateNorm
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.run.private_run import PrivateRun
from server import strategy as strategy_module
from server.config import ServerConfig
from server.local_grid import LocalGrid
from server.replies import RoundReplies
from server.strategy import DPMFStrategy
from tests import _federated_task as task

ROUNDS = 10
CONFIG = ServerConfig.from_mapping({"noise-multiplier": 0.8, "reply-timeout": 5.0,
                                 "task-options": "{}"})  # the task options the strategy sends its clients
USERS = task.users()
NODE = {user: 7000 + i for i, user in enumerate(USERS)}
PLANTED = {task.NAN_USER, task.SHAPE_USER, task.HUGE_USER, task.DROPOUT_USER}  # faults of local_update itself
LAYOUT = {"linear.weight": (2, 4), "linear.bias": (2,)}
ZETA = 1.0  # task.plan's clip norm; its zero threshold is the default 100·ζ


# ---- building replies ------------------------------------------------------------------------------
def npy(array: np.ndarray, **kw: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **kw)
    return buffer.getvalue()


def raw_array(dtype: str, shape: tuple[int, ...], data: bytes, stype: str = "numpy.ndarray") -> Array:
    """An Array whose declared metadata (dtype, shape, stype) is whatever we say, data too."""
    return Array(dtype, tuple(shape), stype, data)


def forge_src(message: Message, src: object) -> Message:
    """The reply claims another sender (Metadata has no setter for it)."""
    message.metadata.__dict__["_src_node_id"] = src
    return message


@dataclass
class Ctx:
    """What a node knows when it answers round ``t``."""

    message: Message
    user: str
    t: int
    nonce: str
    update: dict[str, torch.Tensor]
    state: dict[str, Any]

    def config(self, **over: Any) -> dict[str, Any]:
        return {"round": self.t, "run-nonce": self.nonce, "user-id": self.user, **over}

    def metrics(self) -> MetricRecord:  # varies by user, so that a wrongly counted metric shows
        return MetricRecord({"num-examples": 8, "train-loss": float(int(self.user[1:]))})

    def reply(self, arrays: Any = "honest", config: Any = "honest", metrics: Any = "honest") -> Message:
        records: dict[str, Any] = {}
        if arrays is not None:
            records["arrays"] = ArrayRecord(self.update) if isinstance(arrays, str) else arrays
        if config is not None:
            records["config"] = ConfigRecord(self.config() if isinstance(config, str) else config)
        if metrics is not None:
            records["metrics"] = self.metrics() if isinstance(metrics, str) else metrics
        return Message(RecordDict(records), reply_to=self.message)

    def with_update(self, **tensors: torch.Tensor) -> ArrayRecord:
        return ArrayRecord({**self.update, **{k.replace("__", "."): v for k, v in tensors.items()}})


def _set(update: Mapping[str, torch.Tensor], name: str, index: tuple[int, ...], value: float) -> dict:
    out = {k: v.clone() for k, v in update.items()}
    out[name][index] = value
    return out


def _arrays(update: Mapping[str, Any]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in update.items()})


def _npy_record(ctx: Ctx, weight: Array) -> ArrayRecord:
    return ArrayRecord({"linear.weight": weight, "linear.bias": Array(ctx.update["linear.bias"].numpy())})


def _weight(ctx: Ctx) -> np.ndarray:
    return ctx.update["linear.weight"].numpy()


def _no_content(ctx: Ctx) -> Message:
    reply = ctx.reply()
    reply.__dict__["_content"] = None  # neither content nor error
    return reply


def _not_a_recorddict(ctx: Ctx) -> Message:
    reply = ctx.reply()
    reply.__dict__["_content"] = {"arrays": ArrayRecord(ctx.update), "config": ctx.config()}
    return reply


def _metrics_garbage(ctx: Ctx) -> Message:
    metrics = MetricRecord({"num-examples": 8, "train-loss": float("nan")})
    return ctx.reply(metrics=metrics)


def _metrics_strings(ctx: Ctx) -> Message:
    metrics = MetricRecord({"num-examples": 8, "train-loss": 1.0})
    metrics.__dict__["_data"].update({"train-loss": "0.1", "num-examples": "8"})  # past MetricRecord's type check
    return ctx.reply(metrics=metrics)


def _metrics_infinite(ctx: Ctx) -> Message:
    return ctx.reply(metrics=MetricRecord({"num-examples": float("inf"), "train-loss": -float("inf")}))


def _replay(ctx: Ctx) -> Message | None:
    earlier = ctx.state.get("last")  # the content of this user's reply to an earlier round
    assert earlier is not None and earlier.content.config_records["config"]["round"] < ctx.t
    return Message(earlier.content, reply_to=ctx.message)


def _replay_verbatim(ctx: Ctx) -> Message | None:
    earlier = ctx.state.get("last")  # the very Message object, its old metadata and all
    assert earlier is not None
    return earlier


def _second_reply(ctx: Ctx) -> list[Message]:
    huge = {k: torch.full_like(v, 50.0) for k, v in ctx.update.items()}  # would be clipped and summed if read
    return [ctx.reply(), ctx.reply(arrays=ArrayRecord(huge))]


def _bad_then_good(ctx: Ctx) -> list[Message]:
    return [ctx.reply(arrays=ArrayRecord(_set(ctx.update, "linear.bias", (0,), float("nan")))), ctx.reply()]


def _oversized(ctx: Ctx) -> Message:
    small = Array(np.zeros(1, dtype=np.float32))
    arrays = ArrayRecord({**{k: Array(v.numpy()) for k, v in ctx.update.items()},
                          **{f"extra.{i}": small for i in range(20_000)}})
    return ctx.reply(arrays=arrays)


def _silent(ctx: Ctx) -> None:
    return None


@dataclass(frozen=True)
class Kind:
    """A bad reply: what the node sends (``dirty``), what it sends in the reference run
    (``clean``: nothing, unless the kind's update is legitimately summed), and the ledger row
    expected for its user in that round (status, a fragment of the reason)."""

    dirty: Callable[[Ctx], Any]
    status: str
    reason: str | None
    clean: Callable[[Ctx], Any] = _silent
    needs_earlier_reply: bool = False


def HONEST(ctx: Ctx) -> Message:  # noqa: N802 - a constant, as the kinds read
    return ctx.reply()
NON_FINITE = "has non-finite values"
MISMATCH = "do not match the model"
ANOTHER_ROUND = "reply for another round or server"
UNREADABLE = "not a mapping of tensors"
OVER_SHAPE = "its shape in float32 needs"  # more bytes than the declared shape and dtype take as .npy

KINDS: dict[str, Kind] = {
    # values
    "nan": Kind(lambda c: c.reply(arrays=ArrayRecord(_set(c.update, "linear.weight", (1, 2), float("nan")))),
                "rejected", NON_FINITE),
    "+inf": Kind(lambda c: c.reply(arrays=ArrayRecord(_set(c.update, "linear.bias", (1,), float("inf")))),
                 "rejected", NON_FINITE),
    "-inf": Kind(lambda c: c.reply(arrays=ArrayRecord(_set(c.update, "linear.weight", (0, 0), -float("inf")))),
                 "rejected", NON_FINITE),
    "float64 overflowing float32": Kind(
        lambda c: c.reply(arrays=_arrays({"linear.weight": np.full((2, 4), 1e300), "linear.bias": np.zeros(2)})),
        "rejected", "overflow the model's dtype"),
    "huge l2 (clipped)": Kind(lambda c: c.reply(arrays=ArrayRecord({k: torch.full_like(v, 50.0)
                                                                    for k, v in c.update.items()})),
                              "contributed", None,
                              clean=lambda c: c.reply(arrays=ArrayRecord({k: torch.full_like(v, 50.0)
                                                                          for k, v in c.update.items()}))),
    "huge linf (zeroed)": Kind(lambda c: c.reply(arrays=ArrayRecord(_set(c.update, "linear.weight", (0, 1), 1e4))),
                               "contributed", None),
    # shapes, dtypes, names
    "wrong shape (transposed)": Kind(lambda c: c.reply(arrays=c.with_update(
        linear__weight=c.update["linear.weight"].T.contiguous())),
                                     "rejected", "shape (4, 2)"),
    "wrong shape (scalar)": Kind(lambda c: c.reply(arrays=c.with_update(linear__bias=torch.tensor(0.5))),
                                 "rejected", "shape ()"),
    "dtype int": Kind(lambda c: c.reply(arrays=c.with_update(linear__weight=torch.ones(2, 4, dtype=torch.int32))),
                      "rejected", "dtype 'int32'"),
    "dtype complex": Kind(lambda c: c.reply(arrays=_arrays({"linear.weight": np.ones((2, 4), np.complex64),
                                                            "linear.bias": c.update["linear.bias"]})),
                          "rejected", "dtype 'complex64'"),
    "dtype bool": Kind(lambda c: c.reply(arrays=c.with_update(linear__bias=torch.ones(2, dtype=torch.bool))),
                       "rejected", "dtype 'bool'"),
    "extra tensor": Kind(lambda c: c.reply(arrays=c.with_update(intruder=torch.zeros(2))), "rejected",
                         "update names differ"),
    "missing tensor": Kind(lambda c: c.reply(arrays=ArrayRecord({"linear.weight": c.update["linear.weight"]})),
                           "rejected", "update names differ"),
    "oversized (20,000 extra arrays)": Kind(_oversized, "rejected", "update names differ"),
    # .npy payloads that disagree with the declared metadata
    "npy dtype != declared": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(_weight(c).astype(np.float64))))), "rejected", UNREADABLE),
    "npy shape != declared": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(_weight(c).reshape(8))))), "rejected", UNREADABLE),
    "npy truncated": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(_weight(c))[:-7]))), "rejected", UNREADABLE),
    "npy pickled object array": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(np.array([{"x": 1}] * 8, dtype=object).reshape(2, 4),
                                            allow_pickle=True)))), "rejected", OVER_SHAPE),
    "npy big-endian": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(_weight(c).astype(">f4"))))), "rejected", UNREADABLE),
    "stype not numpy": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(_weight(c)), stype="torch.Tensor"))), "rejected", UNREADABLE),
    # round, server, user
    "update for another round": Kind(lambda c: c.reply(config=c.config(round=c.t - 1 if c.t else c.t + 1)),
                                     "rejected", ANOTHER_ROUND),
    "another nonce": Kind(lambda c: c.reply(config=c.config(**{"run-nonce": "f" * 32})), "rejected", ANOTHER_ROUND),
    "another user-id": Kind(lambda c: c.reply(config=c.config(**{"user-id": "u00" if c.user != "u00" else "u01"})),
                            "rejected", "names another user"),
    "round as string": Kind(lambda c: c.reply(config=c.config(round=str(c.t))), "rejected", ANOTHER_ROUND),
    "nonce as int": Kind(lambda c: c.reply(config=c.config(**{"run-nonce": 12345})), "rejected", ANOTHER_ROUND),
    "user-id as int": Kind(lambda c: c.reply(config=c.config(**{"user-id": int(c.user[1:])})), "rejected",
                           "names another user"),
    "replay of an earlier reply's content": Kind(_replay, "rejected", ANOTHER_ROUND, needs_earlier_reply=True),
    "replay of an earlier reply verbatim": Kind(_replay_verbatim, "rejected", ANOTHER_ROUND, needs_earlier_reply=True),
    "second reply in the round (first stands)": Kind(_second_reply, "contributed", None, clean=HONEST),
    "second reply after a rejected one": Kind(_bad_then_good, "rejected", NON_FINITE),
    # envelopes
    "error reply": Kind(lambda c: Message(Error(code=7, reason="boom"), reply_to=c.message), "rejected",
                        "client error (code 7)"),
    "empty content (no content, no error)": Kind(_no_content, "rejected", "empty reply"),
    "empty RecordDict": Kind(lambda c: Message(RecordDict(), reply_to=c.message), "rejected", "no config record"),
    "no config record": Kind(lambda c: c.reply(config=None), "rejected", "no config record"),
    "config under another name": Kind(lambda c: Message(RecordDict({"arrays": ArrayRecord(c.update),
                                                                    "cfg": ConfigRecord(c.config())}),
                                                        reply_to=c.message), "rejected", "no config record"),
    "no arrays record": Kind(lambda c: c.reply(arrays=None), "rejected", "no arrays record"),
    "arrays under another name": Kind(lambda c: Message(RecordDict({"params": ArrayRecord(c.update),
                                                                    "config": ConfigRecord(c.config())}),
                                                        reply_to=c.message), "rejected", "no arrays record"),
    "content not a RecordDict": Kind(_not_a_recorddict, "rejected", "malformed reply"),
    # metrics: the update is fine and summed; the bad metrics must not reach the released train-loss
    "metrics NaN": Kind(_metrics_garbage, "contributed", None, clean=lambda c: c.reply(metrics=None)),
    "metrics strings": Kind(_metrics_strings, "contributed", None, clean=lambda c: c.reply(metrics=None)),
    "metrics infinite": Kind(_metrics_infinite, "contributed", None, clean=lambda c: c.reply(metrics=None)),
    # legitimately different encodings of the honest update: summed, bit-identical to the honest one
    "float64 update (exact in float32)": Kind(
        lambda c: c.reply(arrays=ArrayRecord({k: v.double() for k, v in c.update.items()})), "contributed", None,
        clean=HONEST),
    "Fortran-order npy": Kind(lambda c: c.reply(arrays=_npy_record(
        c, raw_array("float32", (2, 4), npy(np.asfortranarray(_weight(c)))))), "contributed", None, clean=HONEST),
}
ACCEPTED_EQUIVALENT = {"float64 update (exact in float32)", "Fortran-order npy"}

#: nodes that answer the identity QUERY badly: never identified, never selected
BAD_IDENTITIES: dict[int, Callable[[Message], Message | None]] = {
    9001: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": ""})}), reply_to=m),
    9002: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": "u\x00x"})}), reply_to=m),
    9003: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": "x" * 10_000})}), reply_to=m),
    9004: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": "u01\n"})}), reply_to=m),
    9005: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": "u\u200b02"})}), reply_to=m),
    9006: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": 3})}), reply_to=m),
    9007: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": b"u03"})}), reply_to=m),
    9008: lambda m: Message(RecordDict({"config": ConfigRecord({"user-id": "u04"})}), reply_to=m),
    9009: lambda m: Message(Error(code=1, reason="no"), reply_to=m),
    9010: lambda m: Message(RecordDict(), reply_to=m),
}


# ---- the nodes and the grid ------------------------------------------------------------------------
def make_node(user: str, plan: Mapping[tuple[str, int], str], mode: str, kinds: Mapping[str, Kind] = KINDS):
    """A node answering as ``user``: honest (task.local_update), except in the rounds where
    ``plan`` gives it a bad kind (``mode`` "dirty": the kind's reply; "clean": the reference)."""
    state: dict[str, Any] = {}

    def node(message: Message):
        if message.metadata.message_type == MessageType.QUERY:
            return Message(RecordDict({"identity": ConfigRecord({"user-id": user})}), reply_to=message)
        config = message.content.config_records["config"]
        params = message.content.array_records["arrays"].to_torch_state_dict()
        t = config["round"]
        update = task.local_update(params, user, t)
        if update is None:
            return None
        ctx = Ctx(message, user, t, config["run-nonce"], update, state)
        kind = plan.get((user, t))
        out = ctx.reply() if kind is None else getattr(kinds[kind], mode)(ctx)
        if kind is None:
            state["last"] = out
        return out

    return node


class BadGrid(LocalGrid):
    """A LocalGrid whose nodes may answer with several messages, and which adds, to each round's
    replies, messages from senders that were not asked (``inject``)."""

    def __init__(self, nodes, inject: Callable[[list[Message]], list[Any]] | None = None) -> None:
        super().__init__(nodes)
        self.inject = inject

    def pull_messages(self, message_ids):
        replies = []
        for message_id in message_ids:
            message = self._outbox.pop(message_id)
            node = self.nodes.get(message.metadata.dst_node_id)
            out = node(message) if node is not None else None
            replies.extend(out if isinstance(out, list) else [] if out is None else [out])
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if train and self.inject is not None:
            replies.extend(self.inject(train))
        return replies


UNLOGGED_UNKNOWN = 2  # per round: a non-Message and a reply whose sender id is not an int


def outsider_of(selected: set[str]) -> str:
    return next(u for u in USERS if u not in selected and u not in PLANTED)


def inject(train: list[Message]) -> list[Any]:
    """Per round: a reply from the node of a known user who was not selected (recorded), from a
    node nobody knows and from every badly identified node (logged), a non-Message and a reply
    whose sender id is not an integer (counted)."""
    first = train[0]
    config = first.content.config_records["config"]
    t, nonce = config["round"], config["run-nonce"]
    params = first.content.array_records["arrays"].to_torch_state_dict()
    selected = {m.content.config_records["config"]["user-id"] for m in train}

    def reply(user: str, src: object) -> Message:
        update = task.local_update(params, user, t)
        content = RecordDict({"arrays": ArrayRecord(update),
                              "config": ConfigRecord({"round": t, "run-nonce": nonce, "user-id": user}),
                              "metrics": MetricRecord({"num-examples": 8, "train-loss": 1e6})})
        return forge_src(Message(content, reply_to=first), src)

    outsider = outsider_of(selected)
    out: list[Any] = [reply(outsider, NODE[outsider]), reply("u00", 424242)]
    out += [reply("u00", node) for node in BAD_IDENTITIES]
    out += ["not a message", reply("u00", "not-a-node-id")]
    return out


def schedule_of(directory) -> dict[int, list[str]]:
    """The users the fixed secrets' scheduler selects in each round when all users are reachable
    (the same in both runs: selection never depends on replies)."""
    with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), directory, population=USERS) as run:
        return {t: sorted(run.scheduler.select(t, USERS).selected) for t in range(ROUNDS)}


def assign(schedule: dict[int, list[str]], per_round: int = 5) -> dict[tuple[str, int], str]:
    """Each kind gets one (user, round) slot in which the user is selected; at most
    ``per_round`` bad users a round, so every round keeps honest users. A replay goes to a
    user's second selection, after an honest first one."""
    plan: dict[tuple[str, int], str] = {}
    rounds_of = defaultdict(list)
    for t, users in schedule.items():
        for u in users:
            rounds_of[u].append(t)
    load = Counter()
    reserved: set[tuple[str, int]] = set()
    replays = [k for k, kind in KINDS.items() if kind.needs_earlier_reply]
    for user in sorted(rounds_of):
        if not replays:
            break
        if user not in PLANTED and len(rounds_of[user]) >= 2 and load[rounds_of[user][1]] < per_round:
            first, second = rounds_of[user][:2]
            plan[(user, second)] = replays.pop()
            reserved.add((user, first))
            load[second] += 1
    rest = [k for k, kind in KINDS.items() if not kind.needs_earlier_reply]
    used = {u for u, _ in plan}
    for t in range(ROUNDS):
        for user in schedule[t]:
            if rest and load[t] < per_round and user not in PLANTED and user not in used \
                    and (user, t) not in reserved:
                plan[(user, t)] = rest.pop(0)
                used.add(user)
                load[t] += 1
    missing = replays + rest
    assert not missing, f"the fixed schedule has no slot for {missing}; raise ROUNDS or per_round"
    return plan


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def server_log():
    """The fedmf.server log lines (a handler of our own: server.app.main may have turned
    propagation off for the process, which would hide them from caplog)."""
    logger = logging.getLogger("fedmf.server")
    handler = ListHandler()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def counted_replies(monkeypatch):
    """Every round's RoundReplies, to read the count of replies from unknown senders."""
    seen: list[RoundReplies] = []

    class Counting(RoundReplies):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            seen.append(self)

    monkeypatch.setattr(strategy_module, "RoundReplies", Counting)
    return seen


def _run(directory, nodes, inject_fn=None):
    model = task.Tiny()
    grid = BadGrid(nodes, inject_fn)
    # repeatable noise (tests only): the clean and the dirty run are compared bit for bit;
    # ledger diagnostics: the norms and clipping, to check them
    with PrivateRun.open(model, task.plan(rounds=ROUNDS), directory, population=USERS,
                         repeatable_noise=True, ledger_diagnostics=True) as run:
        strategy = DPMFStrategy(run, CONFIG)
        result = strategy.start(grid)
        names = {run.user_key(u): u for u in USERS}
        with run._book.engine.connect() as conn:
            rows = conn.execute(select(Participation.round_index, Participation.client_key, Participation.status,
                                       Participation.reason, UpdateNorm.update_norm, UpdateNorm.clipped)
                                .outerjoin(UpdateNorm, (UpdateNorm.run_id == Participation.run_id)
                                           & (UpdateNorm.round_index == Participation.round_index)
                                           & (UpdateNorm.client_key == Participation.client_key))).all()
    ledger = {(names[bytes(key)], t): (status, reason, norm, clipped) for t, key, status, reason, norm, clipped in rows}
    return model.state_dict(), strategy, result, grid, ledger


def test_bad_messages_are_rejected_recorded_never_aggregated_never_fatal(tmp_path, server_log, counted_replies):
    probe, clean_dir, dirty_dir = tmp_path / "probe", tmp_path / "clean", tmp_path / "dirty"
    task.write_secrets(probe)
    schedule = schedule_of(probe)
    plan = assign(schedule)
    assert len(KINDS) >= 20 and set(plan.values()) == set(KINDS)
    task.share_secrets(probe, clean_dir)
    task.share_secrets(probe, dirty_dir)

    clean, _, _, _, clean_ledger = _run(clean_dir, {NODE[u]: make_node(u, plan, "clean") for u in USERS})
    del counted_replies[:]
    server_log.clear()
    dirty_nodes = {NODE[u]: make_node(u, plan, "dirty") for u in USERS} | BAD_IDENTITIES
    dirty, strategy, result, grid, ledger = _run(dirty_dir, dirty_nodes, inject)

    # (c) never fatal: every round ran and was committed, on the schedule of the reference run
    assert strategy.stopped == "horizon" and [r.round for r in strategy.history] == list(range(ROUNDS))
    selected = defaultdict(set)
    for m in grid.sent:
        if m.metadata.message_type == MessageType.TRAIN:
            config = m.content.config_records["config"]
            selected[config["round"]].add(config["user-id"])
    assert {t: sorted(u) for t, u in selected.items()} == schedule

    # (b) never aggregated: bit for bit the model of the run where these users sent nothing
    for name, value in clean.items():
        assert torch.equal(dirty[name], value), name
    assert result.arrays.to_torch_state_dict().keys() == clean.keys()
    for mine in strategy.history:
        # by default nothing a client reports is published (its private release: the tests below)
        assert "train-loss" not in mine.metrics and "noisy-train-loss" not in mine.metrics

    # (a) rejected with its reason in the ledger (or, for accepted kinds, what happened to it)
    for (user, t), kind_name in sorted(plan.items(), key=lambda item: item[0][1]):
        kind = KINDS[kind_name]
        status, reason, norm, clipped = ledger[(user, t)]
        assert status == kind.status, (kind_name, user, t, status, reason)
        if kind.reason is not None:
            assert kind.reason in reason, (kind_name, reason)
            assert user not in reason  # reasons never name the user
        if kind_name == "huge l2 (clipped)":
            assert clipped and norm == pytest.approx(50.0 * math.sqrt(10), rel=1e-6)
            assert ledger[(user, t)] == clean_ledger[(user, t)]
        if kind_name == "huge linf (zeroed)":
            assert norm > 1e4 - 1 and clipped is False
        if kind_name in ACCEPTED_EQUIVALENT or kind_name.startswith("second reply in"):
            assert ledger[(user, t)] == clean_ledger[(user, t)]
    zeroed_slots = Counter(t for (u, t), k in plan.items() if k == "huge linf (zeroed)")
    zeroed_slots.update(t for t, users in schedule.items() if task.HUGE_USER in users)
    assert [r.zeroed for r in strategy.history] == [zeroed_slots[t] for t in range(ROUNDS)]
    assert sum(r.clipped for r in strategy.history) >= 1

    # a known user's node that was not selected: rejected and recorded for that user and round
    for t, users in schedule.items():
        status, reason, _, _ = ledger[(outsider_of(set(users)), t)]
        assert status == "rejected" and f"not selected for round {t}" in reason
    # every other selected user is as in the reference run (honest ones contributed)
    bad_slots = set(plan) | {(outsider_of(set(users)), t) for t, users in schedule.items()}
    for key, row in clean_ledger.items():
        if key not in bad_slots:
            assert ledger[key] == row, key
    for t, users in schedule.items():
        honest = [u for u in users if (u, t) not in plan and u not in PLANTED]
        assert honest and all(ledger[(u, t)][0] == "contributed" for u in honest), t

    # senders with no known user: not in the ledger, counted, and logged where the code logs
    assert len(counted_replies) == ROUNDS
    unknown_senders = 1 + len(BAD_IDENTITIES)  # the unknown node and the badly identified ones
    assert [r.unknown for r in counted_replies] == [unknown_senders + UNLOGGED_UNKNOWN] * ROUNDS
    not_selected_logs = [line for line in server_log if "reply rejected (reply from a node not selected" in line]
    assert len(not_selected_logs) == ROUNDS * unknown_senders
    seconds = sum(1 for k in plan.values() if k.startswith("second reply"))
    assert sum("a second reply from one user ignored" in line for line in server_log) == seconds
    assert len({key for key in ledger}) == len(ledger)

    # a bad identity: asked once, never identified, never selected
    for node in BAD_IDENTITIES:
        sent = [m for m in grid.sent if m.metadata.dst_node_id == node]
        assert [m.metadata.message_type for m in sent] == [MessageType.QUERY], node
        assert strategy.nodes.user_of(node) is None


# ---- bugs found by these tests, fixed -------------------------------------
def _identity_grid(bad_reply: Callable[[Message], Any]) -> tuple[LocalGrid, dict]:
    nodes = {NODE[u]: make_node(u, {}, "dirty") for u in USERS}
    nodes[9100] = bad_reply
    return LocalGrid(nodes), nodes


#: the private client-metric release (fedmf.round.client_metrics): losses clipped to [0, 2], noise std 0.5
PRIVATE_METRICS = ClientMetricRelease.create(2.0, 0.5, expected_users=10)


def _start_one_round(tmp_path, grid, **plan) -> DPMFStrategy:
    with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS, **plan), tmp_path / "run", population=USERS) as run:
        strategy = DPMFStrategy(run, CONFIG)
        strategy.start(grid, num_rounds=1)
        return strategy


def _identity_with_forged_sender(message: Message) -> Message:
    reply = Message(RecordDict({"identity": ConfigRecord({"user-id": "u99"})}), reply_to=message)
    return forge_src(reply, "not-a-node-id")


def _identity_not_a_recorddict(message: Message) -> Message:
    reply = Message(RecordDict({"identity": ConfigRecord({"user-id": "u99"})}), reply_to=message)
    reply.__dict__["_content"] = {"identity": {"user-id": "u99"}}
    return reply


@pytest.mark.parametrize("bad_reply", [_identity_with_forged_sender, _identity_not_a_recorddict],
                         ids=["sender-id-not-int", "content-not-a-recorddict"])
def test_a_malformed_identity_reply_does_not_crash_the_server(tmp_path, bad_reply):
    grid, _ = _identity_grid(bad_reply)
    strategy = _start_one_round(tmp_path, grid)
    assert strategy.run.next_round == 1


def test_the_released_train_loss_stays_finite(tmp_path):
    def node_for(user: str):
        honest = make_node(user, {}, "dirty")

        def node(message: Message):
            reply = honest(message)
            if message.metadata.message_type == MessageType.TRAIN and reply is not None:
                sign = 1.0 if int(user[1:]) % 2 else -1.0
                reply.content["metrics"] = MetricRecord({"num-examples": 1e200, "train-loss": sign * 1e200})
            return reply

        return node

    grid = LocalGrid({NODE[u]: node_for(u) for u in USERS})
    strategy = _start_one_round(tmp_path, grid, client_metrics=PRIVATE_METRICS)
    assert math.isfinite(strategy.history[0].metrics["noisy-train-loss"])
    assert "train-loss" not in strategy.history[0].metrics


def test_an_int_metric_too_large_for_a_float_is_ignored_and_the_update_kept(tmp_path):
    def node_for(user: str):
        honest = make_node(user, {}, "dirty")

        def node(message: Message):
            reply = honest(message)
            if message.metadata.message_type == MessageType.TRAIN and reply is not None:
                reply.content["metrics"] = MetricRecord({"num-examples": 8, "train-loss": 10 ** 400})
            return reply

        return node

    grid = LocalGrid({NODE[u]: node_for(u) for u in USERS})
    strategy = _start_one_round(tmp_path, grid, client_metrics=PRIVATE_METRICS)
    record = strategy.history[0]
    # the update is kept; the value counts as 0 in the private release (a float cannot hold it)
    assert record.contributed >= 1 and "train-loss" not in record.metrics
    assert math.isfinite(record.metrics["noisy-train-loss"])


def test_a_rejected_reply_does_not_change_the_released_train_loss(tmp_path):
    task.write_secrets(tmp_path / "probe")
    schedule = schedule_of(tmp_path / "probe")
    user = next(u for u in schedule[0] if u not in PLANTED)

    def nan_with_metrics(ctx: Ctx) -> Message:  # rejected by fedmf.round.privatize, after the message checks
        update = _set(ctx.update, "linear.weight", (0, 0), float("nan"))
        return ctx.reply(arrays=ArrayRecord(update), metrics=MetricRecord({"num-examples": 8, "train-loss": 1e3}))

    records = []
    for name, kind in (("clean", _silent), ("dirty", nan_with_metrics)):
        task.share_secrets(tmp_path / "probe", tmp_path / name)
        nodes = {NODE[u]: make_node(u, {}, "dirty") for u in USERS}
        nodes[NODE[user]] = make_node(user, {(user, 0): name}, "dirty", {name: Kind(kind, "", None)})
        with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS, client_metrics=PRIVATE_METRICS), tmp_path / name,
                             population=USERS, repeatable_noise=True) as run:  # the same noise: compared exactly
            strategy = DPMFStrategy(run, CONFIG)
            strategy.start(LocalGrid(nodes), num_rounds=1)
        records.append(strategy.history[0])
    clean, dirty = records
    assert (dirty.rejected, dirty.dropped) == (clean.rejected + 1, clean.dropped - 1)  # rejected, not silent
    assert dirty.metrics["noisy-train-loss"] == clean.metrics["noisy-train-loss"]
