"""``fedmf ledger migrate``: create or migrate a ledger's schema as its owner, without a prompt.

The operator runs it once before the first server starts (deploy/README.md, step 1) and after a
fedmf upgrade; the server role cannot change the schema. A PostgreSQL password is read from a file
(``--password-file``: owned by the user running fedmf, 0600), never from the command line, and is
never printed.
"""

from __future__ import annotations

import argparse
from typing import Any

from .common import UsageError

__all__ = ["register", "cmd_migrate", "read_password_file"]


def read_password_file(path: str) -> str:
    """The password in ``path`` (its first line): the file must be this user's and 0600."""
    from ..files import check_private

    check_private(path, "--password-file", UsageError)
    with open(path, "rb") as f:
        data = f.read(4097)
    lines = data.splitlines()
    password = lines[0].decode("utf-8", errors="strict") if lines else ""
    if not password:
        raise UsageError(f"--password-file {path!r} is empty")
    if len(data) > 4096 or len([line for line in lines if line.strip()]) > 1:
        raise UsageError(f"--password-file {path!r} must hold the password alone, on one line")
    return password


def cmd_migrate(args: argparse.Namespace) -> int:
    from ..ledger.db import display_url, migrate, resolve_url

    url = resolve_url(args.url)
    if args.password_file is not None:
        if url.get_backend_name() != "postgresql":
            raise UsageError("--password-file: only a PostgreSQL ledger (postgresql://…) takes a password")
        if url.password:
            raise UsageError("--url holds a password and --password-file gives one: give it only in the file")
        url = url.set(password=read_password_file(args.password_file))
    before, after = migrate(url)
    shown = display_url(url)
    if before == after:
        print(f"ledger {shown}: schema version {after}, already current")
    elif before is None:
        print(f"ledger {shown}: created at schema version {after}")
    else:
        print(f"ledger {shown}: migrated from schema version {before} to {after}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``ledger`` and its sub-command to fedmf's sub-parsers."""
    p = subparsers.add_parser("ledger", help="the ledger's schema (create, migrate)",
                              description="Manage the ledger database itself.")
    sub = p.add_subparsers(dest="ledger_command", required=True, parser_class=type(p))
    q = sub.add_parser("migrate", help="create or migrate the ledger's tables to this fedmf's schema",
                       description="Create the ledger's tables in an empty database, or migrate an older "
                                   "ledger to this fedmf's schema, in one transaction; run it as the database's "
                                   "owner role. Refuses a ledger from a newer fedmf.")
    q.add_argument("--url", required=True, metavar="URL",
                   help="postgresql://OWNER@HOST:PORT/DB (no password in it), or a SQLite path")
    q.add_argument("--password-file", metavar="FILE",
                   help="a file holding the PostgreSQL role's password on one line (yours, mode 0600); without "
                        "it libpq's own sources apply (PGPASSWORD, ~/.pgpass)")
    q.set_defaults(func=cmd_migrate)
