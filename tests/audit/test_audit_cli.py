"""`fedmf audit`: outputs, and bad input as one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import struct

import pytest
from sqlalchemy import text

from fedmf import MinSep
from fedmf.cli import main as ledger_main
from fedmf.ledger import Ledger, head_revision
from tests.ledger_helpers import SECRET, TABLES, mechanism_file


def _fedmf_main():
    """fedmf.cli.main, which must have `audit` registered."""
    from fedmf import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert "audit" in sub.choices
    return cli.main


def _ledger(url, tmp_path, rounds=10):
    with Ledger.open(url, secret=SECRET) as ledger:
        run = ledger.create_run(mechanism_file(tmp_path, kind="dp-sgd", rounds=rounds, schema=MinSep(3, 4)),
                                noise_multiplier=10.0, clip_norm=1.0, delta=1e-6, name="cli")
        for t in range(rounds):
            run.open_round(t)
            chosen = run.record_selection(t, ["alice", "bob", "carol"])
            for c in chosen:
                run.record_contribution(t, c, 0.5)
            run.commit_round(t, noise_std=20.0, epsilon_worst_user=0.1, epsilon_planned=0.2)
    return run


def _state(url) -> str:
    """A fingerprint of everything stored in the ledger."""
    with Ledger.open(url) as ledger, ledger.engine.connect() as conn:
        rows = []
        for table in TABLES:
            rows.append(sorted(map(repr, conn.execute(text(f"SELECT * FROM {table}")))))
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def test_audit_json_csv_and_png(ledger_url, tmp_path, capsys):
    _ledger(ledger_url, tmp_path)
    before = _state(ledger_url)
    out_csv, out_png = tmp_path / "rounds.csv", tmp_path / "audit.png"
    assert ledger_main(["audit", "--ledger", ledger_url, "--json", "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert _state(ledger_url) == before
    # three users in rounds 0, 3, 6, 9 (every b = 3 rounds, eligibility enforced): the plan's worst case
    assert report["realized"]["users"] == 3 and report["realized"]["contributions"] == 12
    assert report["realized"]["min_separation"] == 3 and report["realized"]["max_participations"] == 4
    assert report["participation_histogram"] == {"4": 3}
    assert report["flagged_users"] == [] and report["realized"]["flagged_users"] == 0
    assert report["planned"]["epsilon"] == pytest.approx(0.396857, abs=1e-4)  # z = 10, reference value
    assert report["rounds"][-1]["epsilon_worst_user"] == pytest.approx(0.396857, abs=1e-4)
    assert report["run"]["name"] == "cli" and report["csv"] == str(out_csv)
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == list(range(10))
    for row, rec in zip(rows, report["rounds"]):
        assert float(row["epsilon_worst_user"]) == rec["epsilon_worst_user"]
        assert float(row["epsilon_planned"]) == rec["epsilon_planned"]
        assert int(row["contributed"]) == rec["contributed"]
        assert float(row["recorded_epsilon_planned"]) == 0.2
    assert [int(r["contributed"]) for r in rows] == [3, 0, 0, 3, 0, 0, 3, 0, 0, 3]
    assert [int(r["rejected"]) for r in rows] == [0, 3, 3, 0, 3, 3, 0, 3, 3, 0]
    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1210, 462)  # 11 x 4.2 inches at 110 dpi


def test_audit_text_output(tmp_path, capsys):
    url = str(tmp_path / "l.db")
    _ledger(url, tmp_path)
    assert ledger_main(["audit", "--ledger", url, "--run", "1"]) == 0
    out = capsys.readouterr().out
    assert "min separation 3, max participations 4" in out
    assert "flagged users       0" in out and "participations      4: 3" in out
    assert "ε spent             worst user 0.3968" in out
    for secret in (SECRET.decode(), "alice", "bob"):
        assert secret not in out


def _bad(argv, capsys):
    code = ledger_main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("fedmf: error: ")
    return err


@pytest.mark.parametrize("url, message", [
    ("postgresql://postgres:pw@127.0.0.1:1/test", "cannot read ledger postgresql+psycopg://postgres:***@127.0.0.1:1/test"),
    ("mysql://root@localhost/db", "unsupported ledger database 'mysql'"),
    ("://", "not a database URL"),
    ("sqlite://", "in-memory SQLite database holds no ledger"),
])
def test_unreachable_or_wrong_urls(url, message, tmp_path, capsys):
    out_csv, out_png = tmp_path / "x.csv", tmp_path / "x.png"
    err = _bad(["audit", "--ledger", url, "--csv", str(out_csv), "--plot", str(out_png)], capsys)
    assert message in err and "pw@" not in err
    assert not out_csv.exists() and not out_png.exists()


def test_a_missing_sqlite_file_is_not_created(tmp_path, capsys):
    path = tmp_path / "missing.db"
    err = _bad(["audit", "--ledger", str(path)], capsys)
    assert f"no ledger at '{path}': file not found" in err
    assert not path.exists()
    err = _bad(["audit", "--ledger", f"sqlite:///{path}"], capsys)
    assert not path.exists() and "file not found" in err


def test_a_database_without_a_ledger(pg_url, tmp_path, capsys):
    err = _bad(["audit", "--ledger", pg_url], capsys)
    assert "holds no fedmf ledger (empty database)" in err
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    assert "file is not a database" in _bad(["audit", "--ledger", str(garbage)], capsys)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    assert "holds no fedmf ledger" in _bad(["audit", "--ledger", str(empty)], capsys)
    assert empty.read_bytes() == b""


def test_newer_schema_unknown_run_and_bad_outputs_write_nothing(ledger_url, tmp_path, capsys):
    _ledger(ledger_url, tmp_path, rounds=6)
    out_csv, out_png = tmp_path / "x.csv", tmp_path / "x.png"
    outputs = ["--csv", str(out_csv), "--plot", str(out_png)]
    err = _bad(["audit", "--ledger", ledger_url, "--run", "42", *outputs], capsys)
    assert "no run with id 42" in err
    assert "a run id is a positive integer" in _bad(["audit", "--ledger", ledger_url, "--run", "0"], capsys)
    assert "must end in .png" in _bad(["audit", "--ledger", ledger_url, "--plot", str(tmp_path / "x.jpg")], capsys)
    err = _bad(["audit", "--ledger", ledger_url, "--csv", str(tmp_path / "no" / "x.csv")], capsys)
    assert "--csv: directory" in err and "does not exist" in err
    with Ledger.open(ledger_url) as ledger, ledger.engine.begin() as conn:
        conn.execute(text("UPDATE fedmf_ledger_version SET version_num = '9999'"))
    before = _file_or_state(ledger_url)
    err = _bad(["audit", "--ledger", ledger_url, *outputs], capsys)
    assert f"has schema version 9999, newer than this fedmf understands ({head_revision()})" in err
    assert not out_csv.exists() and not out_png.exists()
    assert _file_or_state(ledger_url) == before
    assert "the following arguments are required: --ledger" in _bad(["audit"], capsys)


def _file_or_state(url):
    if "://" not in url:
        return hashlib.sha256(open(url, "rb").read()).hexdigest(), os.stat(url).st_mtime_ns
    from sqlalchemy import create_engine

    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        state = [sorted(map(repr, conn.execute(text(f"SELECT * FROM {t}"))))
                 for t in TABLES]
    engine.dispose()
    return state


# ---- the audit registered among fedmf's other commands ---------------------------------------

def test_fedmf_main_audit(tmp_path, capsys):
    main = _fedmf_main()
    url = str(tmp_path / "l.db")
    _ledger(url, tmp_path)
    assert main(["audit", "--ledger", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["realized"]["max_participations"] == 4 and report["flagged_users"] == []
    assert main(["audit", "--ledger", url, "--run", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fedmf: error: no run with id 9" in err
    assert main(["audit", "--ledger", str(tmp_path / "nope.db")]) == 2
    assert "file not found" in capsys.readouterr().err and not (tmp_path / "nope.db").exists()
    assert main(["audit", "--ledger", "postgresql://postgres@127.0.0.1:1/test"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fedmf: error: cannot read ledger postgresql+psycopg://postgres@127.0.0.1:1/test" in err
