"""SecAgg+ on the server: one round's secure sum as a state machine over plain dict payloads.

Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020 (Alg. 1), with the consistency check of its
malicious-server variant (Sec. 5; Bonawitz et al., CCS 2017, ConsistencyCheck). Five stages,
each one ``requests()`` (node id → payload to send) and one ``receive(replies)`` (node id →
payload received, absent = dropped):

1. setup: the session, threshold t, modulus bits, vector length and each client's neighbours
   in a fresh random k-regular (Harary) graph → two public keys per client (mask key agreement,
   share encryption), its Ed25519 signing key and its signature over (run, round, session, node,
   signing key, both public keys) (``fedmf.secagg.signing``); a bad signature is refused here.
2. share keys: each client's neighbourhood's public keys, signing keys and key signatures → its
   encrypted Shamir shares of its mask seed and mask key (one per neighbour), a commitment to its
   seed, and a salted commitment to each share it deals (``fedmf.secagg.messages.commit_share``).
   The client checks every signature (against the enrolled keys where it holds the enrollment).
3. collect masked vectors: the shares addressed to each client, with their owners' commitments
   (which the client checks) → its words + self mask ± the pairwise masks of its neighbours that
   reached this stage, modulo 2^b. The whole vector is masked, adaptive clipping's bit included;
   every client weighs the same (no example counts).
4. consistency check: the survivor set U3 (all of it: Bell et al. restrict it to each
   neighbourhood to save bandwidth) → the client's signature over (run, round, session, node,
   its pk1, U3). A missing or bad signature is refused; since a survivor's seed share is
   revealed only with its own signature on U3, any survivor that did not sign aborts the round
   (a redo).
5. unmask: which neighbours survived and which dropped, and the signatures of the client's
   neighbours on the same U3 → the seed shares of the survivors (each with its signature) and
   the key shares of the dropped. A client answers only with ≥ t signatures (its own included)
   from its neighbourhood on exactly the U3 it signed, and only for the lists that U3 and those
   signatures give: a server that tells holders different stories about who dropped cannot
   gather both halves of one client's masks (docs/secagg-consistency.md). The server checks each
   share against its commitment, reconstructs each secret from t committed shares, checks it (the
   seed against its commitment, the key against its public key), removes the masks and holds the
   modular sum of the survivors' words (``result``).

Crypto is Flower's: ECDH key agreement with HKDF and Fernet encryption
(``flwr.common.secure_aggregation.crypto``), Shamir sharing (pycryptodome under the same
module), key pairs from ``flwr.supercore.primitives.asymmetric``; masks expand with ChaCha20
(``fedmf.secagg.masks``, which says why not Flower's 32-bit-seeded generator).

What a client sends is never trusted: a reply that is not exactly what its stage expects
(wrong stage, missing or extra keys, wrong node lists, bad keys or commitments, vectors of the
wrong length, dtype or range) is rejected with a one-line reason in
``rejected`` and its sender counts as dropped at that stage; a reply from a node that was not
asked is listed in ``ignored``. When the survivors can no longer satisfy the threshold, or no
t shares reconstruct a secret that checks, ``receive`` raises ``SecAggAbort`` and the round
must be redone with fresh noise (nothing was released); ``culprits`` then names whom the shares
prove at fault, which the redo leaves out as dropped. Every share is checked on its own against
the commitment its owner sent at share keys (and its holder checked at collect), so that no single
share can frame another client and no subset search is needed (REVIEW-i36 LOW-2, MEDIUM-6): a share
that fails its commitment is dropped and its holder recorded in ``bad_holders`` (and ``rejected``);
an owner whose committed shares are unusable or whose t committed shares do not give its committed
secret is the culprit; too few shares (silent holders) aborts with no culprit. The commitments are
salted hashes, hiding and binding in the random-oracle model (Bellare & Rogaway, CCS 1993), which
makes the owner's dealing non-repudiable as the dealer's commitments do in verifiable secret sharing
(Feldman, FOCS 1987); consistency is checked by reconstructing the committed secret, not
homomorphically. Calls out of order raise
``SecAggError`` and change nothing. The state machine itself never waits: the driver applies
``params.stage_timeout_s`` to each stage.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedmf.enrollment import EnrolledKey
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.masks import PAIRWISE_MASK, SELF_MASK, expand_mask, mod_add, mod_sub, mod_sum
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
    share_index,
    split_share,
)
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.signing import consistency_statement, keys_statement, verifier

__all__ = ["SecAggServer", "DONE", "ABORTED", "harary_graph"]

DONE, ABORTED = "done", "aborted"
MAX_KEY_BYTES = 1024
MAX_CIPHERTEXT_BYTES = 4096
MAX_SHARE_BYTES = 1024 + SALT_BYTES


class _Failed(SecAggAbort):
    """A secret that does not reconstruct; ``owner_at_fault`` when its owner's own committed shares
    prove it (else too few shares arrived, or holders returned shares that fail their commitments)."""

    def __init__(self, message: str, owner_at_fault: bool) -> None:
        super().__init__(message)
        self.owner_at_fault = owner_at_fault


class _Reject(Exception):
    """A reply that is refused (the message is the one-line reason)."""


def _is_node_id(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and 0 <= value < 2**64


def _int_list(payload: Mapping[str, Any], key: str) -> list[int]:
    value = payload.get(key)
    if not isinstance(value, list) or not all(_is_node_id(v) for v in value):
        raise _Reject(f"{key} must be a list of node ids")
    if len(set(value)) != len(value):
        raise _Reject(f"{key} repeats a node id")
    return [int(v) for v in value]


def _bytes_list(payload: Mapping[str, Any], key: str, count: int, max_bytes: int) -> list[bytes]:
    value = payload.get(key)
    if not isinstance(value, list) or len(value) != count:
        raise _Reject(f"{key} must be a list of {count} byte strings")
    if not all(isinstance(v, bytes) and 0 < len(v) <= max_bytes for v in value):
        raise _Reject(f"{key} must hold non-empty byte strings of at most {max_bytes} bytes")
    return list(value)


def _public_key(raw: object) -> ec.EllipticCurvePublicKey:
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_KEY_BYTES:
        raise _Reject(f"a public key must be at most {MAX_KEY_BYTES} bytes")
    try:
        key = bytes_to_public_key(raw)
    except Exception:  # any parse failure of a client's bytes is a rejected reply
        raise _Reject("a public key does not parse") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise _Reject("a public key is not on secp384r1 (Flower's key agreement curve)")
    return key


def harary_graph(nodes: Sequence[int], degree: int, rng: random.Random) -> dict[int, frozenset[int]]:
    """Each node's neighbours: the complete graph when ``degree`` ≥ n − 1, else a random Harary
    graph — the nodes shuffled on a ring, each linked to ``degree``/2 on each side (Bell et al.
    2020, Sec. 3: random, so that colluders cannot choose to surround a client)."""
    order = list(nodes)
    n = len(order)
    if degree >= n - 1:
        return {u: frozenset(order) - {u} for u in order}
    rng.shuffle(order)
    half = degree // 2
    return {u: frozenset(order[(i + o) % n] for o in range(-half, half + 1) if o) for i, u in enumerate(order)}


class SecAggServer:
    """One round's SecAgg+ aggregation of ``length`` words modulo 2^``params.bits`` over the
    sampled ``node_ids``. ``session`` names the round attempt (fresh random bytes by default);
    ``rng`` draws the graph (the operating system's generator by default); ``run`` (the run
    nonce) and ``round_`` go into every signed statement, as the clients were told them."""

    def __init__(self, params: SecAggParams, length: int, node_ids: Sequence[int], *,
                 session: bytes | None = None, rng: random.Random | None = None, run: str = "",
                 round_: int = 0) -> None:
        if not isinstance(params, SecAggParams):
            raise SecAggError(f"params must be SecAggParams, got {type(params).__name__}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise SecAggError(f"vector length must be a positive integer, got {length!r}")
        ids = list(node_ids)
        if not all(_is_node_id(u) for u in ids) or len(set(ids)) != len(ids):
            raise SecAggError("node ids must be distinct integers in [0, 2^64)")
        if len(ids) < 2:
            raise SecAggError(f"secure aggregation needs at least 2 clients, got {len(ids)}")
        params = params.for_cohort(len(ids))  # k and t of this round (derived from the cohort by default)
        if len(ids) < params.threshold:
            raise SecAggAbort(f"secure aggregation aborted at setup: {len(ids)} sampled clients, below the "
                              f"threshold {params.threshold}")
        if not isinstance(run, str) or isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
            raise SecAggError("run must be a string and round a non-negative integer")
        self.params = params
        self.length = length
        self.run, self.round = run, round_
        self.session = session if session is not None else random.SystemRandom().randbytes(16)
        if not isinstance(self.session, bytes) or not 16 <= len(self.session) <= 64:
            raise SecAggError("session must be 16 to 64 bytes")
        self.sampled = frozenset(int(u) for u in ids)
        self.neighbours = harary_graph(sorted(self.sampled), params.degree, rng or random.SystemRandom())
        self.stage = Stage.SETUP
        self.rejected: dict[int, str] = {}
        self.ignored: list[object] = []
        self.abort_reason: str | None = None
        #: set when unmask aborts: owners whose committed shares fail, and ``bad_holders``
        self.culprits: frozenset[int] = frozenset()
        #: holders seen returning a share that does not match its owner's commitment
        self.bad_holders: set[int] = set()
        #: set when the consistency check aborts: survivors of collect that did not sign U3 (a dropout or
        #: a hostile client; the strategy leaves them out of the redo, REVIEW-i36-secagg-2 MEDIUM-3)
        self.non_signers: frozenset[int] = frozenset()
        self.u1: frozenset[int] = frozenset()
        self.u2: frozenset[int] = frozenset()
        self.u3: frozenset[int] = frozenset()
        #: the survivors that signed U3 at the consistency check (asked at unmask)
        self.u4: frozenset[int] = frozenset()
        self._signing: dict[int, tuple[bytes, EnrolledKey, bytes]] = {}
        self._consistency: dict[int, bytes] = {}
        self._pk1: dict[int, bytes] = {}
        self._pk2: dict[int, bytes] = {}
        self._commitments: dict[int, bytes] = {}
        #: owner → holder → (commitment to the seed share, to the key share) it deals that holder
        self._share_commitments: dict[int, dict[int, tuple[bytes, bytes]]] = {}
        self._forward: dict[int, dict[int, bytes]] = {}
        self._masked_sum: np.ndarray | None = None
        self.result: np.ndarray | None = None

    # -- what the driver sees -------------------------------------------------------------

    @property
    def contributors(self) -> frozenset[int]:
        """The clients whose vectors are in the sum (those that sent a valid masked vector)."""
        return self.u3

    @property
    def dropped(self) -> frozenset[int]:
        """Sampled clients whose vectors are not in the sum."""
        if self.stage in (DONE, CONSISTENCY_CHECK, Stage.UNMASK):
            return self.sampled - self.u3
        return self.sampled - self._alive()

    def requests(self) -> dict[int, dict[str, Any]]:
        """The payload of the current stage for each client still taking part."""
        self._check_open()
        make: Callable[[int], dict[str, Any]] = {
            Stage.SETUP: self._setup_request, Stage.SHARE_KEYS: self._share_keys_request,
            Stage.COLLECT_MASKED_VECTORS: self._collect_request, CONSISTENCY_CHECK: self._consistency_request,
            Stage.UNMASK: self._signed_unmask_request,
        }[self.stage]
        return {u: {Key.STAGE: self.stage, SESSION: self.session, **make(u)} for u in sorted(self._alive())}

    def receive(self, replies: Mapping[int, object]) -> None:
        """Read the current stage's replies; go to the next stage, or raise ``SecAggAbort``."""
        self._check_open()
        if not isinstance(replies, Mapping):
            raise SecAggError("replies must be a mapping of node ids to payloads")
        stage, alive = self.stage, self._alive()
        read = {Stage.SETUP: self._read_setup, Stage.SHARE_KEYS: self._read_share_keys,
                Stage.COLLECT_MASKED_VECTORS: self._read_collect, CONSISTENCY_CHECK: self._read_consistency,
                Stage.UNMASK: self._read_unmask}[stage]
        accepted: dict[int, Any] = {}
        for node, payload in replies.items():
            if not _is_node_id(node) or int(node) not in alive:
                self.ignored.append(node)
                continue
            try:
                if not isinstance(payload, Mapping):
                    raise _Reject("a reply must be a mapping")
                named = payload.get(Key.STAGE)
                if not isinstance(named, str) or named != stage:
                    raise _Reject(f"a reply to stage {stage!r} names stage {named!r:.40}")
                accepted[int(node)] = read(int(node), payload)
            except _Reject as reason:
                self.rejected[int(node)] = f"{stage}: {reason}"
            except Exception as e:  # a malformed message must never stop the round
                self.rejected[int(node)] = f"{stage}: a malformed reply ({type(e).__name__})"
        try:
            self._advance(stage, accepted)
        except SecAggAbort as abort:
            self.stage, self.abort_reason = ABORTED, str(abort)
            raise

    # -- stages ----------------------------------------------------------------------------

    def _alive(self) -> frozenset[int]:
        return {Stage.SETUP: self.sampled, Stage.SHARE_KEYS: self.u1, Stage.COLLECT_MASKED_VECTORS: self.u2,
                CONSISTENCY_CHECK: self.u3, Stage.UNMASK: self.u4}.get(self.stage, frozenset())

    def _check_open(self) -> None:
        if self.stage == DONE:
            raise SecAggError("secure aggregation is done: no stage is open")
        if self.stage == ABORTED:
            raise SecAggError(f"secure aggregation was aborted: {self.abort_reason}")

    def _members(self, u: int) -> frozenset[int]:
        """The holders of ``u``'s shares: its neighbours that reached share keys, and itself."""
        return (self.neighbours[u] & self.u1) | {u}

    def _setup_request(self, u: int) -> dict[str, Any]:
        return {Key.THRESHOLD: self.params.threshold, BITS: self.params.bits, LENGTH: self.length,
                NEIGHBOURS: sorted(self.neighbours[u])}

    def _share_keys_request(self, u: int) -> dict[str, Any]:
        members = sorted(self._members(u))
        return {Key.NODE_ID_LIST: members, Key.PUBLIC_KEY_1: [self._pk1[v] for v in members],
                Key.PUBLIC_KEY_2: [self._pk2[v] for v in members], SIGNING_KEYS: [self._signing[v][0] for v in members],
                KEY_SIGNATURES: [self._signing[v][2] for v in members]}

    def _collect_request(self, u: int) -> dict[str, Any]:
        srcs = sorted(self._forward[u])
        return {Key.SOURCE_LIST: srcs, Key.CIPHERTEXT_LIST: [self._forward[u][v] for v in srcs],
                SEED_SHARE_COMMITMENTS: [self._share_commitments[v][u][0] for v in srcs],
                KEY_SHARE_COMMITMENTS: [self._share_commitments[v][u][1] for v in srcs]}

    def _consistency_request(self, u: int) -> dict[str, Any]:
        return {SURVIVORS: sorted(self.u3)}

    def _unmask_request(self, u: int) -> dict[str, Any]:
        return {Key.ACTIVE_NODE_ID_LIST: sorted((self.neighbours[u] & self.u3) | {u}),
                Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[u] & (self.u2 - self.u3))}

    def _signed_unmask_request(self, u: int) -> dict[str, Any]:
        """The unmask lists, with the consistency signatures of ``u``'s neighbours that signed U3."""
        signers = sorted((self._members(u) & self.u4) - {u})
        return {**self._unmask_request(u), SIGNERS: signers, SIGNATURES: [self._consistency[v] for v in signers]}

    @staticmethod
    def _exact_keys(payload: Mapping[str, Any], keys: set[str]) -> None:
        if set(payload) != keys | {Key.STAGE}:
            raise _Reject(f"a reply must carry exactly {sorted(keys | {Key.STAGE})}")

    def _read_setup(self, u: int, payload: Mapping[str, Any]) -> tuple[bytes, bytes, bytes, EnrolledKey, bytes]:
        self._exact_keys(payload, {Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2, SIGNING_KEY, KEY_SIGNATURE})
        pk1, pk2 = payload[Key.PUBLIC_KEY_1], payload[Key.PUBLIC_KEY_2]
        _public_key(pk1), _public_key(pk2)
        if pk1 == pk2:
            raise _Reject("the two public keys are equal")
        raw, signature = payload[SIGNING_KEY], payload[KEY_SIGNATURE]
        key = verifier(raw)
        if key is None:
            raise _Reject("the signing key is not a valid Ed25519 public key")
        if not isinstance(signature, bytes) or not key.verify(
                signature, keys_statement(self.run, self.round, self.session, u, raw, pk1, pk2)):
            raise _Reject("the signature over the public keys does not verify")
        return pk1, pk2, raw, key, signature

    def _read_consistency(self, u: int, payload: Mapping[str, Any]) -> bytes:
        self._exact_keys(payload, {SIGNATURE})
        signature = payload[SIGNATURE]
        statement = consistency_statement(self.run, self.round, self.session, u, self._pk1[u], self.u3)
        if not isinstance(signature, bytes) or not self._signing[u][1].verify(signature, statement):
            raise _Reject("the signature over the survivor set does not verify")
        return signature

    def _read_share_keys(self, u: int, payload: Mapping[str, Any]) -> tuple[dict[int, bytes], bytes,
                                                                            dict[int, tuple[bytes, bytes]]]:
        self._exact_keys(payload, {Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST, COMMITMENT, SEED_SHARE_COMMITMENTS,
                                   KEY_SHARE_COMMITMENTS})
        dsts = _int_list(payload, Key.DESTINATION_LIST)
        if set(dsts) != self._members(u) - {u}:
            raise _Reject("the shares are not addressed to exactly the client's neighbours")
        ctxts = _bytes_list(payload, Key.CIPHERTEXT_LIST, len(dsts), MAX_CIPHERTEXT_BYTES)
        commitment = payload[COMMITMENT]
        if not isinstance(commitment, bytes) or len(commitment) != 32:
            raise _Reject("the seed commitment must be 32 bytes")
        members = sorted(self._members(u))
        digests = []
        for key in (SEED_SHARE_COMMITMENTS, KEY_SHARE_COMMITMENTS):
            value = payload[key]
            if not isinstance(value, list) or len(value) != len(members) or not all(
                    isinstance(d, bytes) and len(d) == 32 for d in value):
                raise _Reject(f"{key} must hold one 32-byte commitment per member, in share order")
            digests.append(value)
        return dict(zip(dsts, ctxts)), commitment, dict(zip(members, zip(*digests)))

    def _read_collect(self, u: int, payload: Mapping[str, Any]) -> np.ndarray:
        self._exact_keys(payload, {Key.MASKED_PARAMETERS})
        vector = payload[Key.MASKED_PARAMETERS]
        if not isinstance(vector, np.ndarray) or vector.dtype.kind not in "ui" or vector.dtype.itemsize > 8:
            raise _Reject("the masked vector must be a numpy array of integers of at most 64 bits")
        if vector.shape != (self.length,):
            raise _Reject(f"the masked vector must have {self.length} words, got shape {vector.shape}")
        if vector.dtype.kind == "i" and vector.size and int(vector.min()) < 0:
            raise _Reject("the masked vector has negative words")
        if vector.size and int(vector.max()) >= self.params.modulus:
            raise _Reject(f"the masked vector has words of {self.params.bits} bits or more")
        return vector.astype(np.uint64)

    def _read_unmask(self, u: int, payload: Mapping[str, Any]) -> dict[int, bytes]:
        self._exact_keys(payload, {Key.NODE_ID_LIST, Key.SHARE_LIST})
        asked = self._unmask_request(u)
        nids = _int_list(payload, Key.NODE_ID_LIST)
        if set(nids) != set(asked[Key.ACTIVE_NODE_ID_LIST]) | set(asked[Key.DEAD_NODE_ID_LIST]):
            raise _Reject("the shares are not for exactly the neighbours asked")
        # each share is checked on its own against its commitment in _unmask: a bad one is dropped,
        # not the holder's whole reply
        return dict(zip(nids, _bytes_list(payload, Key.SHARE_LIST, len(nids), MAX_SHARE_BYTES)))

    def _advance(self, stage: str, accepted: dict[int, Any]) -> None:
        if stage == Stage.SETUP:
            counts: dict[bytes, int] = {}
            for keys in accepted.values():
                for raw in keys[:3]:
                    counts[raw] = counts.get(raw, 0) + 1
            for u, (pk1, pk2, raw, key, signature) in sorted(accepted.items()):
                if counts[pk1] > 1 or counts[pk2] > 1 or counts[raw] > 1:
                    self.rejected[u] = f"{stage}: a public key is also another client's"
                else:
                    self._pk1[u], self._pk2[u], self._signing[u] = pk1, pk2, (raw, key, signature)
            self.u1 = frozenset(self._pk1)
            self._check_holders(stage, self.u1, self.u1, self.u1)
            self.stage = Stage.SHARE_KEYS
        elif stage == Stage.SHARE_KEYS:
            self.u2 = frozenset(accepted)
            self._commitments = {u: c for u, (_, c, _) in accepted.items()}
            self._share_commitments = {u: d for u, (_, _, d) in accepted.items()}
            self._forward = {u: {} for u in self.u2}
            for src, (ctxts, _, _) in accepted.items():
                for dst, ctxt in ctxts.items():
                    if dst in self.u2:
                        self._forward[dst][src] = ctxt
            self._check_holders(stage, self.u2, self.u2, self.u2)
            self.stage = Stage.COLLECT_MASKED_VECTORS
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            self.u3 = frozenset(accepted)
            self._forward = {}
            self._masked_sum = mod_sum((accepted[u] for u in sorted(self.u3)), self.length, self.params.bits)
            self._check_holders(stage, self.u3, self.u2, self.u3)
            self.stage = CONSISTENCY_CHECK
        elif stage == CONSISTENCY_CHECK:
            # a survivor's seed share is revealed only with its own signature on U3: one that did not
            # sign keeps its self mask, so the round cannot complete (a redo, nobody blamed)
            self.u4 = frozenset(accepted)
            self._consistency = dict(accepted)
            if self.u3 - self.u4:
                self.non_signers = self.u3 - self.u4
                raise SecAggAbort(f"secure aggregation aborted at {stage}: {len(self.u3 - self.u4)} of "
                                  f"{len(self.u3)} survivors did not sign the survivor set, so their self masks "
                                  f"cannot be removed")
            self.stage = Stage.UNMASK
        else:
            self.result = self._unmask(accepted)
            self._masked_sum = None
            self.stage = DONE

    def _check_holders(self, stage: str, survivors: frozenset[int], owners: frozenset[int],
                       holders: frozenset[int]) -> None:
        """Abort unless ≥ t clients survive and every owner of a secret still needed keeps ≥ t
        share holders among ``holders`` (its surviving neighbours, and itself if it survives)."""
        t = self.params.threshold
        if len(survivors) < t:
            raise SecAggAbort(f"secure aggregation aborted at {stage}: {len(survivors)} clients left, below the "
                              f"threshold {t}")
        for owner in sorted(owners):
            count = len((self.neighbours[owner] | {owner}) & holders)
            if count < t:
                raise SecAggAbort(f"secure aggregation aborted at {stage}: node {owner} keeps {count} share "
                                  f"holders, below the threshold {t}")

    # -- unmasking ---------------------------------------------------------------------------

    def _verified(self, owner: int, returned: dict[int, bytes], kind: bytes) -> tuple[dict[int, bytes], bool]:
        """The Shamir shares of ``returned`` (holder → share ‖ salt) that match ``owner``'s commitments,
        and whether one of them is unusable (malformed, or another holder's index): a committed share
        is the owner's own word. A share that fails its commitment is dropped and its holder, which
        checked it at collect, recorded in ``bad_holders`` (and ``rejected``)."""
        slot = 0 if kind == SEED_SHARE else 1
        verified, unusable = {}, False
        for holder, salted in sorted(returned.items()):
            if commit_share(self.session, owner, holder, kind, salted) != self._share_commitments[owner][holder][slot]:
                self.bad_holders.add(holder)
                self.rejected.setdefault(holder, f"{Stage.UNMASK}: its share of node {owner}'s secret does not "
                                                 f"match the owner's commitment")
                continue
            share = split_share(salted)
            if share is None or int.from_bytes(share[:4], "little") != share_index(self._members(owner), holder):
                unusable = True
            else:
                verified[holder] = share
        return verified, unusable

    def _reconstruct(self, owner: int, returned: dict[int, bytes], kind: bytes, check: Callable[[bytes], bool],
                     what: str) -> bytes:
        """The secret of ``owner`` that ``check`` accepts, from t of its returned shares that match
        its commitments, or ``_Failed``. Each share is checked on its own (no subset search, so no
        limit on k): t committed shares of an honestly dealt polynomial always give the committed
        secret, so when they do not, or a committed share is unusable, the owner is at fault."""
        t = self.params.threshold
        verified, unusable = self._verified(owner, returned, kind)
        if unusable:
            raise _Failed(f"secure aggregation aborted at unmask: node {owner} dealt a share of its {what} with "
                          f"another holder's index or no Shamir share's format", True)
        if len(verified) >= t:
            holders = sorted(verified)[:t]
            secret = self._combine(verified, holders)
            if secret is not None and check(secret):
                return secret
            raise _Failed(f"secure aggregation aborted at unmask: {t} committed shares of node {owner}'s {what} "
                          f"do not reconstruct the committed secret", True)
        if len(returned) >= t:  # holders answered, but with shares that fail their commitments
            bad = sorted(set(returned) - set(verified))
            raise _Failed(f"secure aggregation aborted at unmask: no {t} shares of node {owner}'s {what} "
                          f"reconstruct the committed secret: {len(verified)} match the owner's commitments, "
                          f"holders {bad} returned others", False)
        raise _Failed(f"secure aggregation aborted at unmask: {len(returned)} shares of node {owner}'s {what}, "
                      f"below the threshold {t}", False)

    @staticmethod
    def _combine(shares: dict[int, bytes], subset: Sequence[int]) -> bytes | None:
        try:
            return combine_shares([shares[h] for h in subset])
        except Exception:  # shares that do not combine
            return None

    def _seed_checks(self, owner: int) -> Callable[[bytes], bool]:
        return lambda secret: commit_seed(secret) == self._commitments[owner]

    def _key_checks(self, owner: int) -> Callable[[bytes], bool]:
        expected = bytes_to_public_key(self._pk1[owner]).public_numbers()

        def check(secret: bytes) -> bool:
            try:
                key = bytes_to_private_key(secret)
                return isinstance(key, ec.EllipticCurvePrivateKey) and key.public_key().public_numbers() == expected
            except Exception:  # not a private key at all
                return False
        return check

    def _unmask(self, replies: dict[int, dict[int, bytes]]) -> np.ndarray:
        dead = self.u2 - self.u3
        shares: dict[int, dict[int, bytes]] = {owner: {} for owner in self.u2}
        for holder, owned in replies.items():
            for owner, share in owned.items():
                shares[owner][holder] = share
        bits, total = self.params.bits, self._masked_sum
        assert total is not None
        seeds, keys, failed = {}, {}, []
        for owner in sorted(self.u3):  # every owner is tried, so that an abort names all culprits
            try:
                seeds[owner] = self._reconstruct(owner, shares[owner], SEED_SHARE, self._seed_checks(owner),
                                                 "mask seed")
            except _Failed as e:
                failed.append((owner, e))
        for owner in sorted(dead):
            try:
                keys[owner] = self._reconstruct(owner, shares[owner], KEY_SHARE, self._key_checks(owner), "mask key")
            except _Failed as e:
                failed.append((owner, e))
        if failed:
            # culprits: owners whose own committed shares fail, and holders that returned shares other
            # than the committed ones; too few shares means holders went silent (dropouts): no blame
            self.culprits = frozenset({owner for owner, e in failed if e.owner_at_fault} | self.bad_holders)
            raise SecAggAbort("; ".join(str(e) for _, e in failed))
        for seed in seeds.values():
            total = mod_sub(total, expand_mask(seed, self.length, bits, SELF_MASK), bits)
        for owner, raw in keys.items():
            key = bytes_to_private_key(raw)
            for u in sorted(self.neighbours[owner] & self.u3):
                shared = base64.urlsafe_b64decode(generate_shared_key(key, bytes_to_public_key(self._pk1[u])))
                mask = expand_mask(shared, self.length, bits, PAIRWISE_MASK)
                total = mod_sub(total, mask, bits) if u > owner else mod_add(total, mask, bits)
        return total
