"""Fixtures shared by several test modules (pytest finds them here; never import this file).

Ledger URLs (used by ledger/test_ledger.py, audit/test_audit_values.py, audit/test_audit_cli.py): a fresh
ledger on SQLite and on the real PostgreSQL server (FEDMF_TEST_POSTGRES_URL, default the
local one), each PostgreSQL test in a schema of its own that is dropped afterwards. With
CI=true an unreachable PostgreSQL fails the tests instead of skipping them. Plain helpers
for the ledger tests (SECRET, mechanism_file, dump_database) live in ledger_helpers.py.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

PG_URL = os.environ.get("FEDMF_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """fedmf's on-disk cache (fedmf.accounting.disk_cache) in a directory of this test session, for
    the tests and every process they start, never the user's ~/.cache/fedmf."""
    before = os.environ.get("FEDMF_CACHE_DIR")
    os.environ["FEDMF_CACHE_DIR"] = str(tmp_path_factory.mktemp("fedmf-cache"))
    yield
    if before is None:
        os.environ.pop("FEDMF_CACHE_DIR", None)
    else:
        os.environ["FEDMF_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def pg_admin():
    """An AUTOCOMMIT engine on the test PostgreSQL server (skip, or fail under CI, when unreachable)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    engine = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001 - any failure to connect
        engine.dispose()
        message = f"PostgreSQL not reachable at {make_url(PG_URL).render_as_string(hide_password=True)}: {e}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_url(pg_admin):
    """A URL whose connections work in a fresh, private schema (search_path)."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    schema = f"fedmf_test_{uuid.uuid4().hex[:12]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(PG_URL).set(drivername="postgresql+psycopg").update_query_dict(
        {"options": f"-csearch_path={schema}"}
    )
    yield url.render_as_string(hide_password=False)
    with pg_admin.connect() as conn:
        conn.execute(text("SET lock_timeout = '20s'"))  # never hang on a connection a failed test left
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path):
    """A fresh, empty ledger URL: a SQLite file under tmp_path, then a private PostgreSQL schema."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    return request.getfixturevalue("pg_url")


@pytest.fixture(autouse=True, scope="session")
def _witness_state_home(tmp_path_factory) -> Path:
    """Every run's release witness (fedmf.run.witness) goes under a temporary XDG_STATE_HOME, never the real
    home: in this process and in every process a test starts (they inherit the environment)."""
    saved = os.environ.get("XDG_STATE_HOME")
    home = tmp_path_factory.mktemp("xdg-state")
    os.environ["XDG_STATE_HOME"] = str(home)
    yield home
    if saved is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture(autouse=True)
def _witness_per_test(_witness_state_home, tmp_path_factory, monkeypatch):
    """Each test its own XDG_STATE_HOME: a test that restores copies of a run a fixture made resumes
    each copy against its own witness (within one test, the witness sees every copy, as it would),
    a copy of the witness the fixture's run wrote (under the session's XDG_STATE_HOME) as an operator
    moves one (deploy/README.md, "The release witness")."""
    home = tmp_path_factory.mktemp("xdg-state")
    made = _witness_state_home / "fedmf" / "witness"
    if made.is_dir():
        (home / "fedmf").mkdir(mode=0o700)
        shutil.copytree(made, home / "fedmf" / "witness")  # modes kept: 0700 directory, 0600 files
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
