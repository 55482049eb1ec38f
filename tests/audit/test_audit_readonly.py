"""`fedmf audit` of a SQLite ledger writes nothing: the directory listing and every file's bytes are the
same before and after any audit (with --verify, of a refused ledger, of a ledger a live server is writing,
of one a killed server left with a -wal and no -shm)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3

import pytest
from sqlalchemy import text

from fedmf import MinSep
from fedmf.audit.replay import audit
from fedmf.cli import main as fedmf_main
from fedmf.ledger import Ledger, LedgerError
from fedmf.ledger.models import VERSION_TABLE
from tests.ledger_helpers import SECRET, mechanism_file


def _snapshot(directory, skip=()):
    """Every file beside the ledger: name -> (SHA-256 of its bytes, mtime_ns)."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.iterdir()) if p.name not in skip}


def _ledger(directory, mech_dir, rounds=3):
    """A WAL-mode ledger with ``rounds`` committed rounds; returns the open Ledger (the caller closes it)."""
    ledger = Ledger.open(str(directory / "l.db"), secret=SECRET)
    run = ledger.create_run(mechanism_file(mech_dir, kind="dp-sgd", rounds=6, schema=MinSep(1, 6)),
                            noise_multiplier=2.0, clip_norm=1.0, delta=1e-6)
    for t in range(rounds):
        run.open_round(t)
        run.record_selection(t, ["a", "b"])
        run.record_contribution(t, "a", 0.5)
        run.commit_round(t, noise_std=4.0)
    return ledger


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "db").mkdir()
    (tmp_path / "mech").mkdir()
    (tmp_path / "out").mkdir()
    return tmp_path / "db", tmp_path / "mech", tmp_path / "out"


def test_audits_of_a_closed_ledger_change_no_byte_and_create_no_file(dirs, capsys):
    db, mech, out = dirs
    _ledger(db, mech).close()
    url = str(db / "l.db")
    assert sorted(p.name for p in db.iterdir()) == ["l.db"]  # the server's close removed -wal and -shm
    before = _snapshot(db)
    assert fedmf_main(["audit", "--ledger", url, "--verify", "--json", "--csv", str(out / "r.csv")]) == 0
    assert json.loads(capsys.readouterr().out)["verify"]["rounds_verified"] == 3
    assert fedmf_main(["audit", "--ledger", f"sqlite:///{url}", "--plot", str(out / "p.png")]) == 0
    assert _snapshot(db) == before


@pytest.mark.parametrize("damage", ["newer schema", "older schema", "not a ledger", "unknown run"])
def test_a_refused_ledger_is_left_as_it_was(dirs, capsys, damage):
    db, mech, out = dirs
    url = str(db / "l.db")
    if damage == "not a ledger":
        con = sqlite3.connect(url)
        con.execute("PRAGMA journal_mode = WAL")
        con.execute("CREATE TABLE runs (x INTEGER)")
        con.commit()
        con.close()
    else:
        ledger = _ledger(db, mech)
        if damage != "unknown run":
            version = "9999" if damage == "newer schema" else "0002"
            with ledger.engine.begin() as conn:
                conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '{version}'"))
        ledger.close()
    assert sorted(p.name for p in db.iterdir()) == ["l.db"]
    # the header's read/write versions 2: WAL mode, where a plain mode=ro reader creates -wal and -shm
    assert (db / "l.db").read_bytes()[18:20] == b"\x02\x02"
    before = _snapshot(db)
    argv = ["audit", "--ledger", url, "--verify", "--csv", str(out / "r.csv")]
    assert fedmf_main(argv + (["--run", "7"] if damage == "unknown run" else [])) == 2
    assert capsys.readouterr().err.startswith("fedmf: error: ")
    assert _snapshot(db) == before and not (out / "r.csv").exists()


def test_a_ledger_a_live_server_is_writing(dirs):
    """The server holds the ledger open with committed rounds still in its -wal: the audit reads them through
    the server's WAL index; the database file and the -wal are unchanged, and no file appears."""
    db, mech, _ = dirs
    ledger = _ledger(db, mech)
    try:
        with ledger.engine.connect() as conn:  # keep a server connection open
            conn.execute(text("SELECT 1")).scalar()
            assert {"l.db-wal", "l.db-shm"} <= {p.name for p in db.iterdir()}
            before = _snapshot(db, skip=("l.db-shm",))  # the shared WAL index: readers take read locks in it
            report = audit(str(db / "l.db"), verify=True)
            assert report.realized["rounds_committed"] == 3 and report.chain.ok
            assert _snapshot(db, skip=("l.db-shm",)) == before
            assert sorted(p.name for p in db.iterdir()) == ["l.db", "l.db-shm", "l.db-wal"]
    finally:
        ledger.close()


def test_a_wal_left_without_its_index_is_read_from_a_private_copy(dirs, tmp_path):
    """A server killed with committed rounds in its -wal, and the -shm gone (e.g. copied without it): SQLite
    would create a -shm beside the ledger to read the -wal; the audit reads a private copy instead."""
    db, mech, _ = dirs
    ledger = _ledger(db, mech)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    try:
        with ledger.engine.connect() as conn:
            conn.execute(text("SELECT 1")).scalar()
            shutil.copyfile(db / "l.db", crashed / "l.db")
            shutil.copyfile(db / "l.db-wal", crashed / "l.db-wal")
    finally:
        ledger.close()
    con = sqlite3.connect(f"file:{crashed / 'l.db'}?mode=ro&immutable=1", uri=True)
    try:
        in_file_alone = con.execute("SELECT count(*) FROM rounds").fetchone()[0]
    except sqlite3.OperationalError:  # not even the tables are in the file yet
        in_file_alone = 0
    con.close()
    assert in_file_alone < 3  # the committed rounds are (partly) only in the -wal
    before = _snapshot(crashed)
    report = audit(str(crashed / "l.db"), verify=True)
    assert report.realized["rounds_committed"] == 3 and report.chain.ok
    assert _snapshot(crashed) == before


def test_an_immutable_read_that_saw_the_file_change_is_read_again(dirs, monkeypatch):
    from fedmf.ledger import db as dbmod

    db, mech, _ = dirs
    _ledger(db, mech).close()
    real = dbmod._file_signature
    calls = []

    def changing(path, always=False):
        calls.append(path)
        sig = real(path)
        return (*sig[:2], sig[2] + len(calls), sig[3]) if (always or len(calls) == 2) else sig

    monkeypatch.setattr(dbmod, "_file_signature", changing)
    assert audit(str(db / "l.db")).realized["rounds_committed"] == 3
    assert len(calls) == 4  # before and after the first read (changed), before and after the second
    monkeypatch.setattr(dbmod, "_file_signature", lambda path: changing(path, always=True))
    with pytest.raises(LedgerError, match="kept changing while it was read"):
        audit(str(db / "l.db"))
