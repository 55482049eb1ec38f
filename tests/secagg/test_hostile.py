"""Hostile clients and a lying server: every bad message is refused with a one-line reason, the
server's state machine goes on (the sender counts as dropped), a wrong sum is never produced."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from client.secagg import SecAggClient
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.messages import COMMITMENT
from fedmf.secagg.params import SecAggParams
from server.secagg import DONE, SecAggServer
from tests.secagg._drive import random_words, run_round

PARAMS = SecAggParams(degree=6, threshold=4, bits=16, scale=1.0)
NODES = [11, 22, 33, 44, 55, 66, 77]
HOSTILE = 44


def _round(tamper, *, drop=None, words=None):
    words = words or random_words(NODES, 6, PARAMS.bits)
    server = run_round(PARAMS, words, tamper=tamper, drop=drop)
    assert server.stage == DONE
    expected = mod_sum((words[u] for u in sorted(server.contributors)), 6, PARAMS.bits)
    assert np.array_equal(server.result, expected)
    for reason in server.rejected.values():
        assert reason and "\n" not in reason
    return server


def _at(stage, change):
    def tamper(s, u, reply):
        return change(dict(reply)) if s == stage and u == HOSTILE else reply
    return tamper


def _setitem(key, value):
    def change(reply):
        reply[key] = value
        return reply
    return change


MASKED = Key.MASKED_PARAMETERS
BAD_REPLIES = [
    (Stage.SETUP, lambda r: "not a mapping"),
    (Stage.SETUP, _setitem(Key.STAGE, Stage.UNMASK)),
    (Stage.SETUP, _setitem(Key.STAGE, np.array([1, 2]))),
    (Stage.SETUP, lambda r: {np.array([1]).tobytes(): 1, **r}),
    (Stage.SETUP, _setitem(Key.PUBLIC_KEY_1, b"not a key")),
    (Stage.SETUP, _setitem(Key.PUBLIC_KEY_1, 12345)),
    (Stage.SETUP, _setitem(Key.PUBLIC_KEY_1, b"x" * 5000)),
    (Stage.SETUP, lambda r: r | {Key.PUBLIC_KEY_2: r[Key.PUBLIC_KEY_1]}),
    (Stage.SETUP, _setitem("extra", 1)),
    (Stage.SHARE_KEYS, _setitem(Key.STAGE, Stage.SETUP)),
    (Stage.SHARE_KEYS, lambda r: r | {Key.DESTINATION_LIST: r[Key.DESTINATION_LIST][:-1],
                                      Key.CIPHERTEXT_LIST: r[Key.CIPHERTEXT_LIST][:-1]}),
    (Stage.SHARE_KEYS, lambda r: r | {Key.DESTINATION_LIST: [999] + r[Key.DESTINATION_LIST][1:]}),
    (Stage.SHARE_KEYS, _setitem(COMMITMENT, b"short")),
    (Stage.SHARE_KEYS, lambda r: {k: v for k, v in r.items() if k != COMMITMENT}),
    (Stage.COLLECT_MASKED_VECTORS, _setitem(Key.STAGE, Stage.SHARE_KEYS)),
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: np.zeros(7, dtype=np.uint64)}),  # oversized
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: np.zeros(5, dtype=np.uint64)}),  # short
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: np.zeros((6, 1), dtype=np.uint64)}),
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: r[MASKED].astype(np.float64)}),  # non-integers
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: r[MASKED].tolist()}),
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: r[MASKED].astype(object)}),
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: np.full(6, -1, dtype=np.int64)}),
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: np.full(6, 2**16, dtype=np.uint64)}),
    (Stage.COLLECT_MASKED_VECTORS, lambda r: r | {MASKED: b"\x00" * 48}),
    (Stage.UNMASK, _setitem(Key.STAGE, Stage.COLLECT_MASKED_VECTORS)),
    (Stage.UNMASK, lambda r: r | {Key.SHARE_LIST: r[Key.SHARE_LIST][:-1]}),
    (Stage.UNMASK, lambda r: r | {Key.SHARE_LIST: [s[:10] for s in r[Key.SHARE_LIST]]}),
    (Stage.UNMASK, lambda r: r | {Key.SHARE_LIST: [(7).to_bytes(4, "little") + s[4:] for s in r[Key.SHARE_LIST]]}),
    (Stage.UNMASK, lambda r: r | {Key.NODE_ID_LIST: [True] * len(r[Key.NODE_ID_LIST])}),
]


@pytest.mark.parametrize(("stage", "change"), BAD_REPLIES)
def test_a_bad_reply_is_rejected_and_the_round_goes_on(stage, change):
    server = _round(_at(stage, change))
    assert HOSTILE in server.rejected and server.rejected[HOSTILE].startswith(stage)
    if stage == Stage.UNMASK:  # its vector is in the sum; the others' shares unmask it
        assert HOSTILE in server.contributors
    else:
        assert HOSTILE not in server.contributors and len(server.contributors) == len(NODES) - 1


def test_a_key_copied_from_another_client_rejects_both():
    def copy(stage, u, reply):
        if stage == Stage.SETUP and u == HOSTILE:
            return dict(reply) | {Key.PUBLIC_KEY_1: copy.victim}
        if stage == Stage.SETUP and u == 11:
            copy.victim = reply[Key.PUBLIC_KEY_1]
        return reply
    server = _round(copy)
    assert {11, HOSTILE} <= set(server.rejected) and server.contributors == frozenset(NODES) - {11, HOSTILE}


def test_a_corrupted_share_is_outvoted_by_the_commitment():
    def corrupt(stage, u, reply):
        if stage == Stage.UNMASK and u == HOSTILE:
            shares = [s[:4] + bytes(b ^ 0xFF for b in s[4:]) for s in reply[Key.SHARE_LIST]]
            return dict(reply) | {Key.SHARE_LIST: shares}
        return reply
    server = _round(corrupt)
    assert server.contributors == frozenset(NODES) and server.bad_holders == {HOSTILE}  # well formed, wrong
    assert "does not match the owner's commitment" in server.rejected[HOSTILE] and set(server.rejected) == {HOSTILE}


def test_a_corrupted_share_with_no_spare_aborts_instead_of_a_wrong_sum():
    def corrupt(stage, u, reply):
        if stage == Stage.UNMASK and u == HOSTILE:
            shares = [s[:4] + bytes(b ^ 0x01 for b in s[4:]) for s in reply[Key.SHARE_LIST]]
            return dict(reply) | {Key.SHARE_LIST: shares}
        return reply
    with pytest.raises(SecAggAbort, match="reconstruct the committed secret") as caught:
        run_round(PARAMS, random_words(NODES, 6, PARAMS.bits), tamper=corrupt,
                  drop={Stage.UNMASK: {11, 22, 33}})  # exactly t = 4 holders answer, one of them lies
    assert "\n" not in str(caught.value)


def test_a_corrupted_key_share_of_a_dropped_client_aborts_without_spares():
    def corrupt(stage, u, reply):
        if stage == Stage.UNMASK and u == HOSTILE:
            shares = [s[:4] + bytes(b ^ 0x01 for b in s[4:]) for s in reply[Key.SHARE_LIST]]
            return dict(reply) | {Key.SHARE_LIST: shares}
        return reply
    with pytest.raises(SecAggAbort, match="mask"):
        run_round(PARAMS, random_words(NODES, 6, PARAMS.bits), tamper=corrupt,
                  drop={Stage.COLLECT_MASKED_VECTORS: {11, 22, 33}})


def test_replies_from_strangers_are_ignored():
    server = SecAggServer(PARAMS, 6, NODES)
    clients = {u: SecAggClient(u) for u in NODES}
    replies: dict = {u: clients[u].handle(r) for u, r in server.requests().items()}
    replies |= {999: replies[11], "11": replies[11], None: {}, True: replies[11], -1: {}}
    server.receive(replies)
    assert server.stage == Stage.SHARE_KEYS and not server.rejected
    assert sorted(map(repr, server.ignored)) == sorted(map(repr, [999, "11", None, True, -1]))


def test_the_state_machine_refuses_calls_out_of_order_and_keeps_its_state():
    server = SecAggServer(PARAMS, 6, NODES)
    with pytest.raises(SecAggError, match="mapping"):
        server.receive([("not", "a mapping")])  # type: ignore[arg-type]
    assert server.stage == Stage.SETUP
    server = run_round(PARAMS, random_words(NODES, 6, PARAMS.bits))
    for call in (server.requests, lambda: server.receive({})):
        with pytest.raises(SecAggError, match="done"):
            call()
    assert server.stage == DONE and server.result is not None


@pytest.mark.parametrize(("args", "error"), [
    ((PARAMS, 6, [1, 1, 2, 3]), SecAggError), ((PARAMS, 6, [1, -2, 3, 4]), SecAggError),
    ((PARAMS, 6, [1]), SecAggError), ((PARAMS, 6, [1, 2, 3]), SecAggAbort), ((PARAMS, 0, NODES), SecAggError),
    (({"degree": 6}, 6, NODES), SecAggError),
])
def test_bad_rounds_are_refused_at_the_start(args, error):
    with pytest.raises(error) as caught:
        SecAggServer(*args)
    assert "\n" not in str(caught.value)


# -- the client against a lying or confused server ------------------------------------------------

def _clients_at(stage: str):
    """A 4-client round (complete graph, t = 3) played up to ``stage``: server, clients, requests."""
    params = SecAggParams(degree=4, threshold=3, bits=16, scale=1.0)
    server = SecAggServer(params, 3, [1, 2, 3, 4])
    clients = {u: SecAggClient(u) for u in (1, 2, 3, 4)}
    words = np.arange(3, dtype=np.uint64)
    while server.stage != stage:
        server.receive({u: clients[u].handle(r, words if server.stage == Stage.COLLECT_MASKED_VECTORS else None)
                        for u, r in server.requests().items()})
    return server, clients, server.requests(), words


def _refused(client, request, vector=None, match=None):
    with pytest.raises(SecAggError, match=match) as caught:
        client.handle(request, vector)
    assert "\n" not in str(caught.value)


def test_the_client_refuses_stages_out_of_order_and_other_sessions():
    _, clients, requests, words = _clients_at(Stage.COLLECT_MASKED_VECTORS)
    _refused(clients[1], dict(requests[1]) | {Key.STAGE: Stage.UNMASK}, match="out of order")
    _refused(clients[1], dict(requests[1]) | {"session": b"s" * 16}, words, match="session")
    _refused(clients[1], requests[1], None, match="vector")
    _refused(clients[1], requests[1], words.astype(np.int64), match="uint64")
    _refused(clients[1], requests[1], np.full(3, 2**16, dtype=np.uint64), match="bits")
    _refused(clients[1], "a string", match="mapping")
    clients[2].handle(requests[2], words)
    _refused(clients[2], requests[2], words, match="out of order")  # no second masked vector


def test_the_client_never_reveals_both_secrets_of_a_neighbour():
    _, clients, requests, _ = _clients_at(Stage.UNMASK)
    request = dict(requests[1]) | {Key.DEAD_NODE_ID_LIST: [2]}  # 2 is also listed as a survivor
    _refused(clients[1], request, match="both")
    _refused(clients[1], dict(requests[1]) | {Key.ACTIVE_NODE_ID_LIST: [1, 2]}, match="threshold")
    _refused(clients[1], dict(requests[1]) | {Key.ACTIVE_NODE_ID_LIST: [1, 2, 3, 9]}, match="survivors")


def test_the_client_refuses_a_threshold_without_an_honest_majority():
    client = SecAggClient(1)
    base = {Key.STAGE: Stage.SETUP, "session": b"s" * 16, "bits": 16, "length": 3, "neighbours": [2, 3, 4, 5, 6, 7]}
    _refused(client, base | {Key.THRESHOLD: 3}, match="half")
    _refused(client, base | {Key.THRESHOLD: 8}, match="threshold")
    _refused(client, base | {Key.THRESHOLD: 4, "neighbours": [1, 2]}, match="neighbour")
    _refused(client, base | {Key.THRESHOLD: 4, "bits": 99}, match="bits")


def test_the_client_refuses_shown_keys_that_are_not_its_own_or_repeat():
    _, clients, requests, _ = _clients_at(Stage.SHARE_KEYS)
    pk1s = list(requests[1][Key.PUBLIC_KEY_1])
    _refused(clients[1], dict(requests[1]) | {Key.PUBLIC_KEY_1: [pk1s[1]] + pk1s[1:]}, match="distinct")
    swapped = [pk1s[1], pk1s[0]] + pk1s[2:]
    _refused(clients[1], dict(requests[1]) | {Key.PUBLIC_KEY_1: swapped}, match="own public keys")
    _refused(clients[1], dict(requests[1]) | {Key.NODE_ID_LIST: [1, 2, 3, 9]}, match="neighbours")


def test_the_client_refuses_shares_it_cannot_decrypt_or_that_name_another_pair():
    _, clients, requests, words = _clients_at(Stage.COLLECT_MASKED_VECTORS)
    ctxts = list(requests[1][Key.CIPHERTEXT_LIST])
    _refused(clients[1], dict(requests[1]) | {Key.CIPHERTEXT_LIST: [b"garbage"] + ctxts[1:]}, words,
             match="decrypt")
    srcs = list(requests[1][Key.SOURCE_LIST])
    _refused(clients[1], dict(requests[1]) | {Key.SOURCE_LIST: [srcs[1], srcs[0]] + srcs[2:]}, words,
             match="decrypt|name sender")
