"""Users are authenticated, not declared: Ed25519 proofs (fedmf.enrollment), the enrollment file and its
CLI (``fedmf user``), the ClientApp's proof, and the server's NodeDirectory over in-process nodes
(impostors, unknown and revoked users, a user proven twice, the per-node timeout and backoff on a fake clock)."""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, Message, RecordDict

from client.app import ERROR_CODE
from client.app import app as client_app
from fedmf.cli import main as fedmf_main
from fedmf.enrollment import (
    Enrollment,
    EnrollmentFile,
    generate_key_pair,
    load_private_key,
    new_challenge,
    proof_message,
    read_public_key,
    sign_proof,
    verify_proof,
)
from fedmf.errors import ConfigError
from server import identity as identity_module
from server.config import ServerConfig
from server.identity import IdentityPolicy, NodeDirectory, identity_policy
from server.local_grid import LocalGrid, client_node

RUN = "7:0123456789abcdef"


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# ---- the proof ---------------------------------------------------------------------------------

def test_a_proof_verifies_only_for_exactly_the_fields_signed():
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    challenge = new_challenge()
    fields = (RUN, 3, 2 ** 63 + 5, challenge, "alice")
    signature = sign_proof(key, *fields)
    assert len(signature) == 64 and verify_proof(_raw(key), signature, *fields)
    changed = {"run": (RUN + "x", 3, 2 ** 63 + 5, challenge, "alice"),
               "round": (RUN, 4, 2 ** 63 + 5, challenge, "alice"),
               "node": (RUN, 3, 2 ** 63 + 6, challenge, "alice"),
               "challenge": (RUN, 3, 2 ** 63 + 5, new_challenge(), "alice"),
               "user": (RUN, 3, 2 ** 63 + 5, challenge, "alice2")}
    for name, wrong in changed.items():
        assert not verify_proof(_raw(key), signature, *wrong), name
    assert not verify_proof(_raw(other), signature, *fields)  # another user's key
    assert not verify_proof(_raw(key), sign_proof(other, *fields), *fields)
    for bad in (signature[:-1], signature + b"\0", b"", "sig", None, 7, bytes(64)):
        assert not verify_proof(_raw(key), bad, *fields)
    # the encoding is unambiguous: moving a byte from one field to the next changes the message
    assert proof_message("ab", 0, 0, challenge, "c") != proof_message("a", 0, 0, challenge, "bc")
    assert proof_message(RUN, 1, 2, challenge, "u").startswith(b"fedmf-identity-proof/v1\x00")


# ---- key files ---------------------------------------------------------------------------------

def test_keygen_writes_a_0600_private_key_and_refuses_to_overwrite(tmp_path):
    old = os.umask(0)  # even with a permissive umask
    try:
        public = generate_key_pair(tmp_path / "alice.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "alice.key").stat().st_mode) == 0o600
    assert read_public_key(tmp_path / "alice.key.pub") == public == _raw(load_private_key(tmp_path / "alice.key"))
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_key_pair(tmp_path / "alice.key")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o700])
def test_a_private_key_others_can_access_is_refused_without_showing_it(tmp_path, mode):
    generate_key_pair(tmp_path / "k")
    pem = (tmp_path / "k").read_text()
    (tmp_path / "k").chmod(mode)
    if mode == 0o700:  # only the owner: accepted
        load_private_key(tmp_path / "k")
        return
    with pytest.raises(ConfigError, match="accessible by group or others") as e:
        load_private_key(tmp_path / "k")
    assert "\n" not in str(e.value) and pem.splitlines()[1] not in str(e.value)


def test_a_key_file_that_is_not_an_ed25519_key_is_refused(tmp_path):
    ec_key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    for name, data, match in (("ec", ec_key, "not an Ed25519 key"), ("junk", b"secret-junk\n", "not an unencrypted")):
        path = tmp_path / name
        path.write_bytes(data)
        path.chmod(0o600)
        with pytest.raises(ConfigError, match=match) as e:
            load_private_key(path)
        assert "secret-junk" not in str(e.value)
    (tmp_path / "link").symlink_to(tmp_path / "ec")
    with pytest.raises(ConfigError):
        load_private_key(tmp_path / "link")
    with pytest.raises(ConfigError, match="No such file"):
        load_private_key(tmp_path / "missing")


# ---- the enrollment file -----------------------------------------------------------------------

def _enrollment_text(users: str, version: int = 1) -> str:
    return f'{{"format": "fedmf-user-enrollment", "version": {version:d}, "users": {{{users}}}}}'


def test_the_enrollment_file_round_trips_and_refuses_what_is_ambiguous(tmp_path):
    keys = [_raw(Ed25519PrivateKey.generate()) for _ in range(2)]
    enrollment = Enrollment({}).with_user("alice", keys[0]).with_user("bob", keys[1])
    path = tmp_path / "enrollment.json"
    enrollment.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert Enrollment.load(path).users == {"alice": keys[0], "bob": keys[1]}
    b64 = json.loads(path.read_text())["users"]
    cases = {
        "a user id or field appears twice": _enrollment_text(f'"alice": "{b64["alice"]}", "alice": "{b64["bob"]}"'),
        "one public key is enrolled for two users": _enrollment_text(f'"alice": "{b64["alice"]}", "bob": "{b64["alice"]}"'),
        "version 2 is not supported": _enrollment_text(f'"alice": "{b64["alice"]}"', version=2),
        "not a base64 Ed25519 public key": _enrollment_text('"alice": "AAAA"'),
        "user #1: the user id is not a printable": _enrollment_text(f'"a\\nb": "{b64["alice"]}"'),
        "not JSON": "{",
        "not a fedmf enrollment file": "[]",
    }
    for match, text in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=match) as e:
            Enrollment.load(path)
        assert "\n" not in str(e.value)
    enrollment.save(path)
    path.chmod(0o664)
    with pytest.raises(ConfigError, match="writable by group or others"):
        Enrollment.load(path)
    with pytest.raises(ConfigError, match="already enrolled"):
        enrollment.with_user("alice", _raw(Ed25519PrivateKey.generate()))
    with pytest.raises(ConfigError, match="public key is already enrolled"):
        enrollment.with_user("carol", keys[0])
    with pytest.raises(ConfigError, match="not enrolled"):
        enrollment.with_user("carol", keys[0], replace=True)
    with pytest.raises(ConfigError, match="not enrolled"):
        enrollment.without_user("carol")


def test_user_cli_keygen_enroll_rotate_revoke_list(tmp_path, capsys):
    f = str(tmp_path / "enrollment.json")
    for name in ("alice", "bob", "alice2"):
        assert fedmf_main(["user", "keygen", "--out", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    assert "PRIVATE KEY" not in out and (tmp_path / "alice").read_text().splitlines()[1] not in out
    assert fedmf_main(["user", "enroll", "--enrollment", f, "--user", "alice", "--public-key",
                       str(tmp_path / "alice.pub")]) == 0
    assert fedmf_main(["user", "enroll", "--enrollment", f, "--user", "bob", "--public-key",
                       str(tmp_path / "bob.pub")]) == 0
    assert fedmf_main(["user", "rotate", "--enrollment", f, "--user", "alice", "--public-key",
                       str(tmp_path / "alice2.pub")]) == 0
    assert Enrollment.load(f).users == {"alice": read_public_key(tmp_path / "alice2.pub"),
                                        "bob": read_public_key(tmp_path / "bob.pub")}
    assert fedmf_main(["user", "revoke", "--enrollment", f, "--user", "bob"]) == 0
    capsys.readouterr()
    assert fedmf_main(["user", "list", "--enrollment", f]) == 0
    assert capsys.readouterr().out.split("\t")[0] == "alice"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.parametrize("argv, match", [
    (["user", "enroll", "--enrollment", "{d}/e.json", "--user", "a\nb", "--public-key", "{d}/k.pub"], "printable"),
    (["user", "enroll", "--enrollment", "{d}/e.json", "--user", "x", "--public-key", "{d}/missing.pub"], "missing.pub"),
    (["user", "enroll", "--enrollment", "{d}/e.json", "--user", "x", "--public-key", "{d}/k"], "not a base64"),
    (["user", "enroll", "--enrollment", "{d}/e.json", "--user", "old", "--public-key", "{d}/k.pub"], "already enrolled"),
    (["user", "rotate", "--enrollment", "{d}/e.json", "--user", "nobody", "--public-key", "{d}/k.pub"], "not enrolled"),
    (["user", "revoke", "--enrollment", "{d}/e.json", "--user", "nobody"], "not enrolled"),
    (["user", "revoke", "--enrollment", "{d}/none.json", "--user", "old"], "No such file"),
    (["user", "keygen", "--out", "{d}/k"], "refusing to overwrite"),
    (["user", "list"], "required"),
    (["user", "frobnicate"], "invalid choice"),
])
def test_user_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, match):
    generate_key_pair(tmp_path / "k")
    generate_key_pair(tmp_path / "old")
    Enrollment({"old": read_public_key(tmp_path / "old.pub")}).save(tmp_path / "e.json")
    before = (tmp_path / "e.json").read_bytes()
    capsys.readouterr()
    assert fedmf_main([a.replace("{d}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedmf: error: ") and err.count("\n") == 1 and match in err, err
    assert (tmp_path / "e.json").read_bytes() == before  # nothing changed


# ---- public keys that are not keys ----------------------------------------------------------------
# An independent Edwards25519 (RFC 8032 section 5.1) in extended coordinates, to find the small-order
# points from the curve itself: [L]·Q for points Q lies in the subgroup of order dividing 8.
_P = 2 ** 255 - 19
_D = -121665 * pow(121666, -1, _P) % _P
_L = 2 ** 252 + 27742317777372353535851937790883648493
_IDENTITY = (0, 1, 1, 0)


def _add(a, b):
    (x1, y1, z1, t1), (x2, y2, z2, t2) = a, b  # RFC 8032 section 5.1.4 (a = -1)
    pa, pb = (y1 - x1) * (y2 - x2) % _P, (y1 + x1) * (y2 + x2) % _P
    c, dd = 2 * t1 * t2 * _D % _P, 2 * z1 * z2 % _P
    e, f, g, h = pb - pa, dd - c, dd + c, pb + pa
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def _times(k, point):
    result = _IDENTITY
    while k:
        if k & 1:
            result = _add(result, point)
        point, k = _add(point, point), k >> 1
    return result


def _affine(point):
    x, y, z, _ = point
    inverse = pow(z, -1, _P)
    return x * inverse % _P, y * inverse % _P


def _on_curve_x(y):
    """An x with (x, y) on the curve, or None (brute-force check of the curve equation)."""
    x2 = (y * y - 1) * pow(_D * y * y + 1, -1, _P) % _P
    x = pow(x2, (_P + 3) // 8, _P)
    if x * x % _P != x2:
        x = x * pow(2, (_P - 1) // 4, _P) % _P
    return x if x * x % _P == x2 else None


def _small_order_points():
    points, y = set(), 2
    while len(points) < 8:
        x = _on_curve_x(y)
        if x is not None:
            points.add(_affine(_times(_L, (x, y, 1, x * y % _P))))
        y += 1
    assert all(_affine(_times(8, (x, y, 1, x * y % _P))) == (0, 1) for x, y in points)
    return points


def _encodings(x, y):
    """Every 32-byte string that decodes to (x, y) in a lenient decoder: y or y + p, either sign bit for x = 0."""
    ys = [y] + ([y + _P] if y + _P < 2 ** 255 else [])
    signs = [0, 1] if x == 0 else [x & 1]
    return {(v | (s << 255)).to_bytes(32, "little") for v in ys for s in signs}


def test_small_order_and_non_canonical_public_keys_are_refused_everywhere(tmp_path, capsys):
    import base64

    from fedmf.enrollment import check_public_key

    points = _small_order_points()
    bad = set().union(*(_encodings(x, y) for x, y in points))
    assert len(points) == 8 and len(bad) >= 14 and bytes([1]) + bytes(31) in bad  # the identity's encoding
    for raw in sorted(bad):
        assert check_public_key(raw) is not None, raw.hex()
        assert not verify_proof(raw, bytes([1]) + bytes(63), RUN, 1, 2, new_challenge(), "bob")  # R = identity, S = 0
        with pytest.raises(ConfigError):
            Enrollment({"bob": raw})
    # a non-canonical encoding (y + p) of a point of large order: refused too, its canonical encoding accepted
    y = next(v for v in range(2, 19) if _on_curve_x(v) is not None and (_on_curve_x(v), v) not in points)
    x = _on_curve_x(y)
    canonical = (y | ((x & 1) << 255)).to_bytes(32, "little")
    other = ((y + _P) | ((x & 1) << 255)).to_bytes(32, "little")
    assert check_public_key(canonical) is None and "canonical" in check_public_key(other)
    for _ in range(20):
        assert check_public_key(_raw(Ed25519PrivateKey.generate())) is None
    # the enrollment file and the CLI (enroll and rotate): one line, exit 2, nothing written
    good = generate_key_pair(tmp_path / "alice.key")
    path = tmp_path / "e.json"
    Enrollment({"alice": good}).save(path)
    before = path.read_bytes()
    for raw in sorted(bad) + [other]:
        text = base64.b64encode(raw).decode()
        (tmp_path / "bad.pub").write_text(text + "\n")
        for argv in (["enroll", "--user", "bob"], ["rotate", "--user", "alice"]):
            capsys.readouterr()
            argv += ["--enrollment", str(path), "--public-key", str(tmp_path / "bad.pub")]
            assert fedmf_main(["user", *argv]) == 2
            err = capsys.readouterr().err
            assert err.startswith("fedmf: error: ") and err.count("\n") == 1 and "Ed25519" in err, err
        assert path.read_bytes() == before
        (tmp_path / "hand.json").write_text(_enrollment_text(f'"alice": "{text}"'))
        (tmp_path / "hand.json").chmod(0o644)
        with pytest.raises(ConfigError, match="user #1: .*Ed25519") as e:
            Enrollment.load(tmp_path / "hand.json")
        assert "\n" not in str(e.value) and "alice" not in str(e.value)


def test_the_enrollment_file_must_be_a_regular_file_of_this_user_in_a_safe_directory(tmp_path):
    import threading

    good = generate_key_pair(tmp_path / "k")
    directory = tmp_path / "d"
    directory.mkdir(mode=0o755)
    path = directory / "e.json"
    Enrollment({"alice": good}).save(path)
    assert Enrollment.load(path).users == {"alice": good}
    (directory / "link.json").symlink_to(path)
    with pytest.raises(ConfigError, match="symbolic link"):
        Enrollment.load(directory / "link.json")
    for mode in (0o777, 0o775):
        directory.chmod(mode)
        with pytest.raises(ConfigError, match="directory writable by group or others"):
            Enrollment.load(path)
    directory.chmod(0o1777)  # sticky, like /tmp: others cannot replace our file
    assert Enrollment.load(path).users == {"alice": good}
    directory.chmod(0o755)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, 65534, -1)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            Enrollment.load(path)
        os.chown(path, 0, -1)
    # a FIFO neither blocks the enrollment's nor the private key's loader
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    errors: list[str] = []

    def load_both():
        for load in (Enrollment.load, load_private_key):
            try:
                load(fifo)
            except ConfigError as e:
                errors.append(str(e))

    worker = threading.Thread(target=load_both, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # unblock it, then fail
    assert not worker.is_alive() and len(errors) == 2 and all("not a regular file" in e for e in errors), errors


# ---- the ClientApp's answer ----------------------------------------------------------------------

def _query(run=RUN, round_=2, challenge=None) -> Message:
    from tests.flower.test_client import _message

    config = {"request": "identity", "run": run, "round": round_, "challenge": challenge or new_challenge()}
    return _message(RecordDict({"config": ConfigRecord(config)}), "query")


def test_the_clientapp_signs_the_challenge_for_its_own_node(tmp_path):
    from tests.flower.test_client import _context

    public = generate_key_pair(tmp_path / "k")
    message = _query()
    challenge = message.content.config_records["config"]["challenge"]
    reply = client_app(message, _context(**{"user-id": "alice", "user-key": str(tmp_path / "k")}))
    record = reply.content.config_records["identity"]
    assert record["user-id"] == "alice"
    assert verify_proof(public, record["signature"], RUN, 2, 7, challenge, "alice")  # node 7: the context's id
    # no key: the user id alone; a readable key or a malformed challenge: an error reply, never the key
    reply = client_app(_query(), _context(**{"user-id": "alice"}))
    assert dict(reply.content.config_records["identity"]) == {"user-id": "alice"}
    (tmp_path / "k").chmod(0o644)
    reply = client_app(_query(), _context(**{"user-id": "alice", "user-key": str(tmp_path / "k")}))
    assert reply.has_error() and reply.error.code == ERROR_CODE and "group or others" in reply.error.reason
    (tmp_path / "k").chmod(0o600)
    reply = client_app(_query(challenge=b"short"), _context(**{"user-id": "alice", "user-key": str(tmp_path / "k")}))
    assert reply.has_error() and "challenge" in reply.error.reason


# ---- the server's directory ----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingGrid(LocalGrid):
    """A LocalGrid that records each identity exchange: (nodes asked, timeout)."""

    def __init__(self, nodes) -> None:
        super().__init__(nodes)
        self.exchanges: list[tuple[list[int], float | None]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.exchanges.append((sorted(int(m.metadata.dst_node_id) for m in messages), timeout))
        return super().send_and_receive(messages, timeout=timeout)


@pytest.fixture
def enrolled(tmp_path):
    """Keys for alice, bob and mallory (mallory enrolled too), and an EnrollmentFile of them."""
    keys = {u: tmp_path / f"{u}.key" for u in ("alice", "bob", "mallory", "stranger")}
    publics = {u: generate_key_pair(p) for u, p in keys.items()}
    path = tmp_path / "enrollment.json"
    Enrollment({u: publics[u] for u in ("alice", "bob", "mallory")}).save(path)
    return keys, path


def _node(node_id: int, user: str, key: Path | None = None, *, context_node: int | None = None):
    config = {"user-id": user} | ({"user-key": str(key)} if key else {})
    return client_node(client_app, config, node_id if context_node is None else context_node)


def _directory(path, clock=None, population=("alice", "bob", "mallory", "stranger")) -> NodeDirectory:
    policy = IdentityPolicy("enrolled", EnrollmentFile(path), frozenset(population))
    return NodeDirectory(policy, run=RUN, timeout=10.0, clock=clock or Clock())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_impostors_are_refused_and_never_block_the_real_user(enrolled, caplog):
    keys, path = enrolled
    nodes = {
        1: _node(1, "alice", keys["alice"]),                      # the real alice
        2: _node(2, "alice"),                                     # declares alice, no key
        3: _node(3, "alice", keys["mallory"]),                    # declares alice, signs with mallory's key
        4: _node(4, "alice", keys["alice"], context_node=1),      # relays a signature alice made for node 1
        5: _node(5, "stranger", keys["stranger"]),                # valid signature, not enrolled
        6: _node(6, "outsider", keys["bob"]),                     # not in the task's population
        7: lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": "bob", "signature": "x"})}), reply_to=m),
        8: _node(8, "bob", keys["bob"]),
    }
    grid = CountingGrid(nodes)
    clock = Clock()
    directory = _directory(path, clock)
    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        for t in range(5):
            assert directory.refresh(grid, t) == {"alice": 1, "bob": 8}
            clock.now += 45.0
        assert grid.exchanges[0] == ([1, 2, 3, 4, 5, 6, 7, 8], 10.0)
    warnings = _warnings(caplog)
    assert len(warnings) == 6 and {int(w.split()[2]) for w in warnings} == {2, 3, 4, 5, 6, 7}, warnings
    reasons = " ".join(warnings)
    for reason in ("no valid proof", "not enrolled", "outside the task's population"):
        assert reason in reasons
    assert "stranger" not in reasons and "outsider" not in reasons  # unverified ids are not logged


def test_revoking_or_rotating_a_key_ends_its_proofs_and_enrolling_lets_a_user_in(enrolled, caplog):
    keys, path = enrolled
    grid = LocalGrid({1: _node(1, "alice", keys["alice"]), 2: _node(2, "bob", keys["bob"]),
                      3: _node(3, "stranger", keys["stranger"])})
    clock = Clock()
    directory = _directory(path, clock)
    assert directory.refresh(grid, 0) == {"alice": 1, "bob": 2}
    e = Enrollment.load(path)
    e.without_user("bob").with_user("stranger", read_public_key(f"{keys['stranger']}.pub")).save(path)
    assert directory.refresh(grid, 1) == {"alice": 1, "stranger": 3}  # at once, not after the backoff
    generate_key_pair(path.parent / "alice-new.key")
    Enrollment.load(path).with_user("alice", read_public_key(path.parent / "alice-new.key.pub"), replace=True).save(path)
    assert directory.refresh(grid, 2) == {"stranger": 3}  # the node still signs with the old key
    grid.nodes[1] = _node(1, "alice", path.parent / "alice-new.key")
    clock.now += 30.0
    assert directory.refresh(grid, 3) == {"alice": 1, "stranger": 3}
    path.write_text("{broken")
    with caplog.at_level(logging.ERROR, logger="fedmf.server"):
        assert directory.refresh(grid, 4) == {"alice": 1, "stranger": 3}  # the last good enrollment stays
    assert any("does not load" in m for m in _warnings(caplog))


def test_a_user_proven_on_two_live_nodes_is_selected_on_the_newest_proof_logged_once(enrolled, caplog):
    keys, path = enrolled
    grid = LocalGrid({10: _node(10, "alice", keys["alice"])})
    directory = _directory(path)
    directory.label = lambda user: "label-" + {"alice": "a1"}[user]
    assert directory.refresh(grid, 0) == {"alice": 10}
    grid.nodes[5] = _node(5, "alice", keys["alice"])  # a lower node id, proven later
    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        for t in range(1, 4):
            assert directory.refresh(grid, t) == {"alice": 5}
    assert _warnings(caplog) == ["fedmf: user label-a1 is proven on live nodes 5, 10; only node 5 (the most "
                                 "recent proof) is selectable"]
    del grid.nodes[5]
    assert directory.refresh(grid, 4) == {"alice": 10}


def test_a_silent_or_failing_node_is_asked_again_after_a_growing_backoff(enrolled):
    keys, path = enrolled
    answers = {"flaky": 0}
    real = _node(2, "bob", keys["bob"])

    def flaky(message):  # fails twice (an error reply, then silence), then answers
        answers["flaky"] += 1
        if answers["flaky"] == 1:
            return Message(RecordDict({"identity": ConfigRecord({"user-id": 3})}), reply_to=message)
        return None if answers["flaky"] == 2 else real(message)

    grid = CountingGrid({1: lambda m: None, 2: flaky, 3: _node(3, "alice", keys["alice"])})
    clock = Clock()
    directory = _directory(path, clock, population=("alice", "bob"))
    asked: list[tuple[float, list[int]]] = []
    start = clock.now
    while clock.now - start <= 4000:
        before = len(grid.exchanges)
        reachable = directory.refresh(grid, 0)
        if len(grid.exchanges) > before:
            asked.append((clock.now - start, grid.exchanges[-1][0]))
            assert grid.exchanges[-1][1] == 10.0  # the identity timeout, never reply-timeout
        clock.now += 5.0
    # the silent node 1: after each failure with backoff b (30, 60, ..., capped at 960 s), at the first
    # multiple of b that is at least b later: at least b and less than 2 b after the failure
    times_1 = [t for t, nodes in asked if 1 in nodes]
    gaps = [b - a for a, b in zip(times_1, times_1[1:])]
    backoffs = [30.0, 60.0, 120.0, 240.0, 480.0] + [960.0] * (len(gaps) - 5)
    assert all(b <= g < 2 * b and t % b == 0 for g, b, t in zip(gaps, backoffs, times_1[1:])), gaps
    # the flaky node: failed at 0 and 30, identified at 120 (the first multiple of 60 at least 60 after 30)
    assert [t for t, nodes in asked if 2 in nodes] == [0.0, 30.0, 120.0]
    assert [t for t, nodes in asked if 3 in nodes] == [0.0]
    assert reachable == {"alice": 3, "bob": 2}
    # a silent node costs one identity timeout per backoff period: 9 exchanges in 4000 s, not one per refresh
    assert times_1 == [0.0, 30.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 2880.0, 3840.0]
    assert len(grid.exchanges) == 9


def _broken_content(message: Message) -> Message:
    reply = Message(RecordDict({"identity": ConfigRecord({"user-id": "bob"})}), reply_to=message)
    reply.__dict__["_content"] = {"identity": {"user-id": "bob"}}  # not a RecordDict
    return reply


def test_a_silent_node_that_reconnects_stays_backed_off(enrolled):
    keys, path = enrolled
    grid = CountingGrid({1: lambda m: None, 3: _node(3, "alice", keys["alice"])})
    clock = Clock()
    directory = _directory(path, clock)
    assert directory.refresh(grid, 0) == {"alice": 3}
    silent = grid.nodes.pop(1)
    clock.now += 10.0
    directory.refresh(grid, 0)
    grid.nodes[1] = silent  # back before its 30 s are up: not asked
    clock.now += 10.0
    directory.refresh(grid, 0)
    assert [nodes for nodes, _ in grid.exchanges] == [[1, 3]]
    clock.now += 10.0
    directory.refresh(grid, 0)
    assert [nodes for nodes, _ in grid.exchanges] == [[1, 3], [1]]


def test_many_silent_nodes_cost_one_identity_timeout_per_backoff_step(enrolled):
    """Silent nodes joining at different times are retried together: at most one exchange (one
    identity timeout) per 30 s step, however many there are."""
    keys, path = enrolled
    grid = CountingGrid({3: _node(3, "alice", keys["alice"])})
    clock = Clock()
    directory = _directory(path, clock)
    start = clock.now
    when: list[float] = []
    for step in range(1200):  # 1 s per refresh (what the strategy's wait does); a new silent node every 7 s
        if step % 7 == 0 and step < 300:
            grid.nodes[100 + step] = lambda m: None
        before = len(grid.exchanges)
        directory.refresh(grid, 0)
        if len(grid.exchanges) > before:
            when.append(clock.now - start)
        clock.now += 1.0
    retries = [t for t in when if t >= 300]  # no new node after 300 s: only retries
    assert retries and all(t % 30 == 0 for t in retries), retries
    assert len(set(retries)) == len(retries) <= (1200 - 300) / 30


class WaitingGrid(CountingGrid):
    """An exchange that includes a node that never answers takes the whole timeout on the fake clock
    (what Flower's send_and_receive does); ``paid`` lists the clock times at which such exchanges began."""

    def __init__(self, nodes, clock: Clock) -> None:
        super().__init__(nodes)
        self.clock, self.silent, self.paid = clock, set(), []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if any(int(m.metadata.dst_node_id) in self.silent for m in messages):
            self.paid.append(self.clock.now)
            self.clock.now += timeout
        return replies


def _run_rounds(enrolled, schedule, *, hours: float = 4.0, round_s: float = 5.0, timeout_s: float = 30.0):
    """Rounds every ``round_s`` on the fake clock; ``schedule(step, seconds since the start, grid)``
    changes the nodes before each."""
    keys, path = enrolled
    clock = Clock()
    grid = WaitingGrid({3: _node(3, "alice", keys["alice"])}, clock)
    policy = IdentityPolicy("enrolled", EnrollmentFile(path), frozenset({"alice"}))
    directory = NodeDirectory(policy, run=RUN, timeout=timeout_s, clock=clock)
    start, step = clock.now, 0
    while clock.now - start < hours * 3600:
        schedule(step, clock.now - start, grid)
        assert directory.refresh(grid, step) == {"alice": 3}
        clock.now += round_s
        step += 1
    return grid, start, step


def test_a_node_that_keeps_disconnecting_keeps_its_backoff_and_is_logged_once(enrolled, caplog):
    def flapping(step, _, grid):  # online for one round, then offline for 40 s, again and again; never answers
        grid.silent.add(9)
        if step % 9 == 0:
            grid.nodes[9] = lambda m: None
        else:
            grid.nodes.pop(9, None)

    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        grid, start, _ = _run_rounds(enrolled, flapping)
    asked = [t - start for t in grid.paid]
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    backoffs = [30.0, 60.0, 120.0, 240.0, 480.0] + [960.0] * len(gaps)
    assert gaps and all(g >= b for g, b in zip(gaps, backoffs)), gaps  # one timeout per backoff period at most
    assert len(asked) <= 6 + 4 * 3600 / 960
    assert [w for w in _warnings(caplog) if "not identified" in w] == [
        "fedmf: node 9 not identified (no identity reply within 30 s); not selectable, asked again after a backoff"]


def test_gone_nodes_are_remembered_for_16_min_away_and_at_most_max_gone_remembered(enrolled, monkeypatch):
    keys, path = enrolled
    monkeypatch.setattr(identity_module, "MAX_GONE_REMEMBERED", 2)
    clock = Clock()
    grid = CountingGrid({n: (lambda m: None) for n in (1, 2, 3, 4)} | {9: _node(9, "alice", keys["alice"])})
    directory = _directory(path, clock)
    directory.refresh(grid, 0)
    for node in (1, 2, 3):  # leave 1, 2 and 3, one refresh apart: 1, the longest gone, is forgotten
        del grid.nodes[node]
        clock.now += 1.0
        directory.refresh(grid, 0)
    assert set(directory._retry) == {2, 3, 4}
    clock.now += 960.0 - 1.0  # 2 has been gone for 16 min now, 3 not quite
    directory.refresh(grid, 0)
    assert set(directory._retry) == {3, 4} and directory._reported == {3, 4}


def test_64_silent_nodes_cost_at_most_one_timeout_per_step_and_one_per_16_min_once_backed_off(enrolled):
    """The design's bound: every timed-out exchange starts in its own 30 s step; a node at backoff b is
    asked only at multiples of b, so once all nodes are at the 960 s cap, at most one per 960 s."""
    joined_by = 63 * 37.0

    def joining(step, t, grid):  # 64 silent nodes joining 37 s apart (different backoff phases); every
        for i in range(64):      # 8th one keeps disconnecting (online one round in 9, or 7 for i = 8)
            if t >= i * 37.0:
                grid.silent.add(100 + i)
                if i % 8 and 100 + i not in grid.nodes or i % 8 == 0 and step % (7 if i == 8 else 9) == 0:
                    grid.nodes[100 + i] = lambda m: None
                elif i % 8 == 0:
                    grid.nodes.pop(100 + i, None)

    grid, start, rounds = _run_rounds(enrolled, joining)
    paid = [t - start for t in grid.paid]
    steps = [math.floor(t / 30.0) for t in paid]
    assert len(set(steps)) == len(steps), "two timeouts in one 30 s step"
    capped_from = joined_by + 30 + 60 + 120 + 240 + 480 + 960  # the last node's retries reach the cap by then
    late = [t for t in paid if t >= capped_from]
    assert late and all(t % 960.0 == 0 for t in late), late
    assert len(late) <= (4 * 3600 - capped_from) / 960 + 1
    assert len(paid) <= len(set(steps)) and len(paid) < 0.05 * rounds, (len(paid), rounds)


def test_a_reload_failure_is_reported_every_round_without_user_ids(enrolled, caplog):
    keys, path = enrolled
    grid = LocalGrid({1: _node(1, "alice", keys["alice"])})
    directory = _directory(path)
    assert directory.refresh(grid, 0) == {"alice": 1}
    path.write_text(_enrollment_text('"alice": "AAAA", "secret-bob": "AQ=="'))
    with caplog.at_level(logging.ERROR, logger="fedmf.server"):
        for t in range(1, 4):
            assert directory.refresh(grid, t) == {"alice": 1}
    errors = [m for m in _warnings(caplog) if "does not load" in m]
    assert len(errors) == 3 and all("user #1" in m and "alice" not in m and "secret-bob" not in m for m in errors)
    Enrollment({"alice": read_public_key(f"{keys['alice']}.pub")}).save(path)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="fedmf.server"):
        assert directory.refresh(grid, 4) == {"alice": 1}
    assert not _warnings(caplog)


def test_a_superlink_failure_is_reported_as_such(enrolled, caplog):
    keys, path = enrolled

    class FailingGrid(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            raise ConnectionError("SuperLink gone")

    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        assert _directory(path).refresh(FailingGrid({1: _node(1, "alice", keys["alice"])}), 0) == {}
    assert _warnings(caplog) == [
        "fedmf: the identity exchange with the SuperLink failed (ConnectionError); the 1 nodes asked are asked "
        "again after their backoff",
        "fedmf: node 1 not identified (the identity exchange with the SuperLink failed (ConnectionError)); not "
        "selectable, asked again after a backoff"]


def test_a_reply_to_another_query_is_not_an_answer(enrolled):
    keys, path = enrolled
    real = _node(1, "alice", keys["alice"])

    def misdirected(message):  # a valid proof, but its reply names another message
        reply = real(message)
        reply.metadata.__dict__["_reply_to_message_id"] = "m999"
        return reply

    grid = LocalGrid({1: misdirected, 2: _node(2, "alice", keys["alice"])})
    assert _directory(path).refresh(grid, 0) == {"alice": 2}
    assert grid.sent[0].metadata.message_id and grid.sent[0].metadata.message_id != "m999"


@pytest.mark.parametrize("reply", [
    lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": "bob", "signature": b"\0" * 64})}), reply_to=m),
    lambda m: Message(RecordDict({"identity": ConfigRecord({"user-id": ["bob"]})}), reply_to=m),
    lambda m: Message(RecordDict({"other": ConfigRecord({"user-id": "bob"})}), reply_to=m),
    lambda m: Message(RecordDict({}), reply_to=m),
    lambda m: "not a message",
    lambda m: _broken_content(m),
], ids=["zero-signature", "list-id", "no-record", "empty", "not-a-message", "broken-content"])
def test_nothing_a_node_sends_crashes_the_directory(enrolled, reply):
    keys, path = enrolled
    grid = LocalGrid({1: reply, 2: _node(2, "alice", keys["alice"])})
    assert _directory(path).refresh(grid, 0) == {"alice": 2}


# ---- the policy ------------------------------------------------------------------------------------

class RemoteGrid(LocalGrid):
    """Stands for a deployment's grid (not in-process)."""


def test_a_deployment_needs_enrollment_or_the_explicit_insecure_mode(enrolled, monkeypatch, caplog):
    keys, path = enrolled
    monkeypatch.setattr(identity_module, "_in_process", lambda grid: not isinstance(grid, RemoteGrid))
    base = {"noise-multiplier": 1.0}
    assert identity_policy(LocalGrid({}), ServerConfig.from_mapping(base), ["0"]).mode == "in-process"
    with pytest.raises(ConfigError, match="a deployment needs user-enrollment"):
        identity_policy(RemoteGrid({}), ServerConfig.from_mapping(base), ["0"])
    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        declared = identity_policy(RemoteGrid({}), ServerConfig.from_mapping({**base, "identity": "declared-insecure"}),
                                   ["0", "1"])
    assert declared.mode == "declared-insecure" and declared.population == {"0", "1"}
    assert any("INSECURE" in m for m in _warnings(caplog))
    policy = identity_policy(RemoteGrid({}), ServerConfig.from_mapping({**base, "user-enrollment": str(path)}), None)
    assert policy.mode == "enrolled" and set(policy.enrollment.enrollment.users) == {"alice", "bob", "mallory"}
    for values, match in (({"identity": "trust-me"}, "identity must be"),
                          ({"identity": "declared-insecure", "user-enrollment": str(path)}, "choose one"),
                          ({"identity-timeout": 0}, "identity-timeout")):
        with pytest.raises(ConfigError, match=match):
            ServerConfig.from_mapping({**base, **values})
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by group or others"):
        identity_policy(RemoteGrid({}), ServerConfig.from_mapping({**base, "user-enrollment": str(path)}), None)
    # declared ids outside the population are refused there too
    grid = LocalGrid({1: _node(1, "0"), 2: _node(2, "99")})
    assert NodeDirectory(declared, run=RUN).refresh(grid) == {"0": 1}
