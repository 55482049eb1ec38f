"""Alembic migrations of the ledger (run programmatically by ``fedmf.ledger.db``)."""
