"""What both ends of SecAgg+ must agree on beyond Flower's record keys
(``flwr.common.secure_aggregation.secaggplus_constants.Key``, used by the adapters).

* A fifth stage, ``CONSISTENCY_CHECK`` (Flower's ``Stage`` has none; named in its style), between
  collect and unmask: the survivor set U3 to each survivor, its signature back, and the
  neighbours' signatures forwarded with the unmask request (``fedmf.secagg.signing``).
* Extra payload keys: the round's session, the modulus bits, the vector length, the neighbour
  list sent at setup, and the commitment to the mask seed sent with the shares; the signing key
  and the signature over the advertised keys (setup reply; forwarded per member at share keys);
  the survivors, a client's signature over them, and the signers and signatures forwarded at
  unmask.
* Share order: a client's secret is split into one share per member of its neighbourhood
  (itself included), share i + 1 to the i-th smallest node id; the server checks each share's
  index against its holder.
* On the wire (``to_wire`` / ``from_wire``): a payload's values are what a Flower ConfigRecord
  holds (str, int, bytes, lists of them); the one numpy vector (the masked words) travels as
  little-endian uint64 bytes.
* The commitment to a mask seed is SHA-256 over a domain tag and the seed (a 256-bit uniform
  seed: the digest reveals nothing usable); a reconstructed seed is accepted only when it
  matches. A reconstructed mask key is checked against the public key the client sent instead.
* Share commitments: with its shares the owner sends, for every member in share order, a salted
  SHA-256 commitment to the seed share and one to the key share it deals that member
  (``commit_share``: session, owner, holder and kind bound in; a fresh 32-byte salt, so that the
  digest is hiding and binding in the random-oracle model, Bellare & Rogaway, CCS 1993). A share
  travels as share ‖ salt (``split_share``): inside the encrypted payload to its holder, which
  checks it against the commitment the server forwards at collect, and back to the server at
  unmask, which checks it again. A committed share is the owner's own word, a share that fails its
  commitment its holder's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["SECAGG_RECORD", "SESSION", "BITS", "LENGTH", "NEIGHBOURS", "COMMITMENT", "SEED_BYTES", "share_order", "share_index",
           "commit_seed", "SEED_SHARE_COMMITMENTS", "KEY_SHARE_COMMITMENTS", "SEED_SHARE", "KEY_SHARE",
           "SALT_BYTES", "commit_share", "split_share", "to_wire", "from_wire", "CONSISTENCY_CHECK", "SIGNING_KEY",
           "KEY_SIGNATURE", "SIGNING_KEYS", "KEY_SIGNATURES", "SURVIVORS", "SIGNATURE", "SIGNERS", "SIGNATURES"]

#: the Flower ConfigRecord holding a stage's payload, in the request and in the reply
SECAGG_RECORD = "secagg"
SESSION = "session"
BITS = "bits"
LENGTH = "length"
NEIGHBOURS = "neighbours"
COMMITMENT = "seed-commitment"
SEED_SHARE_COMMITMENTS = "seed-share-commitments"
KEY_SHARE_COMMITMENTS = "key-share-commitments"
#: what a share commits to: the mask seed (self mask) or the mask key (pairwise masks)
SEED_SHARE, KEY_SHARE = b"s", b"k"
#: the consistency check's stage name, between Stage.COLLECT_MASKED_VECTORS and Stage.UNMASK
CONSISTENCY_CHECK = "consistency_check"
SIGNING_KEY = "signing-key"
KEY_SIGNATURE = "key-signature"
SIGNING_KEYS = "signing-keys"
KEY_SIGNATURES = "key-signatures"
SURVIVORS = "survivors"
SIGNATURE = "signature"
SIGNERS = "signers"
SIGNATURES = "signatures"

#: a client's mask seed: 32 random bytes from the operating system
SEED_BYTES = 32
#: the salt appended to each share (fresh random bytes per share)
SALT_BYTES = 32

_COMMIT_TAG = b"fedmf secagg seed commitment v1\x00"
_SHARE_TAG = b"fedmf secagg share commitment v1\x00"


def share_order(members: Iterable[int]) -> list[int]:
    """The holders of a client's shares, in share order (smallest node id first)."""
    return sorted(members)


def share_index(members: Iterable[int], holder: int) -> int:
    """The 1-based Shamir index of ``holder``'s share (``holder`` must be a member)."""
    return share_order(members).index(holder) + 1


def commit_seed(seed: bytes) -> bytes:
    """The 32-byte commitment to a mask seed."""
    return hashlib.sha256(_COMMIT_TAG + seed).digest()


def commit_share(session: bytes, owner: int, holder: int, kind: bytes, salted: bytes) -> bytes:
    """The 32-byte commitment to the share ‖ salt ``salted`` that ``owner`` deals ``holder``."""
    head = len(session).to_bytes(1, "little") + session + owner.to_bytes(8, "little") + holder.to_bytes(8, "little")
    return hashlib.sha256(_SHARE_TAG + head + kind + salted).digest()


def split_share(salted: bytes) -> bytes | None:
    """The Shamir share in share ‖ salt (4 index bytes + 16·j bytes), None when malformed."""
    share = salted[:-SALT_BYTES]
    if len(salted) <= SALT_BYTES or len(share) < 20 or (len(share) - 4) % 16:
        return None
    return share


def to_wire(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` with its numpy vector as little-endian uint64 bytes (the rest as is)."""
    return {k: (v.astype("<u8").tobytes() if isinstance(v, np.ndarray) else v) for k, v in payload.items()}


def from_wire(record: Mapping[str, Any], vector_key: str) -> dict[str, Any]:
    """The payload of a received record: ``vector_key``'s bytes as a uint64 vector when they are
    whole words (else left as they are, for the receiver's checks to refuse); lists copied."""
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in record.items()}
    raw = out.get(vector_key)
    if isinstance(raw, bytes) and len(raw) % 8 == 0:
        out[vector_key] = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    return out
