"""Helpers shared by the ledger tests (the ledger URL fixtures ``ledger_url``, ``pg_url``
and ``pg_admin`` are in conftest.py)."""

from __future__ import annotations

from sqlalchemy import text

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.mechanisms.io import save

SECRET = b"test-secret-0123456789-abcdefghij"  # 33 bytes; must never reach the ledger
TABLES = ("runs", "rounds", "participations", "update_norms", "round_state", "client_state", "fedmf_ledger_version")


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
        for table in TABLES:
            for row in conn.execute(text(f"SELECT * FROM {table}")):
                for value in row:
                    out.append(bytes(value) if isinstance(value, (bytes, memoryview)) else str(value).encode())
    return b"\x00".join(out)
