"""Fixtures shared by the ledger tests: a fresh ledger URL on SQLite and on the real
PostgreSQL server (FEDMF_TEST_POSTGRES_URL, default the local one), each test in a
schema of its own that is dropped afterwards. With CI=true an unreachable PostgreSQL
fails the tests instead of skipping them."""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.mechanisms.io import save

PG_URL = os.environ.get("FEDMF_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SECRET = b"test-secret-0123456789-abcdefghij"  # 33 bytes; must never reach the ledger


@pytest.fixture(scope="session")
def pg_admin():
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
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    return request.getfixturevalue("pg_url")


def mechanism_file(tmp_path, kind="bsr", rounds=24, schema=MinSep(4, 6), **kwargs) -> str:
    """A saved mechanism file planned for ``schema``."""
    mech = build(kind, rounds, schema, Workload(), **kwargs)
    path = tmp_path / f"{kind}-{rounds}.mech.json"
    save(mech, path, schema)
    return str(path)


def dump_database(url: str) -> bytes:
    """Everything stored in the ledger, as bytes (to search for secrets and client ids)."""
    from fedmf.ledger import Ledger

    with Ledger.open(url) as ledger, ledger.engine.connect() as conn:
        out = []
        for table in ("runs", "rounds", "participations", "client_state", "privacy_snapshots", "fedmf_ledger_version"):
            for row in conn.execute(text(f"SELECT * FROM {table}")):
                for value in row:
                    out.append(bytes(value) if isinstance(value, (bytes, memoryview)) else str(value).encode())
    return b"\x00".join(out)
