"""What SecAgg+ clients sign, and how a signature is checked (Ed25519, RFC 8032; no Flower here).

Two statements, each a domain-separation tag then length-prefixed fields (a 4-byte big-endian
length before each field, as ``fedmf.enrollment``'s proof: one encoding for one tuple of fields):

* the keys a client advertises at setup (Bell et al., CCS 2020, Sec. 5: keys bound to identities)::

      "fedmf-secagg-keys/v1" 0x00 ‖ run ‖ round ‖ session ‖ node id ‖ signing key ‖ pk1 ‖ pk2

* the survivor set U3 it was told at the consistency check (Bonawitz et al., CCS 2017,
  ConsistencyCheck)::

      "fedmf-secagg-consistency/v1" 0x00 ‖ run ‖ round ‖ session ‖ node id ‖ pk1 ‖ U3

run: the run nonce, UTF-8; round and each node id: 8-byte big-endian unsigned; U3: its node ids
sorted, 8 bytes each, in one field; keys and session raw bytes. A signature made for another run,
round, attempt (session), node, key pair or survivor set does not verify. The survivor statement
names the signer's mask key pk1 of this attempt too: a neighbour whose signed keys a server replays
from an earlier attempt (same session bytes) cannot sign the survivor set with them.

The signing key is the user's enrolled Ed25519 key where each client holds the enrollment (its
neighbours' signatures are then checked against the enrolled keys: a server cannot forge or
replace a neighbour), else a fresh one per attempt (a trusted server: the signatures then only
make the consistency check's bookkeeping uniform, they authenticate nothing).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..enrollment import SIGNATURE_BYTES, EnrolledKey
from ..errors import ConfigError
from .errors import SecAggError

__all__ = ["keys_statement", "consistency_statement", "public_bytes", "private_bytes",
           "signing_key_from", "verifier", "SIGNATURE_BYTES", "SIGNING_KEY_BYTES"]

SIGNING_KEY_BYTES = 32

_KEYS_TAG = b"fedmf-secagg-keys/v1\x00"
_CONSISTENCY_TAG = b"fedmf-secagg-consistency/v1\x00"


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _u64(value: int) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise SecAggError("a signed round or node id must be an integer in [0, 2^64)")
    return struct.pack(">Q", value)


def _head(tag: bytes, run: str, round_: int, session: bytes, node_id: int) -> bytes:
    if not isinstance(run, str) or not isinstance(session, bytes):
        raise SecAggError("a signed statement needs the run nonce (str) and the session (bytes)")
    return tag + _field(run.encode("utf-8")) + _field(_u64(round_)) + _field(session) + _field(_u64(node_id))


def keys_statement(run: str, round_: int, session: bytes, node_id: int, signing_key: bytes, pk1: bytes,
                   pk2: bytes) -> bytes:
    """The bytes a client signs over the keys it advertises at setup."""
    return (_head(_KEYS_TAG, run, round_, session, node_id) + _field(bytes(signing_key)) + _field(bytes(pk1))
            + _field(bytes(pk2)))


def consistency_statement(run: str, round_: int, session: bytes, node_id: int, pk1: bytes,
                          survivors: Iterable[int]) -> bytes:
    """The bytes a client signs over the survivor set it was told (any order: sorted here)."""
    return (_head(_CONSISTENCY_TAG, run, round_, session, node_id) + _field(bytes(pk1))
            + _field(b"".join(_u64(u) for u in sorted(survivors))))


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    """The 32-byte raw public key of ``key``."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: Ed25519PrivateKey) -> bytes:
    """The 32-byte raw private key (a node's own ``Context.state`` only, never sent)."""
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def signing_key_from(raw: bytes) -> Ed25519PrivateKey:
    """The key ``private_bytes`` wrote."""
    return Ed25519PrivateKey.from_private_bytes(raw)


def verifier(raw: object) -> EnrolledKey | None:
    """``raw`` as a validated Ed25519 public key (a point, canonical, not of small order), or None."""
    if not isinstance(raw, bytes) or len(raw) != SIGNING_KEY_BYTES:
        return None
    try:
        return EnrolledKey(raw)
    except (ConfigError, ValueError):
        return None
