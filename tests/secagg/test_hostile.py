"""Hostile clients and a lying server: every bad message is refused with a one-line reason, the
server's state machine goes on (the sender counts as dropped), a wrong sum is never produced."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from client.secagg import SecAggClient
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.messages import (
    COMMITMENT,
    CONSISTENCY_CHECK,
    KEY_SIGNATURE,
    SESSION,
    SIGNATURE,
    SIGNATURES,
    SIGNERS,
    SIGNING_KEY,
    SURVIVORS,
)
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.signing import consistency_statement, keys_statement, public_bytes
from server.secagg import DONE, SecAggServer
from tests.secagg._drive import make_client, random_words, run_round

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
    (Stage.SETUP, _setitem(KEY_SIGNATURE, bytes(64))),
    (Stage.SETUP, _setitem(SIGNING_KEY, bytes(32))),  # not a valid Ed25519 key (small order)
    (Stage.SETUP, lambda r: {k: v for k, v in r.items() if k != KEY_SIGNATURE}),
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


@pytest.mark.parametrize("copied", [Key.PUBLIC_KEY_1, SIGNING_KEY])
def test_a_key_copied_from_another_client_rejects_both(copied):
    """The hostile client copies client 11's key and signs its own statement over it (with its own
    signing key, or a copied signing key: a signature it cannot make, so only it is refused)."""
    server = SecAggServer(PARAMS, 6, NODES, run="run", round_=3)
    clients = {u: make_client(u) for u in NODES}
    replies = {u: clients[u].handle(r) for u, r in server.requests().items()}
    hostile = dict(replies[HOSTILE]) | {copied: replies[11][copied]}
    if copied == Key.PUBLIC_KEY_1:  # a valid signature of the hostile node over the copied key
        key = Ed25519PrivateKey.generate()
        hostile |= {SIGNING_KEY: public_bytes(key), KEY_SIGNATURE: key.sign(keys_statement(
            "run", 3, server.session, HOSTILE, public_bytes(key), hostile[Key.PUBLIC_KEY_1], hostile[Key.PUBLIC_KEY_2]))}
    server.receive(replies | {HOSTILE: hostile})
    refused = {11, HOSTILE} if copied == Key.PUBLIC_KEY_1 else {HOSTILE}
    assert set(server.rejected) == refused and server.u1 == frozenset(NODES) - refused
    assert all("\n" not in reason for reason in server.rejected.values())


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
    server = SecAggServer(params, 3, [1, 2, 3, 4], run="run", round_=3)
    clients = {u: make_client(u) for u in (1, 2, 3, 4)}
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
    _refused(clients[1], dict(requests[1]) | {Key.STAGE: CONSISTENCY_CHECK}, match="out of order")
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
    _refused(clients[1], request, match="signed survivor set")
    _refused(clients[1], dict(requests[1]) | {Key.ACTIVE_NODE_ID_LIST: [1, 2]}, match="signed survivor set")
    _refused(clients[1], dict(requests[1]) | {Key.ACTIVE_NODE_ID_LIST: [1, 2, 3, 9]}, match="signed survivor set")
    clients[1].handle(requests[1])  # the lists the signed U3 gives: answered (once)


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


# -- the consistency check: hostile signatures, and a server lying about the survivor set -----------

def _played_to(stage: str, server: SecAggServer, clients: dict[int, SecAggClient], words: dict[int, np.ndarray]):
    while server.stage != stage:
        server.receive({u: clients[u].handle(r, words[u] if server.stage == Stage.COLLECT_MASKED_VECTORS else None)
                        for u, r in server.requests().items()})
    return server.requests()


BAD_SIGNATURES = [
    _setitem(Key.STAGE, Stage.UNMASK),
    lambda r: {k: v for k, v in r.items() if k != SIGNATURE},
    _setitem(SIGNATURE, bytes(64)),
    _setitem(SIGNATURE, "not bytes"),
    _setitem("extra", 1),
]


@pytest.mark.parametrize("change", BAD_SIGNATURES)
def test_a_bad_consistency_reply_is_refused_and_the_attempt_aborts_with_nothing_revealed(change):
    """Refused with a one-line reason; its seed share cannot be revealed without its signature on
    U3, so the attempt aborts before any share is asked for (the strategy redoes the round)."""
    with pytest.raises(SecAggAbort, match="1 of 7 survivors did not sign"):
        run_round(PARAMS, random_words(NODES, 6, PARAMS.bits), tamper=_at(CONSISTENCY_CHECK, change))


@pytest.mark.parametrize("forgery", ["another set", "another round", "another session", "another node", "another key"])
def test_a_consistency_signature_on_anything_else_is_refused(forgery):
    """The hostile client signs (with its own key) a statement other than (run, round, session,
    itself, U3): refused at the consistency check with a one-line reason, and the attempt aborts
    before any share is revealed; the same round with the right signature completes."""
    words = random_words(NODES, 6, PARAMS.bits, seed=5)
    server = SecAggServer(PARAMS, 6, NODES, run="run", round_=3)
    clients = {u: make_client(u) for u in NODES}
    requests = _played_to(CONSISTENCY_CHECK, server, clients, words)
    replies = {u: clients[u].handle(r) for u, r in requests.items()}
    u3, session, pk1 = sorted(server.u3), server.session, server._pk1[HOSTILE]
    statement = {"another set": ("run", 3, session, HOSTILE, pk1, u3[:-1]),
                 "another round": ("run", 2, session, HOSTILE, pk1, u3),
                 "another session": ("run", 3, b"s" * 16, HOSTILE, pk1, u3),
                 "another node": ("run", 3, session, 11, pk1, u3),
                 "another key": ("run", 3, session, HOSTILE, server._pk1[11], u3)}[forgery]
    honest = dict(replies)
    replies[HOSTILE] = {Key.STAGE: CONSISTENCY_CHECK,
                        SIGNATURE: clients[HOSTILE]._signing_key.sign(consistency_statement(*statement))}
    with pytest.raises(SecAggAbort, match="did not sign"):
        server.receive(replies)
    assert server.rejected == {HOSTILE: "consistency_check: the signature over the survivor set does not verify"}
    assert server.u4 == frozenset(NODES) - {HOSTILE} and server.result is None
    server = SecAggServer(PARAMS, 6, NODES, run="run", round_=3, session=server.session)
    clients = {u: make_client(u) for u in NODES}
    requests = _played_to(CONSISTENCY_CHECK, server, clients, words)
    honest = {u: clients[u].handle(r) for u, r in requests.items()}
    server.receive(honest)
    server.receive({u: clients[u].handle(r) for u, r in server.requests().items()})
    assert server.stage == DONE and server.contributors == frozenset(NODES)
    assert np.array_equal(server.result, mod_sum(words.values(), 6, PARAMS.bits))


def test_a_signer_outside_the_survivor_set_is_refused():
    """A colluding neighbour that signs a U3 leaving itself out must not make the client reveal its
    seed share next to its key share."""
    server, clients, requests = _unmask_requests()
    clients[1]._survivors = [1, 3, 4]  # as if 1 had been told and had signed U3 without node 2
    signed = [clients[v]._signing_key.sign(consistency_statement("run", 3, server.session, v, server._pk1[v], [1, 3, 4]))
              for v in (2, 3, 4)]
    _refused(clients[1], requests[1] | {SIGNATURES: signed}, match="outside the signed survivor set")


def test_the_client_refuses_a_survivor_set_it_can_see_is_false():
    server, clients, requests, _ = _clients_at(CONSISTENCY_CHECK)
    _refused(clients[1], dict(requests[1]) | {Key.STAGE: Stage.UNMASK}, match="out of order")
    _refused(clients[1], dict(requests[1]) | {SURVIVORS: [2, 3, 4]}, match="leaves out the client")
    _refused(clients[1], dict(requests[1]) | {SURVIVORS: [1, 2]}, match="threshold")
    _refused(clients[1], dict(requests[1]) | {SESSION: b"s" * 16}, match="session")
    clients[1]._sources = frozenset({2, 3})  # as if the server had forwarded it only 2's and 3's shares
    _refused(clients[1], requests[1], match="never got")


def _unmask_requests():
    """A 4-client round (t = 3) at unmask, with the clients and the server's requests."""
    server, clients, _, _ = _clients_at(CONSISTENCY_CHECK)
    server.receive({u: clients[u].handle(r) for u, r in server.requests().items()})
    return server, clients, server.requests()


def test_the_client_reveals_nothing_without_t_signatures_on_the_set_it_signed():
    server, clients, requests = _unmask_requests()
    request = requests[1]
    signers, signatures = request[SIGNERS], request[SIGNATURES]
    assert signers == [2, 3, 4]
    _refused(clients[1], request | {SIGNERS: signers[:1], SIGNATURES: signatures[:1]}, match="below the threshold")
    sign, pk1 = clients[2]._signing_key.sign, server._pk1[2]
    other_set = sign(consistency_statement("run", 3, server.session, 2, pk1, [1, 2, 3]))
    _refused(clients[1], request | {SIGNATURES: [other_set, *signatures[1:]]}, match="node 2's consistency signature")
    replayed = sign(consistency_statement("run", 2, server.session, 2, pk1, sorted(server.u3)))  # another round
    _refused(clients[1], request | {SIGNATURES: [replayed, *signatures[1:]]}, match="node 2's consistency signature")
    _refused(clients[1], request | {SIGNATURES: [signatures[1], signatures[0], signatures[2]]}, match="consistency")
    _refused(clients[1], request | {SIGNERS: [9, 3, 4]}, match="outside the client's neighbourhood")
    reply = clients[1].handle(request)  # the honest request is answered
    assert sorted(reply[Key.NODE_ID_LIST]) == [1, 2, 3, 4]


def test_a_client_holding_the_enrollment_refuses_a_neighbour_signing_with_a_key_not_enrolled():
    keys = {u: Ed25519PrivateKey.generate() for u in (1, 2, 3, 4)}
    params = SecAggParams(degree=4, threshold=3, bits=16, scale=1.0)
    server = SecAggServer(params, 3, [1, 2, 3, 4], run="run", round_=3)
    clients = {u: make_client(u, keys, graph_rule=False) for u in (1, 2, 3, 4)}
    clients[4] = SecAggClient(4, run="run", round_=3)  # an ephemeral key: no enrolled user's
    server.receive({u: clients[u].handle(r) for u, r in server.requests().items()})
    _refused(clients[1], server.requests()[1], match="node 4 is not an enrolled user's")
    with pytest.raises(SecAggError, match="not in its enrollment"):
        SecAggClient(5, run="run", round_=3, signing_key=Ed25519PrivateKey.generate(),
                     enrolled=frozenset(public_bytes(k) for k in keys.values()))


def test_an_enrolled_round_sums_exactly():
    keys = {u: Ed25519PrivateKey.generate() for u in NODES}
    words = random_words(NODES, 6, PARAMS.bits, seed=8)
    server = run_round(PARAMS, words, user_keys=keys, drop={Stage.COLLECT_MASKED_VECTORS: {11}, Stage.UNMASK: {22}},
                       graph_rule=False)  # dropouts at small k and t, below graph_for's rule
    assert server.stage == DONE and server.contributors == frozenset(NODES) - {11} and not server.rejected
    assert np.array_equal(server.result, mod_sum((words[u] for u in NODES if u != 11), 6, PARAMS.bits))
