"""SecAgg+ on the client: one round's answers to the server's five stages, as a state machine
over plain dict payloads (``server/secagg.py`` describes the protocol; Bell et al., CCS 2020).

A fresh ``SecAggClient`` serves one round attempt: new key pairs at setup, a new mask seed at
share keys. Its checks: stages only in order and once each, one session; a threshold that keeps
an honest majority of each neighbourhood (2t > shares); the public keys it is shown distinct, its
own among them, each signed (with the neighbour's node id, the run, round and session) by a
distinct signing key; shares only from its neighbours, decrypted and checked for sender and
recipient and against the owner's commitment to each share (so that the server can tell a bad
share's owner from its holder); at the consistency check, a survivor set U3 that contains it, names alive only
neighbours it masked with, and leaves it ≥ t survivors, which it signs once; in unmask, ≥ t − 1
valid signatures of its neighbours on exactly that U3, and exactly the lists these give (the
seed shares of itself and of the neighbours whose signature it verified, the key shares of its
sources outside U3): never both shares of one neighbour, and never a second story (Bonawitz et
al., CCS 2017, ConsistencyCheck; Bell et al., Sec. 5). Anything else raises ``SecAggError`` (one line), which the adapter turns into an
error reply; nothing is revealed then.

Against whom: with ``enrolled`` (the enrolled users' Ed25519 public keys, which the node holds
itself) and its own enrolled ``signing_key``, a neighbour's keys are accepted only when signed by
an enrolled key, so a server that substitutes or simulates neighbours is refused, and the
consistency signatures come from real users: the lies of docs/secagg-consistency.md (about
dropouts, forged or replaced neighbours) are refused; t colluding neighbours still unmask a
client. Without an enrollment (Flower's simulation, declared-insecure identity)
the client signs with a fresh key per attempt and accepts any neighbour's key: the server is
trusted by construction (honest-but-curious), and a server that forges neighbours learns updates.
Which mode applies is the node's own configuration, never the server's word.

The words to mask come from ``fedmf.secagg.quantize.quantize`` (clipped, quantized, with the
unclipped bit when adaptive clipping runs); the whole vector is masked.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.secure_aggregation.crypto.shamir import create_shares
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
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedmf.secagg.errors import SecAggError
from fedmf.secagg.masks import PAIRWISE_MASK, SELF_MASK, expand_mask, mod_add, mod_sub
from fedmf.secagg.messages import (
    BITS,
    COMMITMENT,
    CONSISTENCY_CHECK,
    KEY_SHARE,
    KEY_SHARE_COMMITMENTS,
    KEY_SIGNATURE,
    KEY_SIGNATURES,
    LENGTH,
    NEIGHBOURS,
    SALT_BYTES,
    SEED_BYTES,
    SEED_SHARE,
    SEED_SHARE_COMMITMENTS,
    SESSION,
    SIGNATURE,
    SIGNATURES,
    SIGNERS,
    SIGNING_KEY,
    SIGNING_KEYS,
    SURVIVORS,
    commit_seed,
    commit_share,
    split_share,
)
from fedmf.secagg.params import MAX_BITS, MIN_BITS, SECURITY_BITS, min_threshold
from fedmf.secagg.signing import (
    consistency_statement,
    keys_statement,
    private_bytes,
    public_bytes,
    signing_key_from,
    verifier,
)

__all__ = ["MIN_NEIGHBOURS", "SecAggClient"]

#: an enrolled client's smallest neighbourhood unless its node config says otherwise
#: (``secagg-min-neighbours``): a server that places colluders around it needs at least this many
MIN_NEIGHBOURS = 3

#: the tables kept in ``to_state``: state name → attribute (node id → bytes)
_TABLES = {"pk1s": "_pk1s", "box-keys": "_box_keys", "seed-shares": "_seed_shares", "key-shares": "_key_shares",
           "signers": "_signers"}
_ORDER = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, CONSISTENCY_CHECK, Stage.UNMASK)


def _ids(payload: Mapping[str, Any], key: str) -> list[int]:
    value = payload.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise SecAggError(f"{key} must be a list of node ids")
    if len(set(value)) != len(value):
        raise SecAggError(f"{key} repeats a node id")
    return value


def _int(payload: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SecAggError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


class SecAggClient:
    """Node ``node_id``'s side of one SecAgg+ round of run nonce ``run`` and round ``round_``.
    ``enrolled``: the enrolled users' raw Ed25519 public keys (None: no enrollment, a trusted
    server); ``signing_key``: the user's enrolled private key (required with ``enrolled``,
    refused without: a fresh key is drawn at setup then). In enrolled mode, with ``graph_rule``, setup
    refuses fewer than ``min_neighbours`` neighbours and a threshold below ``min_threshold`` of the
    neighbourhood shown (REVIEW-i36-secagg-2 MEDIUM-1); ``graph_rule=False`` only for tests of the
    protocol's own checks at small k and t."""

    def __init__(self, node_id: int, *, run: str = "", round_: int = 0,
                 signing_key: Ed25519PrivateKey | None = None, enrolled: frozenset[bytes] | None = None,
                 min_neighbours: int = MIN_NEIGHBOURS, graph_rule: bool = True) -> None:
        if (signing_key is None) != (enrolled is None):
            raise SecAggError("an enrolled signing key goes with the enrollment, and only with it")
        if enrolled is not None and public_bytes(signing_key) not in enrolled:
            raise SecAggError("this node's user key is not in its enrollment: refused")
        self.node_id = node_id
        self.run, self.round = run, round_
        self._min_neighbours = min_neighbours
        self._graph_rule = graph_rule
        self._enrolled = None if enrolled is None else frozenset(enrolled)
        self._signing_key = signing_key
        self._ephemeral = signing_key is None
        self._survivors: list[int] = []
        self._next = 0
        self._session: bytes | None = None
        self._threshold = self._bits = self._length = 0
        self._neighbours: frozenset[int] = frozenset()
        self._members: list[int] = []
        self._sources: frozenset[int] = frozenset()
        self._pk1s: dict[int, bytes] = {}
        self._box_keys: dict[int, bytes] = {}
        self._seed_shares: dict[int, bytes] = {}
        self._key_shares: dict[int, bytes] = {}
        self._signers: dict[int, bytes] = {}

    @property
    def bits(self) -> int:
        """The modulus bits the server announced at setup (0 before)."""
        return self._bits

    # -- kept between stages in the node's Context.state (one message per stage) ------------

    def to_state(self) -> dict[str, Any]:
        """This client's state as ConfigRecord values (its secrets included: the node's own
        ``Context.state``, never sent)."""
        state: dict[str, Any] = {"node-id": int(self.node_id), "next": self._next, "session": self._session or b"",
                                 "threshold": self._threshold, "bits": self._bits, "length": self._length,
                                 "neighbours": sorted(self._neighbours), "members": list(self._members),
                                 "sources": sorted(self._sources), "run": self.run, "round": self.round,
                                 "enrolled": not self._ephemeral, "survivors": list(self._survivors)}
        for name, table in _TABLES.items():
            held = getattr(self, table)
            state[f"{name}-ids"] = sorted(held)
            state[name] = [held[k] for k in sorted(held)]
        if self._next >= 1:
            state.update(sk1=private_key_to_bytes(self._sk1), sk2=private_key_to_bytes(self._sk2), pk1=self._pk1,
                         pk2=self._pk2)
            if self._ephemeral:
                state["signing-key"] = private_bytes(self._signing_key)
        if self._next >= 2:
            state["seed"] = self._seed
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], *, signing_key: Ed25519PrivateKey | None = None,
                   enrolled: frozenset[bytes] | None = None) -> SecAggClient:
        """The client ``to_state`` wrote, in the mode of the node's configuration (``__init__``);
        SecAggError when it is not one, or when it was written in the other mode."""
        try:
            if bool(state["enrolled"]) != (enrolled is not None):
                raise SecAggError("this node's enrollment changed during a secure-aggregation round: refused")
            client = cls(int(state["node-id"]), run=str(state["run"]), round_=int(state["round"]),
                         signing_key=signing_key, enrolled=enrolled)
            client._next = int(state["next"])
            client._survivors = [int(v) for v in state["survivors"]]
            client._session = bytes(state["session"]) or None
            client._threshold, client._bits, client._length = (int(state[k]) for k in ("threshold", "bits", "length"))
            client._neighbours = frozenset(int(v) for v in state["neighbours"])
            client._members = [int(v) for v in state["members"]]
            client._sources = frozenset(int(v) for v in state["sources"])
            for name, table in _TABLES.items():
                setattr(client, table, dict(zip((int(v) for v in state[f"{name}-ids"]), state[name])))
            if client._next >= 1:
                client._sk1, client._sk2 = bytes_to_private_key(state["sk1"]), bytes_to_private_key(state["sk2"])
                client._pk1, client._pk2 = state["pk1"], state["pk2"]
                if client._ephemeral:
                    client._signing_key = signing_key_from(state["signing-key"])
            if client._next >= 2:
                client._seed = state["seed"]
        except (KeyError, TypeError, ValueError) as e:
            raise SecAggError(f"the secure-aggregation state of this node is malformed ({type(e).__name__})") from None
        return client

    def handle(self, request: Mapping[str, Any], vector: np.ndarray | None = None) -> dict[str, Any]:
        """The reply to one stage's request; ``vector`` (uint64 words) only at collect."""
        if not isinstance(request, Mapping):
            raise SecAggError("a secure-aggregation request must be a mapping")
        stage = request.get(Key.STAGE)
        if self._next >= len(_ORDER) or stage != _ORDER[self._next]:
            expected = _ORDER[self._next] if self._next < len(_ORDER) else "none (the round is over)"
            raise SecAggError(f"secure-aggregation stage {stage!r} out of order: expected {expected}")
        session = request.get(SESSION)
        if stage == Stage.SETUP:
            if not isinstance(session, bytes) or not 16 <= len(session) <= 64:
                raise SecAggError("session must be 16 to 64 bytes")
            self._session = session
        elif session != self._session:
            raise SecAggError("a request of another session")
        if (vector is not None) != (stage == Stage.COLLECT_MASKED_VECTORS):
            raise SecAggError("a vector is masked at the collect stage, and only there")
        handler = {Stage.SETUP: self._setup, Stage.SHARE_KEYS: self._share_keys,
                   Stage.COLLECT_MASKED_VECTORS: self._collect, CONSISTENCY_CHECK: self._consistency,
                   Stage.UNMASK: self._unmask}[stage]
        reply = handler(request, vector) if vector is not None else handler(request)
        self._next += 1
        return {Key.STAGE: stage, **reply}

    def _setup(self, request: Mapping[str, Any]) -> dict[str, Any]:
        neighbours = _ids(request, NEIGHBOURS)
        if self.node_id in neighbours or not neighbours:
            raise SecAggError("the neighbour list must be non-empty and exclude the client itself")
        shares = len(neighbours) + 1
        t = _int(request, Key.THRESHOLD, 2, shares)
        if 2 * t <= shares:
            raise SecAggError(f"threshold {t} does not exceed half of the {shares} shares: refused")
        # enrolled mode: the server's graph is not trusted (REVIEW-i36-secagg-2 MEDIUM-1), so the client
        # checks what it can see: its neighbourhood's size and t against graph_for's rule for that size
        rule = self._enrolled is not None and self._graph_rule
        if rule and len(neighbours) < self._min_neighbours:
            raise SecAggError(f"{len(neighbours)} neighbours, below this node's minimum {self._min_neighbours}: refused")
        if rule and t < min_threshold(len(neighbours)):
            raise SecAggError(f"threshold {t} below {min_threshold(len(neighbours))} for {len(neighbours)} neighbours "
                              f"(both collusion bounds at 2^-{SECURITY_BITS}): refused")
        self._threshold, self._neighbours = t, frozenset(neighbours)
        self._bits = _int(request, BITS, MIN_BITS, MAX_BITS)
        self._length = _int(request, LENGTH, 1, 2**40)
        self._sk1, pk1 = generate_key_pairs()
        self._sk2, pk2 = generate_key_pairs()
        self._pk1, self._pk2 = public_key_to_bytes(pk1), public_key_to_bytes(pk2)
        if self._ephemeral:
            self._signing_key = Ed25519PrivateKey.generate()
        own = public_bytes(self._signing_key)
        signature = self._signing_key.sign(self._keys_statement(self.node_id, own, self._pk1, self._pk2))
        return {Key.PUBLIC_KEY_1: self._pk1, Key.PUBLIC_KEY_2: self._pk2, SIGNING_KEY: own, KEY_SIGNATURE: signature}

    def _keys_statement(self, node: int, signing_key: bytes, pk1: bytes, pk2: bytes) -> bytes:
        assert self._session is not None
        return keys_statement(self.run, self.round, self._session, node, signing_key, pk1, pk2)

    def _check_signed_keys(self, members: list[int], pk1s: list, pk2s: list, request: Mapping[str, Any]) -> None:
        """Each member's keys signed by a distinct signing key (an enrolled one where the node holds
        the enrollment); the client's own shown as it sent them."""
        signing, signatures = request.get(SIGNING_KEYS), request.get(KEY_SIGNATURES)
        if not isinstance(signing, list) or not isinstance(signatures, list) \
                or not len(signing) == len(signatures) == len(members):
            raise SecAggError("one signing key and one key signature per member are expected")
        if not all(isinstance(k, bytes) for k in signing) or len(set(signing)) != len(signing):
            raise SecAggError("the members' signing keys must be distinct byte strings")
        for v, raw, signature, pk1, pk2 in zip(members, signing, signatures, pk1s, pk2s):
            if v == self.node_id:
                if raw != public_bytes(self._signing_key):
                    raise SecAggError("the client's own signing key is shown wrong")
                continue
            if self._enrolled is not None and raw not in self._enrolled:
                raise SecAggError(f"the signing key of node {v} is not an enrolled user's: refused")
            key = verifier(raw)
            if key is None or not isinstance(signature, bytes) or not key.verify(
                    signature, self._keys_statement(v, raw, pk1, pk2)):
                raise SecAggError(f"the public keys of node {v} are not signed by its signing key: refused")

    def _share_keys(self, request: Mapping[str, Any]) -> dict[str, Any]:
        members = _ids(request, Key.NODE_ID_LIST)
        pk1s, pk2s = request.get(Key.PUBLIC_KEY_1), request.get(Key.PUBLIC_KEY_2)
        if not isinstance(pk1s, list) or not isinstance(pk2s, list) or not len(pk1s) == len(pk2s) == len(members):
            raise SecAggError("one pair of public keys per member is expected")
        if members != sorted(members) or self.node_id not in members or not set(members) <= self._neighbours | {
                self.node_id}:
            raise SecAggError("the members must be sorted, include the client and be among its neighbours")
        if len(members) < self._threshold:
            raise SecAggError(f"{len(members)} members, below the threshold {self._threshold}")
        keys = pk1s + pk2s
        if not all(isinstance(k, bytes) for k in keys) or len(set(keys)) != len(keys):
            raise SecAggError("the public keys must be distinct byte strings")
        mine = members.index(self.node_id)
        if pk1s[mine] != self._pk1 or pk2s[mine] != self._pk2:
            raise SecAggError("the client's own public keys are shown wrong")
        self._check_signed_keys(members, pk1s, pk2s, request)
        self._signers = {v: raw for v, raw in zip(members, request[SIGNING_KEYS]) if v != self.node_id}
        self._members = members
        seed = os.urandom(SEED_BYTES)
        self._seed = seed
        # each share travels with a fresh salt, under the owner's commitment (fedmf.secagg.messages)
        seed_shares = [s + os.urandom(SALT_BYTES) for s in create_shares(seed, self._threshold, len(members))]
        key_shares = [s + os.urandom(SALT_BYTES)
                      for s in create_shares(private_key_to_bytes(self._sk1), self._threshold, len(members))]
        session = self._session or b""
        seed_digests = [commit_share(session, self.node_id, v, SEED_SHARE, seed_shares[i]) for i, v in enumerate(members)]
        key_digests = [commit_share(session, self.node_id, v, KEY_SHARE, key_shares[i]) for i, v in enumerate(members)]
        dsts, ctxts = [], []
        for i, v in enumerate(members):
            if v == self.node_id:
                self._seed_shares[v], self._key_shares[v] = seed_shares[i], key_shares[i]
                continue
            try:
                box = generate_shared_key(self._sk2, bytes_to_public_key(pk2s[i]))
                self._pk1s[v] = pk1s[i]
                bytes_to_public_key(pk1s[i])
            except Exception:  # a key the server forwarded that does not parse or agree
                raise SecAggError(f"the public keys of node {v} are unusable") from None
            self._box_keys[v] = box
            dsts.append(v)
            ctxts.append(encrypt(box, share_keys_plaintext_concat(self.node_id, v, seed_shares[i], key_shares[i])))
        return {Key.DESTINATION_LIST: dsts, Key.CIPHERTEXT_LIST: ctxts, COMMITMENT: commit_seed(seed),
                SEED_SHARE_COMMITMENTS: seed_digests, KEY_SHARE_COMMITMENTS: key_digests}

    def _collect(self, request: Mapping[str, Any], vector: np.ndarray) -> dict[str, Any]:
        srcs = _ids(request, Key.SOURCE_LIST)
        ctxts = request.get(Key.CIPHERTEXT_LIST)
        if not isinstance(ctxts, list) or len(ctxts) != len(srcs) or not all(isinstance(c, bytes) for c in ctxts):
            raise SecAggError("one ciphertext per source is expected")
        digests = [request.get(SEED_SHARE_COMMITMENTS), request.get(KEY_SHARE_COMMITMENTS)]
        if not all(isinstance(d, list) and len(d) == len(srcs) for d in digests):
            raise SecAggError("one seed-share and one key-share commitment per source are expected")
        if not set(srcs) <= set(self._box_keys):
            raise SecAggError("shares from a node that is not a member of the client's neighbourhood")
        if len(srcs) + 1 < self._threshold:
            raise SecAggError(f"{len(srcs) + 1} share holders, below the threshold {self._threshold}")
        if not isinstance(vector, np.ndarray) or vector.dtype != np.uint64 or vector.shape != (self._length,):
            raise SecAggError(f"the vector must be {self._length} uint64 words")
        if np.any(vector >> np.uint64(self._bits)):
            raise SecAggError(f"the vector has words of more than {self._bits} bits")
        for src, ctxt, seed_digest, key_digest in zip(srcs, ctxts, *digests):
            try:
                actual, dst, seed_share, key_share = share_keys_plaintext_separate(decrypt(self._box_keys[src], ctxt))
            except Exception:  # a ciphertext that does not decrypt under the pair's key
                raise SecAggError(f"the shares from node {src} do not decrypt") from None
            if actual != src or dst != self.node_id:
                raise SecAggError(f"the shares from node {src} name sender {actual} and recipient {dst}")
            # a share that matches its owner's commitment here is this client's to return unchanged: a
            # mismatch at unmask is then its holder's fault, a committed but unusable share its owner's
            for kind, share, digest in ((SEED_SHARE, seed_share, seed_digest), (KEY_SHARE, key_share, key_digest)):
                if split_share(share) is None or commit_share(self._session or b"", src, self.node_id, kind,
                                                              share) != digest:
                    raise SecAggError(f"the shares from node {src} do not match its commitments")
            self._seed_shares[src], self._key_shares[src] = seed_share, key_share
        self._sources = frozenset(srcs)
        bits, n = self._bits, self._length
        masked = mod_add(vector, expand_mask(self._seed, n, bits, SELF_MASK), bits)
        for v in srcs:
            shared = base64.urlsafe_b64decode(generate_shared_key(self._sk1, bytes_to_public_key(self._pk1s[v])))
            mask = expand_mask(shared, n, bits, PAIRWISE_MASK)
            masked = mod_add(masked, mask, bits) if self.node_id > v else mod_sub(masked, mask, bits)
        return {Key.MASKED_PARAMETERS: masked}

    def _consistency_statement(self, node: int) -> bytes:
        assert self._session is not None
        pk1 = self._pk1 if node == self.node_id else self._pk1s[node]
        return consistency_statement(self.run, self.round, self._session, node, pk1, self._survivors)

    def _consistency(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Sign the survivor set U3, once: it must contain the client, name alive only neighbours
        it masked with, and leave it ≥ t survivors (itself included)."""
        survivors = set(_ids(request, SURVIVORS))
        if self.node_id not in survivors:
            raise SecAggError("the survivor set leaves out the client, which sent its masked vector: refused")
        alive = survivors & self._neighbours
        if not alive <= self._sources:
            raise SecAggError("the survivor set names alive a neighbour whose shares the client never got: refused")
        if len(alive) + 1 < self._threshold:
            raise SecAggError(f"{len(alive) + 1} survivors in the neighbourhood, below the threshold {self._threshold}")
        self._survivors = sorted(survivors)
        return {SIGNATURE: self._signing_key.sign(self._consistency_statement(self.node_id))}

    def _unmask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Shares only for exactly the lists the signed U3 gives, with t signatures on that U3: the
        seed shares of itself and of the neighbours whose signature on U3 it verified, the key
        shares of its sources outside U3. A neighbour in U3 that did not sign gets neither share (the
        round cannot complete then): revealing a survivor's seed share without its own signature on
        the same U3 lets a server that tells two regions of a sparse graph two stories unmask a client
        whose sources it trimmed (docs/secagg-consistency.md)."""
        signers = _ids(request, SIGNERS)
        signatures = request.get(SIGNATURES)
        if not isinstance(signatures, list) or len(signatures) != len(signers):
            raise SecAggError("one consistency signature per signer is expected")
        if not set(signers) <= set(self._signers):
            raise SecAggError("a consistency signature from a node outside the client's neighbourhood: refused")
        if not set(signers) <= set(self._survivors):
            raise SecAggError("a consistency signature from a node outside the signed survivor set: refused")
        for v, signature in zip(signers, signatures):
            key = verifier(self._signers[v])
            if key is None or not isinstance(signature, bytes) or not key.verify(
                    signature, self._consistency_statement(v)):
                raise SecAggError(f"node {v}'s consistency signature is not on the survivor set this client "
                                  f"signed: refused")
        if len(signers) + 1 < self._threshold:
            raise SecAggError(f"{len(signers) + 1} signatures on the survivor set, below the threshold "
                              f"{self._threshold}: refused")
        survivors = set(self._survivors)
        active = _ids(request, Key.ACTIVE_NODE_ID_LIST)
        dead = _ids(request, Key.DEAD_NODE_ID_LIST)
        if set(active) != set(signers) | {self.node_id} or set(dead) != self._sources - survivors:
            raise SecAggError("the survivors and dropped nodes asked are not those of the signed survivor set: "
                              "refused")
        shares = [self._seed_shares[v] for v in active] + [self._key_shares[v] for v in dead]
        return {Key.NODE_ID_LIST: active + dead, Key.SHARE_LIST: shares}
