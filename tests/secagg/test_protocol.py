"""SecAgg+ end to end in process: the unmasked sum equals, bit for bit, the plain modular sum of
the survivors' words, with dropouts at every stage up to the threshold; below it the round
aborts; one masked vector looks uniform to the server."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from scipy import stats

from client.secagg import SecAggClient
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.messages import CONSISTENCY_CHECK
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.quantize import Quantization, decode_sum, quantize
from server.secagg import ABORTED, DONE, SecAggServer, harary_graph
from tests.secagg._drive import STAGES, make_client, random_words, run_round

# the stages at which dropouts up to the threshold are survived: all but the consistency check, where
# a survivor that does not sign keeps its seed share unrevealed, so the attempt aborts (a redo)
TOLERANT = tuple(stage for stage in STAGES if stage != CONSISTENCY_CHECK)
# the complete graph on 7 clients: 7 shares of each secret, t = 4 (2t > 7)
COMPLETE = SecAggParams(degree=6, threshold=4, bits=20, scale=1000.0)
NODES = [3, 8, 21, 34, 55, 89, 144]


def _expect(server: SecAggServer, words: dict[int, np.ndarray], bits: int) -> None:
    assert server.stage == DONE
    expected = mod_sum((words[u] for u in sorted(server.contributors)), len(next(iter(words.values()))), bits)
    assert server.result.dtype == np.uint64
    assert np.array_equal(server.result, expected)


def test_the_unmasked_sum_is_the_plain_modular_sum():
    words = random_words(NODES, 33, COMPLETE.bits)
    server = run_round(COMPLETE, words)
    _expect(server, words, COMPLETE.bits)
    assert server.contributors == frozenset(NODES) and not server.rejected and not server.dropped


@pytest.mark.parametrize("stage", TOLERANT)
@pytest.mark.parametrize("count", [1, 2, 3])  # up to n − t = 3
def test_dropouts_at_each_stage_up_to_the_threshold(stage, count):
    words = random_words(NODES, 17, COMPLETE.bits, seed=count)
    dropped = set(NODES[1:1 + count])
    server = run_round(COMPLETE, words, drop={stage: dropped})
    _expect(server, words, COMPLETE.bits)
    if stage == Stage.UNMASK:  # their vectors are in: the others' shares unmask them
        assert server.contributors == frozenset(NODES)
    else:
        assert server.contributors == frozenset(NODES) - dropped


def test_dropouts_spread_over_the_stages():
    words = random_words(NODES, 9, COMPLETE.bits, seed=7)
    drop = {Stage.SETUP: {3}, Stage.SHARE_KEYS: {8}, Stage.COLLECT_MASKED_VECTORS: {21}}
    server = run_round(COMPLETE, words, drop=drop)
    _expect(server, words, COMPLETE.bits)
    assert server.contributors == frozenset(NODES) - {3, 8, 21}


@pytest.mark.parametrize("count", [1, 3])
def test_a_dropout_at_the_consistency_check_aborts_the_attempt(count):
    """Its seed share is revealed only with its own signature on U3: nothing is unmasked, the
    strategy redoes the round (nobody blamed)."""
    words = random_words(NODES, 5, COMPLETE.bits, seed=count)
    server = SecAggServer(COMPLETE, 5, NODES, run="run", round_=3)
    clients = {u: make_client(u) for u in NODES}
    with pytest.raises(SecAggAbort, match=f"{count} of 7 survivors did not sign the survivor set"):
        for stage in STAGES:
            server.receive({u: clients[u].handle(r, words[u] if stage == Stage.COLLECT_MASKED_VECTORS else None)
                            for u, r in server.requests().items()
                            if not (stage == CONSISTENCY_CHECK and u in NODES[:count])})
    assert server.result is None and not server.culprits and not server.rejected


@pytest.mark.parametrize("stage", STAGES)
def test_below_the_threshold_the_round_aborts(stage):
    words = random_words(NODES, 5, COMPLETE.bits)
    with pytest.raises(SecAggAbort, match="threshold|did not sign") as caught:
        run_round(COMPLETE, words, drop={stage: set(NODES[:4])})
    assert "\n" not in str(caught.value)


def test_an_aborted_round_stays_aborted():
    words = random_words(NODES, 5, COMPLETE.bits)
    server = SecAggServer(COMPLETE, 5, NODES)
    with pytest.raises(SecAggAbort):
        server.receive({})
    assert server.stage == ABORTED and server.result is None
    for call in (server.requests, lambda: server.receive({})):
        with pytest.raises(SecAggError, match="aborted"):
            call()
    del words


@pytest.mark.parametrize("seed", range(4))
def test_a_sparse_harary_graph_with_dropouts(seed):
    params = SecAggParams(degree=4, threshold=3, bits=24, scale=1.0)
    nodes = list(range(100, 112))
    words = random_words(nodes, 11, params.bits, seed=seed)
    graph = harary_graph(nodes, 4, __import__("random").Random(seed))
    assert all(len(n) == 4 and u not in n for u, n in graph.items())
    assert all(u in graph[v] for u in nodes for v in graph[u])
    drop = {Stage.COLLECT_MASKED_VECTORS: {nodes[seed]}, Stage.UNMASK: {nodes[seed + 6]}}
    server = run_round(params, words, drop=drop, graph_seed=seed)
    _expect(server, words, params.bits)
    assert server.contributors == frozenset(nodes) - {nodes[seed]}


@pytest.mark.parametrize("stage", [None, *TOLERANT])
def test_quantized_clipped_updates_with_the_bit_sum_exactly(stage):
    q = Quantization(clip_norm=0.5, scale=2.0**12, bits=COMPLETE.bits, dim=40, with_bit=True)
    params = SecAggParams(degree=6, threshold=4, bits=q.bits, scale=q.scale)
    rng = np.random.default_rng(3)
    updates = {u: rng.normal(size=40) * rng.uniform(0.01, 0.15) for u in NODES}
    unclipped = {u: bool(np.linalg.norm(x) <= q.clip_norm) for u, x in updates.items()}
    words = {u: quantize(q, x, rng, unclipped[u]) for u, x in updates.items()}
    server = run_round(params, words, drop={stage: {55, 89, 144}} if stage else None)
    _expect(server, words, q.bits)
    decoded = decode_sum(q, server.result)
    one_by_one = sum(decode_sum(q, words[u]).vector for u in sorted(server.contributors))
    assert np.array_equal(decoded.vector * q.scale, np.round(one_by_one * q.scale))
    assert decoded.unclipped == sum(unclipped[u] for u in server.contributors)
    clipped = {u: x * min(1.0, q.clip_norm / np.linalg.norm(x)) for u, x in updates.items()}
    assert not all(unclipped.values()) and any(unclipped.values())
    plain = sum(clipped[u] for u in server.contributors)
    assert np.max(np.abs(decoded.vector - plain)) <= len(server.contributors) / q.scale  # < one unit each


def _one_masked_vector(plain: np.ndarray, bits: int) -> np.ndarray:
    """What the server receives from node 1 of a 3-client round."""
    params = SecAggParams(degree=2, threshold=2, bits=bits, scale=1.0)
    server = SecAggServer(params, plain.size, [1, 2, 3])
    clients = {u: SecAggClient(u) for u in (1, 2, 3)}
    for stage in STAGES[:3]:
        replies = {u: clients[u].handle(r, plain if stage == Stage.COLLECT_MASKED_VECTORS else None)
                   for u, r in server.requests().items()}
        if stage == Stage.COLLECT_MASKED_VECTORS:
            return replies[1][Key.MASKED_PARAMETERS]
        server.receive(replies)
    raise AssertionError("unreachable")


def test_one_masked_vector_is_uniform_to_the_server():
    plain = np.full(40_000, 7, dtype=np.uint64)  # one value only: as far from uniform as can be
    masked = _one_masked_vector(plain, 8)
    assert masked.dtype == np.uint64 and int(masked.max()) < 256
    counts = np.bincount(masked.astype(np.int64), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-6
    assert np.mean(masked == plain) < 0.01
    again = _one_masked_vector(plain, 8)  # fresh keys, fresh seed: another mask
    assert np.mean(again == masked) < 0.01


def test_wide_words_are_uniform_in_every_byte():
    masked = _one_masked_vector(np.zeros(20_000, dtype=np.uint64), 32)
    for shift in (0, 8, 16, 24):
        counts = np.bincount(((masked >> np.uint64(shift)) & np.uint64(255)).astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-6
