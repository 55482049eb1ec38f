"""Alembic environment: the ledger runs its migrations on a connection it passes in
(``config.attributes["connection"]``); there is no alembic.ini. The same migrations
apply to SQLite and PostgreSQL."""

from __future__ import annotations

from alembic import context

from fedmf.ledger.models import VERSION_TABLE, Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only programmatic use is supported
    raise RuntimeError("the fedmf ledger migrations run through fedmf.ledger (no alembic.ini)")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",  # ALTER on SQLite goes through batch mode
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
