"""The signed statements of SecAgg+ (fedmf.secagg.signing): one unambiguous encoding per tuple of
fields, separated by domain from each other and from the identity proof."""

from __future__ import annotations

import struct

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedmf.enrollment import proof_message
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.signing import (
    consistency_statement,
    keys_statement,
    private_bytes,
    public_bytes,
    signing_key_from,
    verifier,
)

SESSION = bytes(range(16))


def _fields(data: bytes, tag: bytes) -> list[bytes]:
    assert data.startswith(tag)
    rest, fields = data[len(tag):], []
    while rest:
        (n,) = struct.unpack(">I", rest[:4])
        fields.append(rest[4:4 + n])
        rest = rest[4 + n:]
    return fields


def test_the_keys_statement_is_tag_then_length_prefixed_fields():
    data = keys_statement("nonce", 7, SESSION, 2**64 - 1, b"S" * 32, b"pk1", b"pk-2")
    assert _fields(data, b"fedmf-secagg-keys/v1\x00") == [
        b"nonce", (7).to_bytes(8, "big"), SESSION, (2**64 - 1).to_bytes(8, "big"), b"S" * 32, b"pk1", b"pk-2"]


def test_the_consistency_statement_sorts_the_survivors_and_names_the_signers_key():
    data = consistency_statement("nonce", 7, SESSION, 5, b"pk1", [9, 3, 2**40])
    assert data == consistency_statement("nonce", 7, SESSION, 5, b"pk1", [2**40, 9, 3])
    fields = _fields(data, b"fedmf-secagg-consistency/v1\x00")
    assert fields[4] == b"pk1" and fields[5] == b"".join(u.to_bytes(8, "big") for u in (3, 9, 2**40))


def test_any_other_field_gives_other_bytes_and_the_domains_never_meet():
    base = ("ab", 1, SESSION, 3, b"pk1", [1, 2, 3])
    variants = [("a", 1, SESSION, 3, b"bpk1", [1, 2, 3]), ("ab", 2, SESSION, 3, b"pk1", [1, 2, 3]),
                ("ab", 1, SESSION[::-1], 3, b"pk1", [1, 2, 3]), ("ab", 1, SESSION, 4, b"pk1", [1, 2, 3]),
                ("ab", 1, SESSION, 3, b"pk2", [1, 2, 3]), ("ab", 1, SESSION, 3, b"pk1", [1, 2])]
    statements = {consistency_statement(*v) for v in [base, *variants]}
    assert len(statements) == 1 + len(variants)
    keys = keys_statement("ab", 1, SESSION, 3, b"k" * 32, b"pk1", b"pk2")
    proof = proof_message("ab", 1, 3, bytes(32), "user")
    assert not any(s.startswith(keys[:20]) or s.startswith(proof[:20]) for s in statements)


def test_keys_round_trip_and_bad_public_keys_are_refused():
    key = Ed25519PrivateKey.generate()
    assert public_bytes(signing_key_from(private_bytes(key))) == public_bytes(key)
    check = verifier(public_bytes(key))
    message = keys_statement("n", 0, SESSION, 1, public_bytes(key), b"a", b"b")
    assert check is not None and check.verify(key.sign(message), message)
    assert not check.verify(key.sign(message), message + b"x")
    # the identity point (small order) would accept signatures made without a private key
    assert verifier(b"\x01" + bytes(31)) is None and verifier(b"short") is None and verifier("text") is None


@pytest.mark.parametrize("bad", [-1, 2**64, True])
def test_out_of_range_ids_are_refused(bad):
    with pytest.raises(SecAggError, match="2\\^64"):
        consistency_statement("n", 0, SESSION, bad, b"pk1", [1])
