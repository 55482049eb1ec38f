"""What one client's reply may cost the server (issue 23 item 3): exactly the expected records and
keys, arrays no larger than the model's layout needs, and a rejected reply released at once.

Unit tests drive ``RoundReplies`` with crafted Flower messages; a tracemalloc test shows that a
64 MiB reply is not retained; an in-process run of the real strategy shows that a client adding a
64 MiB record is rejected, recorded, and leaves the model bit-identical to a run in which that user
sent nothing.
"""

from __future__ import annotations

import gc
import io
import math
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from sqlalchemy import select

from fedmf.ledger.models import Participation
from fedmf.run.private_run import PrivateRun
from server.local_grid import LocalGrid
from server.replies import RoundReplies, max_array_bytes, max_update_bytes, npy_header_max_bytes
from server.strategy import DPMFStrategy
from tests import _federated_task as task
from tests.flower.test_bad_messages import (
    CONFIG,
    NODE,
    PLANTED,
    USERS,
    Ctx,
    Kind,
    make_node,
    raw_array,
    schedule_of,
    server_log,  # noqa: F401 - a fixture
)

LAYOUT = {"w": (64, 32), "b": (32,)}
NONCE = "a" * 32
T = 3
MIB = 1 << 20


class NoDirectory:
    """The node directory of a round in which every replying node was selected."""

    def user_of(self, node: int) -> str | None:
        return None


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def honest(user: str, layout=LAYOUT, dtype=np.float32) -> dict[str, Any]:
    rng = np.random.default_rng(int(user[1:]))
    arrays = ArrayRecord({name: Array(rng.normal(size=shape).astype(dtype)) for name, shape in layout.items()})
    return {"arrays": arrays, "config": ConfigRecord({"round": T, "run-nonce": NONCE, "user-id": user}),
            "metrics": MetricRecord({"num-examples": 8, "train-loss": 0.5})}


def reply(user: str, records: dict[str, Any]) -> Message:
    asked = Message(RecordDict({"config": ConfigRecord({"round": T})}), dst_node_id=node_of(user),
                    message_type=MessageType.TRAIN)
    return Message(RecordDict(records), reply_to=asked)


def node_of(user: str) -> int:
    return 100 + int(user[1:])


def round_replies(users=("u0", "u1")) -> RoundReplies:
    LocalGrid({})  # sets the run identity Flower's Message needs outside a runtime
    return RoundReplies(T, NONCE, {u: node_of(u) for u in users}, NoDirectory())


def with_config(records: dict, **extra: Any) -> dict:
    return {**records, "config": ConfigRecord({**dict(records["config"]), **extra})}


def with_metrics(records: dict, **extra: Any) -> dict:
    return {**records, "metrics": MetricRecord({**dict(records["metrics"]), **extra})}


def with_array(records: dict, name: str, array: Array) -> dict:
    return {**records, "arrays": ArrayRecord({**dict(records["arrays"]), name: array})}


def beyond_shape(records: dict) -> dict:
    """``w`` declared (64, 32) float32, its payload a (64, 33) float32 array."""
    data = npy(np.zeros((64, 33), np.float32))
    return with_array(records, "w", Array("float32", (64, 32), "numpy.ndarray", data))


def float64_bytes_declared_float32(records: dict) -> dict:
    data = npy(np.zeros((64, 32), np.float64))
    return with_array(records, "w", Array("float32", (64, 32), "numpy.ndarray", data))


def w_limit(dtype: str = "float32") -> int:
    return max_array_bytes((64, 32), dtype)


CASES = {
    "extra ArrayRecord": (lambda r: {**r, "extra": ArrayRecord({"x": Array(np.zeros(3, np.float32))})},
                          "reply has 1 unexpected record(s): ArrayRecord"),
    "extra ConfigRecord": (lambda r: {**r, "note": ConfigRecord({"a": 1})},
                           "reply has 1 unexpected record(s): ConfigRecord"),
    "extra MetricRecord": (lambda r: {**r, "m2": MetricRecord({"num-examples": 8})},
                           "reply has 1 unexpected record(s): MetricRecord"),
    "two extra records": (lambda r: {**r, "a": ConfigRecord({"a": 1}), "b": ArrayRecord()},
                          "reply has 2 unexpected record(s): ArrayRecord, ConfigRecord"),
    "metrics as a ConfigRecord": (lambda r: {**r, "metrics": ConfigRecord({"num-examples": 8})},
                                  "reply has 1 unexpected record(s): 'metrics' as a ConfigRecord"),
    "extra config key": (lambda r: with_config(r, note="hi"), "config record has 1 unexpected key(s)"),
    "extra config keys (large)": (lambda r: with_config(r, a=b"\0" * MIB, b=list(range(1000))),
                                  "config record has 2 unexpected key(s)"),
    "extra metric key": (lambda r: with_metrics(r, accuracy=0.9), "metrics record has 1 unexpected key(s)"),
    "array bytes beyond its shape": (beyond_shape,
                                     f"w: {len(npy(np.zeros((64, 33), np.float32)))} bytes, more than the "
                                     f"{w_limit()} its shape in float32 needs"),
    "float64 bytes declared float32": (float64_bytes_declared_float32,
                                       f"w: {len(npy(np.zeros((64, 32), np.float64)))} bytes, more than the "
                                       f"{w_limit()} its shape in float32 needs"),
    "huge extra record (16 MiB)": (lambda r: {**r, "big": ArrayRecord({"x": raw_array("float32", (4 * MIB,),
                                                                                      bytes(16 * MIB))})},
                                   "reply has 1 unexpected record(s): ArrayRecord"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_reply_with_more_than_the_expected_content_is_rejected_with_its_reason(case):
    spoil, reason = CASES[case]
    received = round_replies()
    received.read([reply("u0", honest("u0")), reply("u1", spoil(honest("u1")))], LAYOUT)
    assert received.rejected == {"u1": reason}
    assert list(received.updates) == ["u0"] and received.unknown == 0
    assert received.losses() == {"u0": 0.5}  # nothing of the rejected reply counts


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_honest_replies_in_every_floating_dtype_and_without_metrics_are_accepted(dtype):
    received = round_replies(("u0", "u1"))
    bare = {k: v for k, v in honest("u1", dtype=dtype).items() if k != "metrics"}
    received.read([reply("u0", honest("u0", dtype=dtype)), reply("u1", bare)], LAYOUT)
    assert received.rejected == {} and list(received.updates) == ["u0", "u1"]
    expected = honest("u0", dtype=dtype)["arrays"].to_torch_state_dict()
    got = received.updates["u0"]
    assert all(torch.equal(got[k], expected[k]) for k in LAYOUT)


def test_the_size_bound_is_exact_at_the_limit():
    """A payload padded to exactly the bound passes the size check (numpy ignores trailing bytes);
    one byte more is rejected before anything is decoded."""
    data = npy(np.zeros((64, 32), np.float32))
    limit = w_limit()
    assert len(data) < limit
    at_limit = data + b"\0" * (limit - len(data))
    received = round_replies()
    received.read([reply("u0", with_array(honest("u0"), "w", Array("float32", (64, 32), "numpy.ndarray",
                                                                   at_limit))),
                   reply("u1", with_array(honest("u1"), "w", Array("float32", (64, 32), "numpy.ndarray",
                                                                   at_limit + b"\0")))], LAYOUT)
    assert received.rejected == {"u1": f"w: {limit + 1} bytes, more than the {limit} its shape in float32 needs"}
    assert torch.equal(received.updates["u0"]["w"], torch.zeros(64, 32))


@pytest.mark.parametrize("ndim", [0, 1, 2, 3, 4, 8, 16, 32, 64])
def test_the_npy_header_bound_holds_for_what_numpy_writes(ndim):
    """numpy's own header (version 1.0 as np.save writes it, and the longer 2.0) for the widest
    dimensions an int64 holds, every floating dtype, both byte orders and both memory orders."""
    bound = npy_header_max_bytes(ndim)
    for dims in ([2**63 - 1] * ndim, [1] * ndim, [10**k % 2**63 for k in range(ndim)]):
        for descr in ("<f2", "<f4", "<f8", ">f8"):
            for fortran in (False, True):
                header = {"descr": descr, "fortran_order": fortran, "shape": tuple(dims)}
                for write in (np.lib.format.write_array_header_1_0, np.lib.format.write_array_header_2_0):
                    buffer = io.BytesIO()
                    write(buffer, header)
                    assert len(buffer.getvalue()) <= bound, (ndim, descr, fortran, write.__name__)
    if ndim <= 8:  # and what np.save really writes, data included
        shape = (2,) * ndim
        for dtype in (np.float16, np.float32, np.float64):
            assert len(npy(np.zeros(shape, dtype))) <= max_array_bytes(shape, np.dtype(dtype).name)


def test_the_update_bound_is_the_layout_in_float64_plus_headers():
    assert max_update_bytes(LAYOUT) == 8 * (64 * 32 + 32) + npy_header_max_bytes(2) + npy_header_max_bytes(1)
    assert max_update_bytes({"x": ()}) == 8 + npy_header_max_bytes(0)


def test_an_update_is_read_once_and_its_record_released():
    received = round_replies()
    received.read([reply("u0", honest("u0"))], LAYOUT)
    record = weakref.ref(received.updates._records["u0"])
    first = received.updates["u0"]
    gc.collect()
    assert record() is None and set(first) == set(LAYOUT)
    with pytest.raises(KeyError, match="already read"):
        received.updates["u0"]
    assert "u0" in received.updates and len(received.updates) == 1 and list(received.updates) == ["u0"]


def test_a_list_of_replies_is_read_in_order_and_emptied():
    received = round_replies()
    first, second = honest("u0"), {k: v for k, v in honest("u0").items() if k != "metrics"}
    second["arrays"] = ArrayRecord({k: Array(np.full(s, 9.0, np.float32)) for k, s in LAYOUT.items()})
    batch = [reply("u0", first), reply("u0", second), reply("u1", honest("u1"))]
    received.read(batch, LAYOUT)
    assert batch == [] and list(received.updates) == ["u0", "u1"]
    assert torch.equal(received.updates["u0"]["b"], first["arrays"].to_torch_state_dict()["b"])  # the first stands


# ---- memory ----------------------------------------------------------------------------------------
MODEL = {"w": (512, 512)}  # 1 MiB in float32
MODEL_BYTES = 4 * 512 * 512


def test_a_rejected_64_mib_reply_is_released_at_once_and_nothing_is_copied():
    """tracemalloc counts Python's and numpy's allocations: reading the replies allocates nothing
    of a payload's size, the rejected 64 MiB reply is gone right after ``read``, and the accepted
    updates cost one model each until the engine reads them, then nothing."""
    received = round_replies(("u0", "u1", "u2"))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        big = ArrayRecord({"x": raw_array("float32", (16 * MIB,), bytes(64 * MIB))})
        batch = [reply("u0", honest("u0", MODEL)), reply("u1", {**honest("u1", MODEL), "big": big}),
                 reply("u2", honest("u2", MODEL))]
        probe = weakref.ref(batch[1])
        del big
        loaded = tracemalloc.get_traced_memory()[0] - base
        assert loaded > 64 * MIB
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        received.read(batch, MODEL)
        read_peak = tracemalloc.get_traced_memory()[1] - start
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        assert received.rejected == {"u1": "reply has 1 unexpected record(s): ArrayRecord"}
        assert probe() is None and batch == []
        assert read_peak < MODEL_BYTES // 4  # sizes come from the metadata: no payload is copied or decoded
        assert held < 2 * MODEL_BYTES + MIB  # the two accepted records, not the 64 MiB
        for user in ("u0", "u2"):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            tensors = received.updates[user]
            assert set(tensors) == {"w"}
            assert tracemalloc.get_traced_memory()[1] - before < 2 * MODEL_BYTES + MIB  # one model decoded
            del tensors
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - base < MIB  # every record released once read
    finally:
        tracemalloc.stop()


# ---- the real strategy, in process -----------------------------------------------------------------
PAYLOAD = 64 * MIB


class WithPayload:
    """The honest reply plus a 64 MiB ArrayRecord; keeps only weak references to what it sent."""

    def __init__(self) -> None:
        self.sent: list[weakref.ref] = []

    def __call__(self, ctx: Ctx) -> Message:
        content = ctx.reply().content
        payload = ArrayRecord({"x": raw_array("float32", (PAYLOAD // 4,), bytes(PAYLOAD))})
        content["payload"] = payload
        self.sent.append(weakref.ref(payload))
        return Message(content, reply_to=ctx.message)


def _silent(ctx: Ctx) -> None:
    return None


def _one_run(directory, user: str, kind: Kind, rounds: int, alive: list[int], sent: list[weakref.ref]):
    """``rounds`` rounds of the strategy in which ``user`` answers round 0 with ``kind``; ``alive``
    gets, when the engine starts each round, how many of the ``sent`` payloads are still alive."""
    nodes = {NODE[u]: make_node(u, {}, "dirty") for u in USERS}
    nodes[NODE[user]] = make_node(user, {(user, 0): "bad"}, "dirty", {"bad": kind})
    model = task.Tiny()
    # repeatable noise (tests only): the clean and the dirty run are compared bit for bit
    with PrivateRun.open(model, task.plan(rounds=10), directory, population=USERS, repeatable_noise=True) as run:
        aggregate = run.aggregate

        def spy(updates, rejected=None):
            gc.collect()
            alive.append(sum(ref() is not None for ref in sent))
            return aggregate(updates, rejected)

        run.aggregate = spy
        strategy = DPMFStrategy(run, CONFIG)
        strategy.start(LocalGrid(nodes), num_rounds=rounds)
        ledger = _ledger(run)
    return model.state_dict(), strategy, ledger


def _ledger(run: PrivateRun) -> dict[tuple[str, int], tuple[str, str | None]]:
    """(user, round) → (status, reason), from the run's ledger."""
    names = {run.user_key(u): u for u in USERS}
    with run._book.engine.connect() as conn:
        rows = conn.execute(select(Participation.round_index, Participation.client_key, Participation.status,
                                   Participation.reason)).all()
    return {(names[bytes(key)], t): (status, reason) for t, key, status, reason in rows}


def test_a_client_adding_a_64_mib_record_is_rejected_and_the_run_is_bit_identical_to_it_silent(tmp_path):
    task.write_secrets(tmp_path / "probe")
    schedule = schedule_of(tmp_path / "probe")
    user = next(u for u in schedule[0] if u not in PLANTED)
    rounds, with_payload = 3, WithPayload()
    results = {}
    for name, dirty in (("clean", _silent), ("dirty", with_payload)):
        task.share_secrets(tmp_path / "probe", tmp_path / name)
        alive: list[int] = []
        results[name] = (*_one_run(tmp_path / name, user, Kind(dirty, "", None), rounds, alive,
                                   with_payload.sent), alive)
    (clean, clean_strategy, clean_ledger, _), (dirty, strategy, ledger, alive) = results["clean"], results["dirty"]
    assert [r.round for r in strategy.history] == list(range(rounds))
    for name, value in clean.items():
        assert torch.equal(dirty[name], value), name
    assert ledger[(user, 0)] == ("rejected", "reply has 1 unexpected record(s): ArrayRecord")
    assert clean_ledger[(user, 0)] == ("dropped", "no update received")
    assert {k: v for k, v in ledger.items() if k != (user, 0)} == \
        {k: v for k, v in clean_ledger.items() if k != (user, 0)}
    first, clean_first = strategy.history[0], clean_strategy.history[0]
    assert (first.rejected, first.dropped) == (clean_first.rejected + 1, clean_first.dropped - 1)
    assert first.metrics == clean_first.metrics and "train-loss" not in first.metrics  # no client metric published
    # the payload was sent once, and is already released when the engine starts that round
    assert len(with_payload.sent) == 1 and alive == [0] * rounds


def test_the_strategy_logs_the_reply_bound(tmp_path, server_log):  # noqa: F811 (the imported fixture)
    task.write_secrets(tmp_path / "run")
    with PrivateRun.open(task.Tiny(), task.plan(rounds=10), tmp_path / "run", population=USERS) as run:
        DPMFStrategy(run, CONFIG).summary()
        bound = max_update_bytes(run.privatizer.layout)
    assert bound == 8 * 10 + npy_header_max_bytes(2) + npy_header_max_bytes(1)  # Tiny: a 2x4 weight, a bias of 2
    assert any(f"at most {bound} bytes" in line for line in server_log)


# ---- the transport ---------------------------------------------------------------------------------
def test_every_request_an_honest_client_sends_fits_the_documented_proxy_limit():
    """deploy/README.md sets the reverse proxy's ``client_max_body_size``: every request body Flower
    1.42's SuperNode sends for an honest reply (one push-object per object, and the push-messages
    with the object tree) must fit, for a model far larger than one 5 MiB chunk."""
    import re
    from pathlib import Path

    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    from flwr.common.serde import message_to_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    readme = (Path(__file__).resolve().parents[2] / "deploy" / "README.md").read_text()
    limit = int(re.search(r"client_max_body_size (\d+)m;", readme).group(1)) * MIB
    LocalGrid({})
    asked = Message(RecordDict({"config": ConfigRecord({"round": 1})}), dst_node_id=2**62,
                    message_type=MessageType.TRAIN)
    gen = torch.Generator().manual_seed(0)
    update = {f"layer{i}.weight": torch.randn(2680, 766, generator=gen, dtype=torch.float64) for i in range(2)}
    update["bias"] = torch.randn(7, generator=gen)
    content = RecordDict({"arrays": ArrayRecord(update),
                          "config": ConfigRecord({"round": 1, "run-nonce": "a" * 32, "user-id": "u" * 256}),
                          "metrics": MetricRecord({"num-examples": 8, "train-loss": 0.1})})
    message = Message(content, reply_to=asked)
    node = Node(node_id=2**63 - 1)
    objects = get_all_nested_objects(message)
    bodies = [PushObjectRequest(node=node, run_id=2**63 - 1, object_id=oid, object_content=obj.deflate(),
                                session_id="s" * 64).ByteSize() for oid, obj in objects.items()]
    empty = Message(RecordDict(), reply_to=asked)  # the SuperNode strips the content before push-messages
    bodies.append(PushMessagesRequest(node=node, messages_list=[message_to_proto(empty)],
                                      message_object_trees=[get_object_tree(message)]).ByteSize())
    assert sum(4 * math.prod(t.shape) > FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE for t in update.values()) == 2
    assert max(bodies) > FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE  # full chunks were sent
    assert max(bodies) <= limit
    assert limit <= 2 * FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE  # and the limit is not loose enough to be no limit
