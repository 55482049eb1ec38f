"""Share commitments (REVIEW-i36 LOW-2, MEDIUM-6): every share is checked on its own against its
owner's salted commitment, so a bad share names its holder, an owner's bad dealing names the owner,
and no single corrupted share frames an honest owner, whatever k and t."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from client.secagg import SecAggClient
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.messages import (
    COMMITMENT,
    KEY_SHARE,
    SALT_BYTES,
    SEED_SHARE,
    SEED_SHARE_COMMITMENTS,
    commit_seed,
    commit_share,
    split_share,
)
from fedmf.secagg.params import SecAggParams
from server.secagg import DONE, SecAggServer
from tests.secagg._drive import STAGES, random_words, run_round

LENGTH = 4


def _until_unmask(params: SecAggParams, nodes: list[int], graph_seed: int = 0):
    """A round played honestly up to unmask: the server, the honest unmask replies, the words."""
    words = random_words(nodes, LENGTH, params.bits, seed=graph_seed)
    server = SecAggServer(params, LENGTH, nodes, rng=random.Random(graph_seed))
    clients = {u: SecAggClient(u) for u in nodes}
    for stage in STAGES[:-1]:  # every stage before unmask, the consistency check included
        server.receive({u: clients[u].handle(r, words[u] if stage == Stage.COLLECT_MASKED_VECTORS else None)
                        for u, r in server.requests().items()})
    replies = {u: clients[u].handle(r) for u, r in server.requests().items()}
    return server, replies, words


def _flip(at: int):
    return lambda s: s[:at] + bytes([s[at] ^ 0x01]) + s[at + 1:]


#: one share ‖ salt changed by its holder: its index, a share byte, a salt byte, cut short, emptied of
#: its salt, replaced by zeros
CORRUPTIONS = {"index": _flip(0), "share": _flip(4), "salt": _flip(-1), "short": lambda s: s[:-16],
               "unsalted": lambda s: s[:-SALT_BYTES], "zeros": lambda s: bytes(len(s))}


def _corrupt(reply: dict, owner: int, change) -> dict:
    shares = [change(s) if o == owner else s for o, s in zip(reply[Key.NODE_ID_LIST], reply[Key.SHARE_LIST])]
    return dict(reply) | {Key.SHARE_LIST: shares}


@pytest.mark.parametrize(("k", "t", "n"), [(2, 2, 5), (2, 3, 5), (4, 3, 7), (4, 5, 7),
                                           pytest.param(6, 4, 7, marks=pytest.mark.heavy),
                                           pytest.param(6, 5, 9, marks=pytest.mark.heavy)])
def test_no_single_corrupted_share_frames_an_honest_owner(k, t, n):
    """Brute force over one hostile holder h, every owner whose share h holds (h's own included),
    every way to change that one share, and every other node staying silent at unmask or not: the
    culprits are only ever h, h is named exactly when its changed share was asked for, and the round
    completes with the exact sum whenever each secret keeps t good shares."""
    params = SecAggParams(degree=k, threshold=t, bits=16, scale=1.0)
    nodes = list(range(1, n + 1))
    server, replies, words = _until_unmask(params, nodes)
    expected = mod_sum(words.values(), LENGTH, params.bits)
    h = nodes[0]
    for owner in replies[h][Key.NODE_ID_LIST]:
        for name, change in CORRUPTIONS.items():
            for silent in [None, *sorted(set(nodes) - {h})]:
                attempt = copy.deepcopy(server)
                sent = {u: r for u, r in replies.items() if u != silent} | {h: _corrupt(replies[h], owner, change)}
                try:
                    attempt.receive(sent)
                except SecAggAbort:
                    assert attempt.culprits <= {h}, (owner, name, silent)
                else:
                    assert attempt.stage == DONE and np.array_equal(attempt.result, expected), (owner, name, silent)
                assert attempt.bad_holders == {h}, (owner, name, silent)
                if silent is None and owner != h and k >= t:  # k ≥ t good shares of every secret remain
                    assert attempt.stage == DONE, (owner, name)


def test_a_holder_with_a_bad_share_is_named_and_exactly_t_good_shares_recover():
    """k = 6, t = 4, 7 nodes: the complete graph, 7 holders per secret. Two holders stay silent at
    unmask and node 1 corrupts every share it returns: t = 4 good shares of each other secret remain,
    and they recover it; node 1 is named, not the owners."""
    params = SecAggParams(degree=6, threshold=4, bits=16, scale=1.0)
    nodes = list(range(1, 8))
    server, replies, words = _until_unmask(params, nodes)
    replies = {u: r for u, r in replies.items() if u not in (6, 7)}
    replies[1] = dict(replies[1]) | {Key.SHARE_LIST: [_flip(4)(s) for s in replies[1][Key.SHARE_LIST]]}
    server.receive(replies)
    assert server.stage == DONE and server.bad_holders == {1} and not server.culprits
    assert np.array_equal(server.result, mod_sum(words.values(), LENGTH, params.bits))
    assert set(server.rejected) == {1} and "node" in server.rejected[1] and "\n" not in server.rejected[1]


def test_a_holder_whose_bad_share_leaves_fewer_than_t_is_the_culprit_not_the_owner():
    """Same, with three holders silent: node 1's bad shares leave 3 < t good ones; the abort names
    node 1 only (a plain shortfall would name nobody)."""
    params = SecAggParams(degree=6, threshold=4, bits=16, scale=1.0)
    nodes = list(range(1, 8))
    server, replies, _ = _until_unmask(params, nodes)
    replies = {u: r for u, r in replies.items() if u not in (5, 6, 7)}
    replies[1] = dict(replies[1]) | {Key.SHARE_LIST: [_flip(4)(s) for s in replies[1][Key.SHARE_LIST]]}
    with pytest.raises(SecAggAbort, match="holders \\[1\\] returned others"):
        server.receive(replies)
    assert server.culprits == {1}


def _owner_tamper(hostile: int, change):
    def tamper(stage, u, reply):
        return change(dict(reply)) if stage == Stage.SHARE_KEYS and u == hostile else reply
    return tamper


def test_an_owner_whose_committed_shares_miss_its_seed_commitment_is_the_culprit():
    """Node 4 commits to a seed other than the one it shares (its share commitments are honest):
    t committed shares give a seed that fails the commitment, which only the owner can cause."""
    params = SecAggParams(degree=6, threshold=4, bits=16, scale=1.0)
    nodes = list(range(1, 8))
    with pytest.raises(SecAggAbort, match="committed shares of node 4"):
        run_round(params, random_words(nodes, LENGTH, params.bits),
                  tamper=_owner_tamper(4, lambda r: r | {COMMITMENT: commit_seed(bytes(32))}))


def test_an_owner_with_bad_commitments_is_excluded_from_the_round():
    """Node 4's share commitments match nothing it deals: each holder refuses them at collect (a
    one-line SecAggError naming node 4), before anything is revealed, so node 4's shares can never
    be blamed on a holder. The culprits test of a whole run is
    test_review_findings.test_one_client_with_a_wrong_seed_commitment_does_not_end_the_run."""
    params = SecAggParams(degree=6, threshold=4, bits=16, scale=1.0)
    nodes = list(range(1, 8))
    server = SecAggServer(params, LENGTH, nodes, rng=random.Random(0))
    clients = {u: SecAggClient(u) for u in nodes}
    words = random_words(nodes, LENGTH, params.bits)
    server.receive({u: clients[u].handle(r) for u, r in server.requests().items()})
    replies = {u: clients[u].handle(r) for u, r in server.requests().items()}
    replies[4] = dict(replies[4]) | {SEED_SHARE_COMMITMENTS: [bytes(32)] * len(replies[4][SEED_SHARE_COMMITMENTS])}
    server.receive(replies)
    for u, request in server.requests().items():
        if u == 4:
            continue
        with pytest.raises(SecAggError, match="the shares from node 4 do not match its commitments"):
            clients[u].handle(request, words[u])


def test_share_commitments_bind_session_owner_holder_kind_and_salt():
    """The commitment changes with each field it binds, and split_share takes the salt off."""
    share = (1).to_bytes(4, "little") + bytes(range(16)) + bytes(SALT_BYTES)
    base = commit_share(bytes(16), 1, 2, SEED_SHARE, share)
    others = {commit_share(bytes(17), 1, 2, SEED_SHARE, share), commit_share(bytes(16), 3, 2, SEED_SHARE, share),
              commit_share(bytes(16), 1, 3, SEED_SHARE, share), commit_share(bytes(16), 1, 2, KEY_SHARE, share),
              commit_share(bytes(16), 1, 2, SEED_SHARE, share[:-1] + b"\x01")}
    assert len(base) == 32 and base not in others and len(others) == 5
    assert split_share(share) == share[:-SALT_BYTES]
    assert split_share(share[:-16]) is None and split_share(share[:SALT_BYTES]) is None
