"""``fedmf ledger migrate`` and deploy/postgres-owner.sql: deploy/README.md step 1 without a prompt.

On the real test PostgreSQL: a throwaway owner role and database made by the script (password on
psql's stdin, checked against the stored SCRAM verifier), the schema created by the command as that
role with the password from a 0600 file, the tables owned by the role; on SQLite: creation, an
older schema migrated, a newer one refused. Bad input is one line and exit 2, and the password is
never printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from fedmf.cli import main
from fedmf.ledger.db import _alembic_config, current_revision, head_revision, resolve_url, writer_engine
from tests.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[2]
OWNER_SQL = ROOT / "deploy" / "postgres-owner.sql"


def _password_file(path: Path, password: str, mode: int = 0o600) -> Path:
    path.touch(mode=0o600)
    path.write_text(password + "\n")
    os.chmod(path, mode)
    return path


def _revision(url: str) -> str | None:
    engine = writer_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            return current_revision(conn)
    finally:
        engine.dispose()


def test_sqlite_ledger_is_created_then_current(tmp_path, capsys):
    ledger = tmp_path / "ledger.db"
    assert main(["ledger", "migrate", "--url", str(ledger)]) == 0
    assert f"created at schema version {head_revision()}" in capsys.readouterr().out
    assert _revision(str(ledger)) == head_revision() and (ledger.stat().st_mode & 0o777) == 0o600
    assert main(["ledger", "migrate", "--url", str(ledger)]) == 0
    assert f"schema version {head_revision()}, already current" in capsys.readouterr().out


def test_an_older_sqlite_ledger_is_migrated_and_a_newer_one_refused(tmp_path, capsys):
    from alembic import command

    ledger = tmp_path / "old.db"
    engine = writer_engine(resolve_url(str(ledger)))
    try:
        with engine.begin() as conn:
            command.upgrade(_alembic_config(conn), "0003")
    finally:
        engine.dispose()
    assert main(["ledger", "migrate", "--url", str(ledger)]) == 0
    assert f"migrated from schema version 0003 to {head_revision()}" in capsys.readouterr().out
    assert _revision(str(ledger)) == head_revision()
    engine = writer_engine(resolve_url(str(ledger)))
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE fedmf_ledger_version SET version_num = '9999'"))
    finally:
        engine.dispose()
    assert main(["ledger", "migrate", "--url", str(ledger)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "newer than this fedmf understands" in err


@pytest.mark.parametrize("case", ["mode", "empty", "two-lines", "missing", "sqlite", "both", "bad-url"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    password = "pw-" + uuid.uuid4().hex
    url = "postgresql://fedmf_owner@127.0.0.1:1/fedmf"
    pw = tmp_path / "owner.pw"
    if case == "mode":
        _password_file(pw, password, 0o640)
    elif case == "empty":
        _password_file(pw, "")
    elif case == "two-lines":
        _password_file(pw, password + "\nsecond")
    elif case in ("sqlite", "both", "bad-url"):
        _password_file(pw, password)
    if case == "sqlite":
        url = str(tmp_path / "ledger.db")
    elif case == "both":
        url = f"postgresql://fedmf_owner:{password}@127.0.0.1:1/fedmf"
    elif case == "bad-url":
        url = "mysql://fedmf_owner@127.0.0.1/fedmf"
    assert main(["ledger", "migrate", "--url", url, "--password-file", str(pw)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("fedmf: error: ") and err.count("\n") == 1, err
    assert password not in err
    expected = {"mode": "has mode 640", "empty": "is empty", "two-lines": "on one line", "missing": "cannot be used",
                "sqlite": "only a PostgreSQL ledger", "both": "give it only in the file",
                "bad-url": "unsupported ledger database"}[case]
    assert expected in err, err
    assert not (tmp_path / "ledger.db").exists()


def test_an_unreachable_server_is_one_line_without_the_password(tmp_path, capsys):
    password = "pw-" + uuid.uuid4().hex
    pw = _password_file(tmp_path / "owner.pw", password)
    assert main(["ledger", "migrate", "--url", "postgresql://fedmf_owner@127.0.0.1:1/fedmf",
                 "--password-file", str(pw)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "cannot open ledger" in err and "Connection refused" in err
    assert password not in err and "***" in err


def _psql() -> str:
    psql = shutil.which("psql")
    if psql is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("psql is not installed: deploy/postgres-owner.sql cannot run as documented")
        pytest.skip("psql is not installed")
    return psql


def _run_owner_sql(role: str, database: str, password: str) -> subprocess.CompletedProcess:
    """deploy/postgres-owner.sql as deploy/README.md runs it: psql as the superuser, the password on stdin."""
    admin = make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    argv = [_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", admin, "-v", f"owner_role={role}",
            "-v", f"database={database}", "-f", str(OWNER_SQL)]
    return subprocess.run(argv, input=password + "\n", capture_output=True, text=True, timeout=60)


@pytest.fixture
def owner_db(pg_admin):
    """A unique owner role and database name; both dropped afterwards."""
    suffix = uuid.uuid4().hex[:10]
    names = {"role": f"fedmf_owner_{suffix}", "database": f"fedmf_migrate_{suffix}"}
    yield names
    with pg_admin.connect() as conn:
        conn.execute(text("SET lock_timeout = '20s'"))
        conn.execute(text(f'DROP DATABASE IF EXISTS "{names["database"]}" WITH (FORCE)'))
        conn.execute(text(f'DROP ROLE IF EXISTS "{names["role"]}"'))


def test_owner_role_and_database_then_migrate_as_the_owner_on_postgresql(owner_db, pg_admin, tmp_path, capsys):
    from tests.flower.test_deploy import scram_matches

    role, database = owner_db["role"], owner_db["database"]
    password = "own-" + uuid.uuid4().hex
    done = _run_owner_sql(role, database, password)
    assert done.returncode == 0, done.stderr
    with pg_admin.connect() as conn:
        verifier = conn.execute(text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"), {"r": role}).scalar()
        owner = conn.execute(text("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = :d"),
                             {"d": database}).scalar()
        super_, createrole = conn.execute(text("SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = :r"),
                                          {"r": role}).one()
    assert scram_matches(verifier, password) and owner == role and not super_ and not createrole

    base = make_url(PG_URL).set(drivername="postgresql", username=role, password=None, database=database)
    url = base.render_as_string(hide_password=False)
    pw = _password_file(tmp_path / "owner.pw", password)
    assert main(["ledger", "migrate", "--url", url, "--password-file", str(pw)]) == 0
    out, err = capsys.readouterr()
    assert f"created at schema version {head_revision()}" in out and password not in out + err
    admin_db = make_url(PG_URL).set(drivername="postgresql+psycopg", database=database)
    assert _revision(admin_db.render_as_string(hide_password=False)) == head_revision()
    from sqlalchemy import create_engine

    engine = create_engine(admin_db)
    try:
        with engine.connect() as conn:
            owners = set(conn.execute(text("SELECT tableowner FROM pg_tables WHERE schemaname = 'public'")).scalars())
    finally:
        engine.dispose()
    assert owners == {role}
    assert main(["ledger", "migrate", "--url", url, "--password-file", str(pw)]) == 0
    assert "already current" in capsys.readouterr().out

    # a rerun of the script rotates the password and keeps the database
    new = "own2-" + uuid.uuid4().hex
    assert _run_owner_sql(role, database, new).returncode == 0
    with pg_admin.connect() as conn:
        verifier = conn.execute(text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"), {"r": role}).scalar()
    assert scram_matches(verifier, new) and not scram_matches(verifier, password)


def test_an_empty_password_on_stdin_creates_nothing(owner_db, pg_admin):
    done = _run_owner_sql(owner_db["role"], owner_db["database"], "")
    assert done.returncode != 0 and "the owner password is missing or empty" in done.stderr
    with pg_admin.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pg_roles WHERE rolname = :r"), {"r": owner_db["role"]}).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM pg_database WHERE datname = :d"),
                            {"d": owner_db["database"]}).scalar() == 0


def test_deploy_readme_step_1_is_the_tested_sequence_and_never_prompts():
    """deploy/README.md step 1's block: the owner role by postgres-owner.sql with the password on stdin,
    the schema by `fedmf ledger migrate --password-file`, then postgres-roles.sql; no interactive
    `--pwprompt`, no Python one-liner, no password on a command line."""
    import re

    text = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
    step = text[text.index("## 1. PostgreSQL"):text.index("## 2.")]
    block = re.search(r"```bash\n(.*?)```", step, flags=re.S).group(1).replace("\\\n", " ")
    assert "--pwprompt" not in block and "python -c" not in block and "createuser" not in block
    owner = next(ln for ln in block.splitlines() if "postgres-owner.sql" in ln)
    assert owner.startswith("sudo cat /etc/fedmf/pg/owner.pw | sudo -u postgres psql ")
    assert set(re.findall(r"-v (\w+)=", owner)) == {"ON_ERROR_STOP", "owner_role", "database"}
    sql = OWNER_SQL.read_text(encoding="utf-8")
    assert set(re.findall(r":[\"']?(\w+)", sql.split("\n\n", 1)[1])) >= {"owner_role", "database", "owner_password"}
    migrate = next(ln for ln in block.splitlines() if "ledger migrate" in ln)
    assert re.search(r"fedmf ledger migrate --url postgresql://fedmf_owner@\S+ +--password-file /etc/fedmf/pg/owner.pw",
                     migrate), migrate
    order = [block.index(s) for s in ("postgres-owner.sql", "ledger migrate", "postgres-roles.sql")]
    assert order == sorted(order)
