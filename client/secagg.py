"""SecAgg+ on the client: one round's answers to the server's four stages, as a state machine
over plain dict payloads (``server/secagg.py`` describes the protocol; Bell et al., CCS 2020).

A fresh ``SecAggClient`` serves one round attempt: new key pairs at setup, a new mask seed at
share keys. It guards its user against a curious server (not yet against one that lies about who
dropped: there is no consistency round, docs/reviews/REVIEW-i36-secagg.md HIGH-1): stages only in order and
once each, one session; a threshold that keeps an honest majority of each neighbourhood
(2t > shares); the public keys it is shown distinct and its own among them; shares only from
its neighbours, decrypted and checked for sender and recipient and against the owner's
commitment to each share (so that the server can tell a bad share's owner from its holder); in unmask, at least t
survivors, and never both the seed share and the key share of the same neighbour. Anything
else raises ``SecAggError`` (one line), which the adapter turns into an error reply.

The words to mask come from ``fedmf.secagg.quantize.quantize`` (clipped, quantized, with the
unclipped bit when adaptive clipping runs); the whole vector is masked.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
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
    KEY_SHARE,
    KEY_SHARE_COMMITMENTS,
    LENGTH,
    NEIGHBOURS,
    SALT_BYTES,
    SEED_BYTES,
    SEED_SHARE,
    SEED_SHARE_COMMITMENTS,
    SESSION,
    commit_seed,
    commit_share,
    split_share,
)
from fedmf.secagg.params import MAX_BITS, MIN_BITS

__all__ = ["SecAggClient"]

#: the tables kept in ``to_state``: state name → attribute (node id → bytes)
_TABLES = {"pk1s": "_pk1s", "box-keys": "_box_keys", "seed-shares": "_seed_shares", "key-shares": "_key_shares"}
_ORDER = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK)


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
    """Node ``node_id``'s side of one SecAgg+ round."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
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
                                 "sources": sorted(self._sources)}
        for name, table in _TABLES.items():
            held = getattr(self, table)
            state[f"{name}-ids"] = sorted(held)
            state[name] = [held[k] for k in sorted(held)]
        if self._next >= 1:
            state.update(sk1=private_key_to_bytes(self._sk1), sk2=private_key_to_bytes(self._sk2), pk1=self._pk1,
                         pk2=self._pk2)
        if self._next >= 2:
            state["seed"] = self._seed
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SecAggClient:
        """The client ``to_state`` wrote (SecAggError when it is not one)."""
        try:
            client = cls(int(state["node-id"]))
            client._next = int(state["next"])
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
                   Stage.COLLECT_MASKED_VECTORS: self._collect, Stage.UNMASK: self._unmask}[stage]
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
        self._threshold, self._neighbours = t, frozenset(neighbours)
        self._bits = _int(request, BITS, MIN_BITS, MAX_BITS)
        self._length = _int(request, LENGTH, 1, 2**40)
        self._sk1, pk1 = generate_key_pairs()
        self._sk2, pk2 = generate_key_pairs()
        self._pk1, self._pk2 = public_key_to_bytes(pk1), public_key_to_bytes(pk2)
        return {Key.PUBLIC_KEY_1: self._pk1, Key.PUBLIC_KEY_2: self._pk2}

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

    def _unmask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        active = _ids(request, Key.ACTIVE_NODE_ID_LIST)
        dead = _ids(request, Key.DEAD_NODE_ID_LIST)
        if set(active) & set(dead):
            raise SecAggError("a node is listed both as survivor and as dropped: refused")
        if self.node_id not in active or not set(active) <= self._sources | {self.node_id}:
            raise SecAggError("the survivors must include the client and only nodes whose shares it holds")
        if not set(dead) <= self._sources:
            raise SecAggError("the dropped nodes must be nodes whose shares the client holds")
        if len(active) < self._threshold:
            raise SecAggError(f"{len(active)} survivors, below the threshold {self._threshold}")
        shares = [self._seed_shares[v] for v in active] + [self._key_shares[v] for v in dead]
        return {Key.NODE_ID_LIST: active + dead, Key.SHARE_LIST: shares}
