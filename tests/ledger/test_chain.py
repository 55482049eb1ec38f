"""The ledger's hash chain and `fedmf audit --verify`: every kind of rewritten history is caught and the
first round that does not match is named, on SQLite and on PostgreSQL; the encoding is checked against an
independent re-implementation of its documented byte layout."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from sqlalchemy import text

from fedmf import MinSep
from fedmf.audit.replay import audit
from fedmf.cli import main as fedmf_main
from fedmf.ledger import Ledger
from fedmf.ledger.chain import round_sha256
from tests.ledger_helpers import SECRET, mechanism_file

ROUNDS = 5


def _record(url, tmp_path, diagnostics=False):
    """A run of 8 rounds with 5 committed (rejections, drops, an aborted attempt), round 5 left open."""
    with Ledger.open(url, secret=SECRET) as ledger:
        run = ledger.create_run(mechanism_file(tmp_path, kind="dp-sgd", rounds=8, schema=MinSep(1, 8)),
                                noise_multiplier=2.0, clip_norm=1.0, delta=1e-6, name="chain",
                                config={"lr": 0.5}, diagnostics=diagnostics)
        for t in range(ROUNDS):
            run.open_round(t)
            if t == 2:
                run.record_selection(t, ["x"])
                run.abort_round(t, "lost quorum")
                run.open_round(t)
            run.record_selection(t, ["alice", "bob", "carol"])
            run.record_contribution(t, "alice", 0.5 + t)
            run.record_contribution(t, "bob", 0.25)
            run.record_rejection(t, "mallory", "not selected")
            if t == 1:
                run.record_rejection(t, "eve", "non-finite update")
            run.commit_round(t, noise_std=4.0, epsilon_worst_user=0.1 * t, epsilon_planned=0.2 * t,
                             checkpoint_sha256=hashlib.sha256(f"checkpoint {t}".encode()).hexdigest())
        run.open_round(ROUNDS)
        return run


def _exec(url, *statements):
    """Tamper with the ledger as its owner would (not through the server's API)."""
    with Ledger.open(url) as ledger, ledger.engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


def _key(run, client):
    return run.key(client).hex()


def _blob(url, hexkey):
    return f"X'{hexkey}'" if "://" not in url else f"'\\x{hexkey}'::bytea"


TAMPERING = {
    "deleted participation": (2, lambda url, run: [
        f"DELETE FROM participations WHERE round_index = 2 AND client_key = {_blob(url, _key(run, 'carol'))}"]),
    "participation moved to another round": (1, lambda url, run: [
        f"UPDATE participations SET round_index = 4 WHERE round_index = 1 AND client_key = "
        f"{_blob(url, _key(run, 'eve'))}"]),
    "a participation's status edited": (3, lambda url, run: [
        f"UPDATE participations SET status = 'dropped', reason = 'no update received' WHERE round_index = 3 "
        f"AND client_key = {_blob(url, _key(run, 'alice'))}"]),
    "noise_std edited": (2, lambda url, run: ["UPDATE rounds SET noise_std = 40.0 WHERE round_index = 2"]),
    "recorded epsilon edited": (3, lambda url, run: ["UPDATE rounds SET epsilon_planned = 0.01 WHERE round_index = 3"]),
    "checkpoint hash edited": (1, lambda url, run: [
        f"UPDATE rounds SET checkpoint_sha256 = '{'0' * 64}' WHERE round_index = 1"]),
    "deleted round": (2, lambda url, run: ["DELETE FROM participations WHERE round_index = 2",
                                           "DELETE FROM rounds WHERE round_index = 2"]),
    "deleted last round": (4, lambda url, run: ["DELETE FROM participations WHERE round_index = 4",
                                                "DELETE FROM rounds WHERE round_index = 4"]),
    "forged round appended": (5, lambda url, run: [
        "INSERT INTO rounds (run_id, round_index, status, attempts, selected, contributed, dropped, rejected, "
        f"noise_std, chain_sha256) VALUES (1, 5, 'committed', 1, 1, 1, 0, 0, 4.0, '{'ab' * 32}')",
        f"INSERT INTO participations (run_id, round_index, client_key, status) VALUES "
        f"(1, 5, {_blob(url, _key(run, 'dave'))}, 'contributed')"]),
    "run row edited": (-1, lambda url, run: ["UPDATE runs SET noise_multiplier = 20.0"]),
}


def test_an_untouched_ledger_verifies(ledger_url, tmp_path, capsys):
    _record(ledger_url, tmp_path)
    capsys.readouterr()
    assert fedmf_main(["audit", "--ledger", ledger_url, "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    verify = report["verify"]
    assert verify["ok"] is True and verify["rounds_verified"] == ROUNDS and verify["head_round"] == ROUNDS - 1
    assert verify["head_sha256"] == report["rounds"][ROUNDS - 1]["chain_sha256"]
    assert verify["genesis_sha256"] == report["run"]["genesis_sha256"]
    assert fedmf_main(["audit", "--ledger", ledger_url, "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"hash chain          verified: {ROUNDS} rounds, head round {ROUNDS - 1} {verify['head_sha256']}" in out


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_rewritten_history_is_caught_and_the_first_bad_round_named(ledger_url, tmp_path, capsys, case):
    run = _record(ledger_url, tmp_path)
    first, statements = TAMPERING[case]
    _exec(ledger_url, *statements(ledger_url, run))
    capsys.readouterr()
    assert fedmf_main(["audit", "--ledger", ledger_url, "--verify", "--json"]) == 1, case
    captured = capsys.readouterr()
    verify = json.loads(captured.out)["verify"]
    assert verify["ok"] is False and verify["first_bad_round"] == first, (case, verify)
    where = "the run row (genesis)" if first == -1 else f"round {first}"
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"fedmf: verification failed: {where}: ")
    # without --verify the audit reads the rows as they are (exit 0): only the chain tells
    assert fedmf_main(["audit", "--ledger", ledger_url]) == 0


def test_a_rewritten_mechanism_is_a_verification_failure_not_bad_input(tmp_path, capsys):
    url = str(tmp_path / "l.db")
    _record(url, tmp_path)
    _exec(url, "UPDATE runs SET mechanism_document = replace(mechanism_document, '\"rounds\": 8', '\"rounds\": 9')")
    capsys.readouterr()
    assert fedmf_main(["audit", "--ledger", url, "--verify", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verify"]["first_bad_round"] == -1
    assert "failed its checksum" in captured.err
    assert fedmf_main(["audit", "--ledger", url]) == 2  # without --verify: a ledger that cannot be audited


# ---- the encoding, from its documentation --------------------------------------------------------

def _f(kind, value):
    """deploy/README.md's field encoding, written again from the text."""
    if value is None:
        return b"N"
    if kind == "I":
        return b"I" + int(value).to_bytes(8, "big", signed=True)
    if kind == "F":
        return b"F" + struct.pack(">d", value)
    data = value if isinstance(value, bytes) else value.encode()
    return kind.encode() + len(data).to_bytes(4, "big") + data


def test_the_chain_is_the_documented_encoding(tmp_path):
    url = str(tmp_path / "l.db")
    run = _record(url, tmp_path)
    report = audit(url, verify=True)
    info = run.info
    doc = report.run
    with Ledger.open(url) as ledger, ledger.engine.connect() as conn:
        document = conn.execute(text("SELECT mechanism_document FROM runs")).scalar_one()
        parts = conn.execute(text("SELECT round_index, client_key, status, reason FROM participations "
                                  "ORDER BY round_index, client_key")).all()

    def js(value):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    genesis = hashlib.sha256(b"fedmf-ledger/v1/run\x00" + b"".join([
        _f("S", info.uid), _f("S", "chain"), _f("S", info.code_version), _f("S", js({"lr": 0.5})),
        _f("S", "dp-sgd"), _f("S", info.mechanism_checksum), _f("B", hashlib.sha256(document.encode()).digest()),
        _f("I", 8), _f("F", 2.0), _f("F", 1.0), _f("F", 1e-6), _f("F", None), _f("S", js(doc["schema"])),
        _f("S", info.sampling), _f("S", _key_check()), _f("S", None), _f("S", None), _f("I", 0)])).hexdigest()
    assert genesis == report.chain.genesis_sha256 == doc["genesis_sha256"]
    previous = genesis
    for r in report.rounds[:ROUNDS]:
        t = r["round"]
        rows = sorted((bytes(k), s, why) for i, k, s, why in parts if i == t)
        data = b"".join([_f("B", bytes.fromhex(previous)), _f("I", t), _f("S", "committed"), _f("I", r["attempts"]),
                         _f("I", r["selected"]), _f("I", r["contributed"]), _f("I", r["dropped"]),
                         _f("I", r["rejected"]), _f("F", r["noise_std"]), _f("F", r.get("recorded_epsilon_worst_user")),
                         _f("F", r["recorded_epsilon_planned"]), _f("S", r["checkpoint_sha256"]), _f("I", len(rows))])
        data += b"".join(_f("B", k) + _f("S", s) + _f("S", why) for k, s, why in rows)
        previous = hashlib.sha256(b"fedmf-ledger/v1/round\x00" + data).hexdigest()
        assert previous == r["chain_sha256"], t
    assert report.rounds[2]["attempts"] == 2 and report.rounds[1]["rejected"] == 2


def _key_check() -> str:
    """The run row's key check, as keys.py documents it."""
    import hmac

    return hmac.new(SECRET, b"fedmf-ledger/v1/key-check", hashlib.sha256).hexdigest()


def test_round_hash_depends_on_every_field_and_on_the_order_only_through_keys():
    record = {"round_index": 3, "status": "committed", "attempts": 1, "selected": 2, "contributed": 1, "dropped": 1,
              "rejected": 0, "noise_std": 4.0, "epsilon_worst_user": None, "epsilon_planned": 0.5,
              "checkpoint_sha256": "ab" * 32}
    parts = [(b"\x02" * 32, "contributed", None), (b"\x01" * 32, "dropped", "no update received")]
    base = round_sha256("00" * 32, record, parts)
    assert round_sha256("00" * 32, record, parts[::-1]) == base  # sorted by key
    assert round_sha256("01" + "00" * 31, record, parts) != base
    for name, other in [("round_index", 4), ("attempts", 2), ("selected", 3), ("contributed", 2), ("dropped", 0),
                        ("rejected", 1), ("noise_std", 4.000000000000001), ("epsilon_worst_user", 0.0),
                        ("epsilon_planned", None), ("checkpoint_sha256", None)]:
        assert round_sha256("00" * 32, {**record, name: other}, parts) != base, name
    assert round_sha256("00" * 32, record, parts[:1]) != base
    assert round_sha256("00" * 32, record, [parts[0], (parts[1][0], "dropped", "late")]) != base
    # 1 and 1.0 differ only in Python: a float column is encoded as binary64 either way
    assert round_sha256("00" * 32, {**record, "noise_std": 4}, parts) == base
