"""The independent review's findings on secure aggregation (docs/reviews/REVIEW-i36-secagg.md).

Each test states what should hold; a finding that is not fixed yet is a strict xfail, so that its
fix turns the test into an XPASS that must be acknowledged by removing the marker.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    public_key_to_bytes,
)

from client.secagg import SecAggClient
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.masks import PAIRWISE_MASK, SELF_MASK, expand_mask, mod_add, mod_sub, mod_sum
from fedmf.secagg.messages import (
    BITS,
    CONSISTENCY_CHECK,
    KEY_SHARE,
    KEY_SHARE_COMMITMENTS,
    KEY_SIGNATURE,
    KEY_SIGNATURES,
    LENGTH,
    NEIGHBOURS,
    SALT_BYTES,
    SEED_SHARE,
    SEED_SHARE_COMMITMENTS,
    SESSION,
    SIGNATURE,
    SIGNATURES,
    SIGNERS,
    SIGNING_KEY,
    SIGNING_KEYS,
    SURVIVORS,
    commit_share,
    split_share,
)
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.signing import keys_statement, public_bytes
from server.secagg import DONE, SecAggServer, harary_graph
from tests.secagg._drive import STAGES, make_client, random_words, run_round

LENGTH_WORDS = 5


def _pairwise(sk, pk_bytes: bytes, bits: int) -> np.ndarray:
    shared = base64.urlsafe_b64decode(generate_shared_key(sk, bytes_to_public_key(pk_bytes)))
    return expand_mask(shared, LENGTH_WORDS, bits, PAIRWISE_MASK)


def _unmask_one(masked: np.ndarray, v: int, seed: bytes, pair_keys: dict[int, np.ndarray], bits: int) -> np.ndarray:
    """x_v from y_v = x_v + PRG(seed_v) + Σ_u ±PRG(s_uv) (client.secagg.SecAggClient._collect's signs)."""
    x = mod_sub(masked, expand_mask(seed, LENGTH_WORDS, bits, SELF_MASK), bits)
    for u, mask in pair_keys.items():
        x = mod_sub(x, mask, bits) if v > u else mod_add(x, mask, bits)
    return x


# ---- HIGH: a server that lies about who dropped unmasks one client (fixed: the consistency check) ------

def _ring(nodes: list[int], seed: int) -> list[int]:
    order = sorted(nodes)
    random.Random(seed).shuffle(order)  # what server.secagg.harary_graph draws with the same generator
    return order


def _honest_until_unmask(params: SecAggParams, nodes: list[int], graph_seed: int,
                         trim: dict[int, int | set[int]] | None = None, enrolled: bool = True,
                         graph_rule: bool = True):
    """Setup, share keys and collect played honestly, except that the server forwards to node v
    only the first ``trim[v]`` sources' shares at collect, or those in it when it is a set (the
    client accepts any ≥ t − 1). The
    clients are enrolled (each holds every user's public key) or not: keys are relayed honestly,
    the lie is about dropouts only. ``graph_rule=False``: the enrolled clients accept k and t below
    graph_for's rule (the consistency check's own logic at small k and t)."""
    words = random_words(nodes, LENGTH_WORDS, params.bits, seed=7)
    server = SecAggServer(params, LENGTH_WORDS, nodes, rng=random.Random(graph_seed), run="run", round_=3)
    user_keys = {u: Ed25519PrivateKey.generate() for u in nodes}
    clients = {u: make_client(u, user_keys if enrolled else None, graph_rule=graph_rule) for u in nodes}
    masked: dict[int, np.ndarray] = {}
    for stage in (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS):
        replies = {}
        for u, request in server.requests().items():
            if stage == Stage.COLLECT_MASKED_VECTORS and u in (trim or {}):
                srcs = request[Key.SOURCE_LIST]
                keep = [i for i, src in enumerate(srcs) if (i < trim[u] if isinstance(trim[u], int) else src in trim[u])]
                request = dict(request) | {key: [request[key][i] for i in keep] for key in (
                    Key.SOURCE_LIST, Key.CIPHERTEXT_LIST, SEED_SHARE_COMMITMENTS, KEY_SHARE_COMMITMENTS)}
            replies[u] = clients[u].handle(request, words[u] if stage == Stage.COLLECT_MASKED_VECTORS else None)
            if stage == Stage.COLLECT_MASKED_VECTORS:
                masked[u] = replies[u][Key.MASKED_PARAMETERS]
        server.receive(replies)
    return server, clients, masked, words


def _lie_and_unmask(params, server, clients, masked, v: int, pairs: list[int],
                    dead_of: dict[int, set[int]]) -> np.ndarray | None:
    """The consistency check and the unmask stage with a different survivor story per holder w
    (``dead_of[w]`` dropped, everyone else alive): each holder is asked to sign its story, then is
    sent every signature the server got on the same story from w's neighbours (the most a lying
    server can forward) with the lists its story gives — the server's own (``dead_of[w]`` within
    w's neighbourhood), else those w can derive (the signers' and w's seeds, or all its sources in
    the story, and the keys of its sources outside it); then v's update from its seed and the mask
    keys of ``pairs`` (the nodes v masked with), or None when too few shares came back."""
    shares: dict[int, dict[str, list[bytes]]] = {u: {"seed": [], "key": []} for u in server.sampled}
    story = {w: sorted(server.u3 - dead_set) for w, dead_set in dead_of.items()}
    signed: dict[int, bytes] = {}
    for w in dead_of:
        request = {Key.STAGE: CONSISTENCY_CHECK, SESSION: server.session, SURVIVORS: story[w]}
        try:
            signed[w] = clients[w].handle(request)[SIGNATURE]
        except SecAggError:  # a client told a story it can see is false signs nothing
            continue
    for w, dead_set in dead_of.items():
        if w not in signed:
            continue
        signers = sorted(x for x in signed if x != w and x in server.neighbours[w] and story[x] == story[w])
        sources = clients[w]._sources  # what the server forwarded to w at collect
        lists = [(sorted((server.neighbours[w] | {w}) - dead_set), sorted(dead_set & server.neighbours[w])),
                 (sorted({w, *signers}), sorted(sources - set(story[w]))),
                 (sorted((sources & set(story[w])) | {w}), sorted(sources - set(story[w])))]
        for active, dead in lists:
            request = {Key.STAGE: Stage.UNMASK, SESSION: server.session, Key.ACTIVE_NODE_ID_LIST: active,
                       Key.DEAD_NODE_ID_LIST: dead, SIGNERS: signers, SIGNATURES: [signed[x] for x in signers]}
            try:
                reply = clients[w].handle(request)
            except SecAggError:  # a client that detects the lie reveals nothing
                continue
            for owner, share in zip(reply[Key.NODE_ID_LIST], reply[Key.SHARE_LIST]):
                shares[owner]["key" if owner in dead else "seed"].append(split_share(share))
            break
    t = params.threshold
    if len(shares[v]["seed"]) < t or any(len(shares[u]["key"]) < t for u in pairs):
        return None
    seed = combine_shares(shares[v]["seed"][:t])
    pair = {u: _pairwise(bytes_to_private_key(combine_shares(shares[u]["key"][:t])), server._pk1[v], params.bits)
            for u in pairs}
    return _unmask_one(masked[v], v, seed, pair, params.bits)


@pytest.mark.parametrize("enrolled", [False, True])
def test_a_server_lying_about_dropouts_cannot_unmask_one_client(enrolled):
    """k = 4, t = 3 (2t > k + 1 holds), a sparse Harary graph. The server runs setup, share keys and
    collect honestly, then tells each holder a different story: every neighbour u of the target v
    "dropped" (to t of u's holders) and v "survived". No holder is asked for both secrets of one
    node, yet the server gets v's self-mask seed and every neighbour's mask key, hence every
    pairwise mask of v, hence v's update. Bell et al. (CCS 2020, Sec. 5) and Bonawitz et al.
    (CCS 2017, ConsistencyCheck) prevent this with a round in which the clients agree on (sign) the
    survivor set U3 before any share is revealed."""
    params = SecAggParams(degree=4, threshold=3, bits=16, scale=1.0)
    nodes = list(range(101, 111))
    server, clients, masked, words = _honest_until_unmask(params, nodes, 3, enrolled=enrolled, graph_rule=False)
    assert server.stage == CONSISTENCY_CHECK and server.u3 == frozenset(nodes)  # nobody dropped
    order = _ring(nodes, 3)
    assert all(server.neighbours[u] == frozenset({order[(i + o) % 10] for o in (-2, -1, 1, 2)})
               for i, u in enumerate(order))
    at = {p: order[p % 10] for p in range(-4, 5)}  # the node at ring offset p from v = at[0]
    # who declares which neighbour of v dead (ring offsets): each u in N(v) gets t = 3 such holders and
    # each holder keeps ≥ t survivors in its list (a b-matching; max-flow finds one for k = 8, t = 5 too)
    dead_at = {4: {2}, 3: {1, 2}, -4: {-2}, -3: {-1, -2}, 2: {1}, -2: {-1}, 1: {-1, 2}, -1: {1, -2}, 0: set()}
    dead_of = {at[p]: {at[q] for q in qs} for p, qs in dead_at.items()}
    recovered = _lie_and_unmask(params, server, clients, masked, at[0], sorted(server.neighbours[at[0]]), dead_of)
    assert recovered is None or not np.array_equal(recovered, words[at[0]]), "the server learned one client's update"


@pytest.mark.parametrize("enrolled", [False, True])
def test_a_server_lying_about_dropouts_cannot_unmask_one_client_in_a_complete_graph(enrolled):
    """Nine clients, k = 8 (the complete graph, the original SecAgg), t = 5. At collect the server
    forwards to v only t − 1 = 4 neighbours' shares (v accepts: 4 + 1 ≥ t), so v masks with those 4
    only; in unmask the other 8 holders are told that these 4 dropped (each holder still lists
    ≥ t survivors), so their mask keys come back, and v's seed from the holders told v survived."""
    params = SecAggParams(degree=8, threshold=5, bits=16, scale=1.0)
    nodes = list(range(201, 210))
    v, pairs = nodes[0], nodes[1:5]
    server, clients, masked, words = _honest_until_unmask(params, nodes, 0, trim={v: 4}, enrolled=enrolled,
                                                          graph_rule=False)
    others = [w for w in nodes if w != v]
    dead_of = {w: set(pairs) - {w} for w in others}  # never v itself: v's sources are only the 4
    recovered = _lie_and_unmask(params, server, clients, masked, v, pairs, dead_of)
    assert recovered is None or not np.array_equal(recovered, words[v]), "the server learned one client's update"


@pytest.mark.parametrize("enrolled", [False, True])
def test_a_server_telling_two_regions_two_stories_cannot_unmask_a_client_it_trimmed(enrolled):
    """The lie a MILP search finds against a global signed U3 with t neighbourhood signatures
    (docs/secagg-consistency.md), k = 4, t = 3, ring positions around v = 0: at collect v gets only
    the shares of ±2 (t − 1 sources), so it masks with those two. Story A (±1 dropped) is signed by
    v, +2 and −2: v's own checks pass, and v reveals its seed share. Story B (±2 dropped) is signed
    by everyone else, t of them around each: ±1 reveal v's seed share, and ±2's holders their mask
    keys. Blocked because a seed share is revealed only with its owner's signature on the same story
    (v signed A, not B)."""
    params = SecAggParams(degree=4, threshold=3, bits=16, scale=1.0)
    nodes = list(range(101, 111))
    order = _ring(nodes, 3)
    at = {p: order[p % 10] for p in range(-5, 6)}
    v = at[0]
    server, clients, masked, words = _honest_until_unmask(params, nodes, 3, trim={v: {at[-2], at[2]}},
                                                          enrolled=enrolled, graph_rule=False)
    assert clients[v]._sources == {at[-2], at[2]}
    region_a = {at[0], at[2], at[-2]}
    dead_of = {w: ({at[1], at[-1]} if w in region_a else {at[2], at[-2]}) for w in nodes}
    recovered = _lie_and_unmask(params, server, clients, masked, v, sorted(clients[v]._sources), dead_of)
    assert recovered is None or not np.array_equal(recovered, words[v]), "the server learned one client's update"


# ---- MEDIUM: SecAgg+ keys bound to nothing let a forging server learn x_v (fixed: enrolled signatures) --

def _forge_every_neighbour(client: SecAggClient, v: int, advertised: dict[int, bytes] | None) -> tuple[
        np.ndarray, np.ndarray | None, str | None]:
    """One honest client v; its 'neighbours' are Sybils the server simulates with signing keys of
    its own, advertising ``advertised`` (node → a real user's enrolled public key the server cannot
    sign for) or its own keys (None). Returns v's words, what the server recovered (None when the
    client refused) and the client's reason for refusing."""
    bits, t = 16, 3
    fake = [501, 502, 503, 504]
    keys = {u: (generate_key_pairs(), generate_key_pairs()) for u in fake}
    signing = {u: Ed25519PrivateKey.generate() for u in fake}
    session = bytes(16)
    words = random_words([v], LENGTH_WORDS, bits, seed=1)[v]
    recovered = refusal = None
    try:
        setup = client.handle({Key.STAGE: Stage.SETUP, SESSION: session, NEIGHBOURS: fake, Key.THRESHOLD: t,
                               BITS: bits, LENGTH: LENGTH_WORDS})
        members = sorted(fake + [v])
        pk = {u: (public_key_to_bytes(keys[u][0][1]), public_key_to_bytes(keys[u][1][1])) for u in fake}
        pk[v] = (setup[Key.PUBLIC_KEY_1], setup[Key.PUBLIC_KEY_2])
        shown = {u: (advertised or {}).get(u, public_bytes(signing[u])) for u in fake} | {v: setup[SIGNING_KEY]}
        signed = {u: signing[u].sign(keys_statement(client.run, client.round, session, u, shown[u], *pk[u]))
                  for u in fake} | {v: setup[KEY_SIGNATURE]}
        sent = client.handle({Key.STAGE: Stage.SHARE_KEYS, SESSION: session, Key.NODE_ID_LIST: members,
                              Key.PUBLIC_KEY_1: [pk[u][0] for u in members],
                              Key.PUBLIC_KEY_2: [pk[u][1] for u in members],
                              SIGNING_KEYS: [shown[u] for u in members], KEY_SIGNATURES: [signed[u] for u in members]})
        ctxts, seed_digests, key_digests = [], [], []
        for u in fake:  # each Sybil "shares" junk secrets with v (salted, committed), under the pair's key
            box = generate_shared_key(keys[u][1][0], bytes_to_public_key(pk[v][1]))
            junk = create_shares(bytes(32), t, len(members))[0] + bytes(SALT_BYTES)
            ctxts.append(encrypt(box, share_keys_plaintext_concat(u, v, junk, junk)))
            seed_digests.append(commit_share(session, u, v, SEED_SHARE, junk))
            key_digests.append(commit_share(session, u, v, KEY_SHARE, junk))
        reply = client.handle({Key.STAGE: Stage.COLLECT_MASKED_VECTORS, SESSION: session, Key.SOURCE_LIST: fake,
                               Key.CIPHERTEXT_LIST: ctxts, SEED_SHARE_COMMITMENTS: seed_digests,
                               KEY_SHARE_COMMITMENTS: key_digests}, words)
        seed_shares = []
        for dst, ctxt in zip(sent[Key.DESTINATION_LIST], sent[Key.CIPHERTEXT_LIST]):
            box = generate_shared_key(keys[dst][1][0], bytes_to_public_key(pk[v][1]))
            _, _, seed_share, _ = share_keys_plaintext_separate(decrypt(box, ctxt))
            seed_shares.append(split_share(seed_share))
        pair = {u: _pairwise(keys[u][0][0], pk[v][0], bits) for u in fake}
        recovered = _unmask_one(reply[Key.MASKED_PARAMETERS], v, combine_shares(seed_shares[:t]), pair, bits)
    except SecAggError as e:  # the client detected the forgery
        refusal = str(e)
    return words, recovered, refusal


@pytest.mark.parametrize("substitute", [False, True])
def test_a_server_that_forges_every_neighbour_cannot_unmask_the_client(substitute):
    """Enrolled mode: v holds the enrollment (v and four real users). The server either simulates
    Sybils with keys of its own, or shows the real users' enrolled keys with signatures it cannot
    make (replacing real neighbours' SecAgg+ keys); either way v refuses at share keys and reveals
    nothing."""
    v, real = 500, [Ed25519PrivateKey.generate() for _ in range(4)]
    own = Ed25519PrivateKey.generate()
    client = SecAggClient(v, run="run", round_=3, signing_key=own,
                          enrolled=frozenset(public_bytes(k) for k in [own, *real]), graph_rule=False)
    advertised = {u: public_bytes(k) for u, k in zip([501, 502, 503, 504], real)} if substitute else None
    words, recovered, refusal = _forge_every_neighbour(client, v, advertised)
    assert recovered is None or not np.array_equal(recovered, words), "the server learned the client's update"
    expected = "not signed by its signing key" if substitute else "not an enrolled user's"
    assert refusal is not None and expected in refusal and "\n" not in refusal


def test_without_an_enrollment_a_forging_server_is_trusted_by_construction():
    """The documented limit: a client with no enrollment (Flower's simulation, declared-insecure
    identity) cannot tell Sybils from neighbours, so a forging server learns its update."""
    words, recovered, refusal = _forge_every_neighbour(SecAggClient(500, run="run", round_=3), 500, None)
    assert refusal is None and recovered is not None and np.array_equal(recovered, words)


# ---- LOW: one hostile share holder aborts a round whose secrets t honest shares recover ---------------

def test_one_corrupted_share_never_aborts_a_round_with_t_honest_shares():
    """Defaults k = 8, t = 5: 9 holders per secret, C(8, 4) = 70 > 64 subsets contain the smallest
    holder. Node 1 (the smallest id) corrupts every share of its neighbours' secrets that it returns;
    8 ≥ t honest shares of each remain. Aborting here is worse than a DoS: the secrets are recoverable,
    so a curious server holds the aborted attempt's un-noised sum, and the redo (same selection, same
    model) gives it a second sum of the same round over a possibly different survivor set."""
    params = SecAggParams(degree=8, threshold=5, bits=16, scale=1.0)
    nodes = list(range(1, 13))
    hostile = 1

    def corrupt(stage, u, reply):
        if stage == Stage.UNMASK and u == hostile:  # others' shares only: its own secrets stay good
            return dict(reply) | {Key.SHARE_LIST: [s if owner == hostile else s[:4] + bytes(b ^ 0x01 for b in s[4:])
                                                   for owner, s in zip(reply[Key.NODE_ID_LIST],
                                                                       reply[Key.SHARE_LIST])]}
        return reply

    words = random_words(nodes, LENGTH_WORDS, params.bits, seed=2)
    try:
        server = run_round(params, words, tamper=corrupt, graph_seed=0)
    except SecAggAbort:
        server = None
    assert server is not None and server.stage == DONE
    assert np.array_equal(server.result, mod_sum(words.values(), LENGTH_WORDS, params.bits))
    assert server.bad_holders == {hostile}


# ---- MEDIUM: one hostile client sampled once ends the run (DoS beyond one round) --------------------

def test_one_client_with_a_wrong_seed_commitment_does_not_end_the_run(tmp_path, monkeypatch, caplog):
    """The hostile node sends a commitment that matches no seed it shares: its self mask can never be
    removed, so each attempt aborts at unmask. The redo keeps the selection, so the same node
    aborts all SECAGG_REDOS + 1 attempts and ``run_server`` raises: a single malicious client
    stops the federation. Expected: the round goes on without it (e.g. the named owner is left
    out of the redo as dropped, or its commitment is checked against its shares before collect)."""
    import logging

    from fedmf.run.private_run import REPEATABLE_NOISE_ENV
    from fedmf.secagg.messages import COMMITMENT, SECAGG_RECORD
    from server.app import run_server
    from server.local_grid import LocalGrid
    from tests.flower.test_secure_aggregation import SECURE, _config, _nodes, _stage

    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")
    monkeypatch.setattr(logging.getLogger("fedmf.server"), "propagate", True)
    hostile: list[int] = []

    def wrap(node_id, answer):
        def node(message):
            reply = answer(message)
            if _stage(message) == Stage.SHARE_KEYS and (not hostile or hostile == [node_id]) and reply is not None:
                hostile[:] = [node_id]
                reply.content.config_records[SECAGG_RECORD][COMMITMENT] = bytes(32)
            return reply
        return node

    grid = LocalGrid({node_id: wrap(node_id, answer) for node_id, answer in _nodes().items()})
    try:
        strategy = run_server(grid, _config(tmp_path, "dos", rounds=1, **{**SECURE, "min-sep": 1}))
    except SecAggAbort:
        strategy = None
    assert strategy is not None and len(strategy.history) == 1
    record = strategy.history[0]  # the hostile user stays sampled, is refused, and is not in the sum
    assert record.rejected >= 1 and record.contributed + record.rejected + record.dropped == record.selected
    assert record.contributed == record.selected - record.rejected - record.dropped >= 1


# ---- MEDIUM: an amplified-sampling draw below the threshold aborts every redo and ends the run --------

def test_a_drawn_cohort_below_the_threshold_is_released_as_dropped_not_aborted():
    """Amplified sampling keeps every round it draws, small or empty (``fedmf.run.cohort``), and
    ``SecureRound.run`` already releases an empty draw as a zero sum. A draw of 1..t−1 users raises
    ``SecAggAbort`` instead; ``DPMFStrategy._redo_aborted`` redoes the round with the same selection
    (``PrivateRun.abort``), so all SECAGG_REDOS + 1 attempts abort and the run stops. Expected: like
    the empty draw, the sampled users count as dropped (no update is summed, no one's update can be
    isolated) and the round is released with its noise."""
    from fedmf.secagg.quantize import Quantization
    from server.secagg_round import SecureRound

    params = SecAggParams(degree=4, threshold=3, bits=16, scale=1.0)
    q = Quantization(clip_norm=1.0, scale=1.0, bits=16, dim=2)
    rounds = SecureRound(params, q, {"w": (2,)})
    try:
        total = rounds.run(None, {"alice": 11, "bob": 22}, {"round": 0, "run-nonce": "n"}, None, 1.0)
    except SecAggAbort:
        total = None
    assert total is not None and not total.contributors and not total.words.any()
    assert not total.rejected and total.words.shape == (2,) and total.quantization is q
    assert rounds.server is None  # dropped, nobody asked


# ---- MEDIUM: the default graph degree tolerates few colluding clients --------------------------------

def test_the_default_parameters_keep_collusion_negligible():
    """An honest-but-curious server that colludes with c ≥ t of a client's k neighbours gets both
    of that client's secrets (the colluders hand over every share they hold). Bell et al. (CCS 2020,
    Sec. 4) choose k so that this has probability ≤ 2^-σ (σ = 40) for a stated corrupt fraction γ;
    with γ = 5 % and the old defaults k = 8, t = 5 it is ≈ 1.5·10⁻⁵ per client and round (≈ 2^-16),
    so a run of 1,000 users × 100 rounds expects about one exposed update. The defaults now derive
    k and t from each round's cohort: checked here for every cohort of 2 to 300 clients and a few
    larger ones (a client has min(k, n − 1) neighbours)."""
    from math import comb

    from server.config import FLOWER_DEFAULTS

    defaults = SecAggParams(degree=FLOWER_DEFAULTS["secagg-degree"], threshold=FLOWER_DEFAULTS["secagg-threshold"],
                            bits=32, scale=1.0)
    gamma = 0.05
    for n in [*range(2, 301), 1000, 10**6]:
        params = defaults.for_cohort(n)
        k, t = min(params.degree, n - 1), params.threshold
        exposed = sum(comb(k, c) * gamma**c * (1 - gamma) ** (k - c) for c in range(t, k + 1))
        assert exposed <= 2.0**-40


# ---- Re-review of 0cb75c9: who `culprits` names ----------------------------------------------------

def _play(server: SecAggServer, words, silent_at_unmask: set[int], tamper=None) -> None:
    """The five stages with honest clients; ``silent_at_unmask`` stay silent at unmask only."""
    clients = {u: SecAggClient(u) for u in words}
    for stage in STAGES:
        replies = {}
        for u, request in server.requests().items():
            if stage == Stage.UNMASK and u in silent_at_unmask:
                continue
            reply = clients[u].handle(request, words[u] if stage == Stage.COLLECT_MASKED_VECTORS else None)
            replies[u] = tamper(stage, u, reply) if tamper else reply
        server.receive(replies)


def test_an_honest_client_whose_holders_drop_at_unmask_is_not_named_a_culprit():
    """Defaults k = 8, t = 5, 12 honest nodes. Collect passes ``_check_holders`` (every owner keeps ≥ t
    holders in U3), then 5 of node v's neighbours go silent at unmask: v keeps 4 < t shares. No
    client misbehaved, yet ``SecAggServer.culprits`` names v (and some of the silent ones), so
    ``DPMFStrategy._exclude_culprits`` leaves v out of the redo as *rejected* with the reason "its
    committed mask secret did not reconstruct". Expected: an abort caused by dropouts names nobody."""
    params = SecAggParams(degree=8, threshold=5, bits=16, scale=1.0)
    nodes = list(range(1, 13))
    v = 6
    ring = _ring(nodes, seed=0)
    i = ring.index(v)
    silent = {ring[(i + o) % len(ring)] for o in (-1, 1, 2, 3, 4)}
    words = random_words(nodes, LENGTH_WORDS, params.bits, seed=3)
    server = SecAggServer(params, LENGTH_WORDS, nodes, rng=random.Random(0))
    with pytest.raises(SecAggAbort):
        _play(server, words, silent)
    assert v not in server.culprits and not server.culprits


def test_one_selectively_corrupted_share_never_frames_its_owner_for_a_larger_degree():
    """k = 14, t = 8 (2t > k + 1): 15 holders per secret, C(14, 7) = 3432 > 1024 subsets contain the
    smallest holder. Node 1 (the smallest id) corrupts only its share of one neighbour's seed and
    returns every other share intact, so ``_mark_bad`` never marks it; 14 ≥ t honest shares of that
    seed remain, yet the seed is not found, the round aborts and its honest owner is the culprit
    that the redo leaves out as rejected. The search also costs ~1024 Shamir combines for it.
    With share commitments the bad share is dropped on its own and its holder named."""
    params = SecAggParams(degree=14, threshold=8, bits=16, scale=1.0)
    nodes = list(range(1, 21))
    hostile = 1
    target = sorted(harary_graph(nodes, 14, random.Random(0))[hostile])[0]

    def corrupt(stage, u, reply):
        if stage == Stage.UNMASK and u == hostile:
            return dict(reply) | {Key.SHARE_LIST: [s[:4] + bytes(b ^ 0x01 for b in s[4:]) if owner == target else s
                                                   for owner, s in zip(reply[Key.NODE_ID_LIST],
                                                                       reply[Key.SHARE_LIST])]}
        return reply

    words = random_words(nodes, LENGTH_WORDS, params.bits, seed=4)
    server = SecAggServer(params, LENGTH_WORDS, nodes, rng=random.Random(0))
    try:
        _play(server, words, set(), corrupt)
    except SecAggAbort:
        pass
    assert target not in server.culprits and server.stage == DONE
    assert np.array_equal(server.result, mod_sum(words.values(), LENGTH_WORDS, params.bits))
    assert server.bad_holders == {hostile}


def test_an_owner_whose_shares_are_malformed_is_named_the_culprit(monkeypatch):
    """k = 8, t = 5, 12 nodes: node 6 deals each neighbour a seed share with a wrong index. Its holders
    accept the shares at collect, because node 6 commits to exactly what it deals (a share that does
    not match its commitment is refused there instead); the committed shares are then node 6's own
    word. Expected: the round aborts naming node 6 (and only it), so the redo goes on without it;
    before the share commitments, the holders' whole unmask replies were refused and nobody was named."""
    import client.secagg as client_secagg

    params = SecAggParams(degree=8, threshold=5, bits=16, scale=1.0)
    nodes, hostile = list(range(1, 13)), 6
    words = random_words(nodes, LENGTH_WORDS, params.bits, seed=3)
    server = SecAggServer(params, LENGTH_WORDS, nodes, rng=random.Random(0))
    clients = {u: SecAggClient(u) for u in nodes}
    honest_create = client_secagg.create_shares

    def wrong_index(secret: bytes, threshold: int, num: int) -> list[bytes]:
        shares = honest_create(secret, threshold, num)
        if len(secret) == 32:  # the mask seed's shares (the mask key is longer)
            shares = [(int.from_bytes(s[:4], "little") % 200 + 38).to_bytes(4, "little") + s[4:] for s in shares]
        return shares

    with pytest.raises(SecAggAbort):
        for stage in STAGES:
            replies = {}
            for u, request in server.requests().items():
                with monkeypatch.context() as patch:
                    if stage == Stage.SHARE_KEYS and u == hostile:
                        patch.setattr(client_secagg, "create_shares", wrong_index)
                    replies[u] = clients[u].handle(request, words[u] if stage == Stage.COLLECT_MASKED_VECTORS else None)
            server.receive(replies)
    assert hostile in server.culprits
    assert server.culprits == {hostile} and not server.bad_holders
