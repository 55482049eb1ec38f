"""The participation ledger: who took part in which round, durably and atomically.

* ``models``      SQLAlchemy 2 typed ORM models: history (runs, rounds, participations,
                  update_norms; only ever inserted) and mutable state (round_state, client_state)
* ``chain``       the hash chain over the history (its byte encoding) and its verification
* ``migrations``  Alembic migrations, the same for SQLite and PostgreSQL (run by ``db``)
* ``db``          URLs, read-write (SQLite: WAL, writers take the lock up front) and read-only
                  engines (``read_snapshot``: nothing written beside a SQLite file), migrations,
                  the schema-version check
* ``keys``        HMAC-SHA256 pseudonymous client keys under the server secret
* ``repository``  the API the server calls: ``Ledger``, ``RunLedger`` (the plan on the run row,
                  the checkpoint hash and chain hash on the round record)
* ``queries``     the reads: ``RunInfo``, ``RoundSummary``, a run's contributions, the audit's snapshot
* ``budgets``     the storage of lifetime per-user budgets: settings, own budgets, charges, skips
                  (the policy that reads them: ``fedmf.budgets``)

The ledger stores and queries; it imports nothing of ``fedmf.accounting`` (tests/test_layers.py). The
audit that replays a run from it is ``fedmf.audit``.

Names are imported lazily, so ``import fedmf.ledger`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Ledger", "RunLedger", "RunInfo", "RoundSummary", "LedgerError", "ServerSecret", "head_revision",
           "resolve_url"]

_EXPORTS = {
    "Ledger": "repository", "RunLedger": "repository", "RunInfo": "queries", "RoundSummary": "queries",
    "LedgerError": "db", "head_revision": "db", "resolve_url": "db", "ServerSecret": "keys",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
