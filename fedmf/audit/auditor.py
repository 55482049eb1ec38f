"""The audit command a finished run suggests: ``fedmf audit`` as the AUDITOR would run it.

The server writes the ledger with its own role; an auditor reads it with theirs. So the suggested
command never carries the server's identity or any password:

* SQLite: the ledger file's path (``fedmf audit`` opens it read-only);
* PostgreSQL (any server URL): the server's URL without any password, keeping only the query values
  that say where to connect (``host``, ``port``, ``options``, ``sslmode``, ...), with the user
  replaced by :data:`AUDITOR_ROLE`, the read-only role that ``deploy/postgres-roles.sql`` creates as
  documented in deploy/README.md. The auditor's password comes from their own ``~/.pgpass``
  or ``PGPASSWORD``; an operator whose auditor role has another name substitutes it.
"""

from __future__ import annotations

import os
import shlex

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from ..ledger.db import public_url

__all__ = ["AUDITOR_ROLE", "auditor_ledger", "audit_command"]

#: the auditor's PostgreSQL role in the documented deployment (deploy/README.md)
AUDITOR_ROLE = "fedmf_auditor"
#: libpq query parameters kept in the auditor's URL: where and how to connect (the rest — passwords,
#: the server's client certificate and key — is the server's and is dropped)
_WHERE_KEYS = frozenset({"host", "port", "options", "sslmode", "sslrootcert", "connect_timeout",
                         "target_session_attrs"})


def auditor_ledger(ledger: str | os.PathLike) -> str:
    """What an auditor passes to ``fedmf audit --ledger`` for the ledger the server writes at ``ledger``."""
    text = os.fspath(ledger)
    if "://" not in text:
        return text  # a SQLite file path
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError):
        return public_url(text)
    if parsed.get_backend_name() == "sqlite":
        return parsed.database or text
    # where to connect, never who: no password, no password-like or client-identity query value
    query = {k: v for k, v in parsed.query.items() if k in _WHERE_KEYS}
    return parsed._replace(password=None).set(username=AUDITOR_ROLE, query=query).render_as_string(
        hide_password=False)


def audit_command(ledger: str | os.PathLike, run_id: int) -> str:
    """The shell command that audits run ``run_id`` of ``ledger`` as the auditor (quoted for a shell)."""
    return f"fedmf audit --ledger {shlex.quote(auditor_ledger(ledger))} --run {run_id}"
