"""The storage of lifetime per-user budgets across the runs that share one ledger: what is set and
what was charged, never what it means (``fedmf.budgets``: who may take part, each user's ε spent).

A user's budget is an ε at the ledger's lifetime δ (default 1e-10): their own (``user_budgets``) or
the ledger-wide default (``budget_settings``; none: not limited). Users are linked across runs by a
lifetime key, ``ServerSecret.lifetime_key`` under a ledger-wide budget secret (a 0600 file the
operator keeps and gives every run; the ledger stores only its key check). A *charge* is one run's
μ² on one user (``budget_charges``), a *skip* a round's count of users passed over for their budget
(``budget_skips``). ``charging`` is the write transaction in which a run checks and charges: it
holds the write lock (SQLite) or an advisory lock (PostgreSQL), so concurrent runs cannot overspend a
user together.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from .. import checks
from ..errors import ConfigError
from .db import LedgerError
from .keys import ServerSecret
from .models import BudgetCharge, BudgetSettings, BudgetSkip, UserBudget

__all__ = ["DEFAULT_LIFETIME_DELTA", "BudgetSettingsInfo", "UserCharges", "ChargeView", "load_budget_secret",
           "set_default", "set_user", "set_users", "settings", "user_charges", "all_user_charges", "round_skips",
           "run_settings", "read_charges", "charging", "record_charges"]

DEFAULT_LIFETIME_DELTA = 1e-10
_CHUNK = 5000
#: PostgreSQL: the transaction-scoped advisory lock that serializes charges of concurrent runs (SQLite:
#: a writing transaction holds the database's write lock from its start)
_CHARGE_LOCK = 0x66656462756467  # "fedbudg"


@dataclass(frozen=True)
class BudgetSettingsInfo:
    default_epsilon: float | None
    delta: float


@dataclass(frozen=True)
class UserCharges:
    """One user's stored account: their lifetime key, their charges' μ² (one per run), their own
    budget (None: the default) and the ledger's settings."""

    key: bytes
    charges: list[float]
    own_epsilon: float | None
    default_epsilon: float | None
    delta: float


@dataclass(frozen=True)
class ChargeView:
    """What a charging run reads of some users, in one transaction: the ledger's default ε and δ, the
    other runs' charges, the users this run charged already, and the users' own budgets."""

    default_epsilon: float | None
    delta: float
    others: dict[bytes, list[float]]
    ours: set[bytes]
    own: dict[bytes, float]


def load_budget_secret(path: str | os.PathLike, *, create: bool = False) -> ServerSecret:
    """The budget secret in the 0600 file ``path`` (``create``: made if absent)."""
    from ..run.checkpoint import load_or_create_secret

    if not create and not os.path.exists(path):
        raise ConfigError(f"budget secret file {os.fspath(path)!r} does not exist (fedmf budget default creates it)")
    return ServerSecret(load_or_create_secret(path))


def _settings_row(session: Session) -> BudgetSettings | None:
    return session.get(BudgetSettings, 1)


def _check_key(row: BudgetSettings, secret: ServerSecret) -> None:
    if row.key_check != secret.key_check():
        raise LedgerError("the budget secret is not the one this ledger's budgets were set with")


def set_default(ledger, secret: ServerSecret, epsilon: float | None, delta: float | None = None) -> BudgetSettingsInfo:
    """Set the ledger-wide default lifetime ε (None: unlimited) and, if given, the lifetime δ; the
    first call binds the ledger's budgets to ``secret``."""
    eps = None if epsilon is None else checks.non_negative("epsilon", epsilon)
    d = None if delta is None else checks.open_unit("delta", delta)
    with ledger._errors("cannot write to ledger"), Session(ledger.write_engine) as session, session.begin():
        row = _settings_row(session)
        if row is None:
            row = BudgetSettings(id=1, default_epsilon=eps, delta=d or DEFAULT_LIFETIME_DELTA,
                                 key_check=secret.key_check())
            session.add(row)
        else:
            _check_key(row, secret)
            if d is not None and d != row.delta and session.scalar(select(BudgetCharge.run_id).limit(1)) is not None:
                raise ConfigError("the lifetime delta cannot change once a run has charged a user")
            row.default_epsilon = eps
            if d is not None:
                row.delta = d
        return BudgetSettingsInfo(row.default_epsilon, row.delta)


def set_user(ledger, secret: ServerSecret, user: object, epsilon: float | None) -> None:
    """Set ``user``'s own lifetime ε (None: back to the default). Needs budgets set up (``set_default``)."""
    set_users(ledger, secret, {user: epsilon})


def set_users(ledger, secret: ServerSecret, budgets: Mapping[object, float | None]) -> int:
    """Set each user's own lifetime ε (None: back to the default) in one transaction: all or none.
    Needs budgets set up (``set_default``). Returns the number of users set."""
    rows = {}
    for user, epsilon in budgets.items():
        rows[secret.lifetime_key(user)] = None if epsilon is None else checks.non_negative("epsilon", epsilon)
    keys = list(rows)
    with ledger._errors("cannot write to ledger"), Session(ledger.write_engine) as session, session.begin():
        row = _settings_row(session)
        if row is None:
            raise ConfigError("this ledger has no lifetime budgets yet: set a default first (fedmf budget default)")
        _check_key(row, secret)
        for i in range(0, len(keys), _CHUNK):
            session.execute(delete(UserBudget).where(UserBudget.lifetime_key.in_(keys[i:i + _CHUNK])))
        own = [{"lifetime_key": k, "epsilon": e} for k, e in rows.items() if e is not None]
        for i in range(0, len(own), _CHUNK):
            session.execute(insert(UserBudget), own[i:i + _CHUNK])
    return len(rows)


def user_charges(engine, secret: ServerSecret, user: object) -> UserCharges | None:
    """One user's stored account, looked up by their id: the lifetime key under ``secret`` (which must
    be this ledger's budget secret) selects their charges and own budget. None: no budgets."""
    key = secret.lifetime_key(user)
    with Session(engine) as session:
        row = _settings_row(session)
        if row is None:
            return None
        _check_key(row, secret)
        charges = [float(m) for m in session.scalars(select(BudgetCharge.mu_squared)
                                                     .where(BudgetCharge.lifetime_key == key))]
        own = session.scalar(select(UserBudget.epsilon).where(UserBudget.lifetime_key == key))
        return UserCharges(key, charges, None if own is None else float(own), row.default_epsilon, row.delta)


def settings(engine) -> BudgetSettingsInfo | None:
    """The ledger's budget settings (None: no budgets)."""
    with Session(engine) as session:
        row = _settings_row(session)
        return None if row is None else BudgetSettingsInfo(row.default_epsilon, row.delta)


def all_user_charges(engine) -> list[UserCharges]:
    """Every user who has a charge or a budget of their own, sorted by lifetime key (none: no budgets)."""
    with Session(engine) as session:
        row = _settings_row(session)
        if row is None:
            return []
        charges: dict[bytes, list[float]] = {}
        for key, mu2 in session.execute(select(BudgetCharge.lifetime_key, BudgetCharge.mu_squared)):
            charges.setdefault(bytes(key), []).append(float(mu2))
        own = {bytes(k): float(e) for k, e in session.execute(select(UserBudget.lifetime_key, UserBudget.epsilon))}
        default, delta = row.default_epsilon, row.delta
    return [UserCharges(key, charges.get(key, []), own.get(key), default, delta)
            for key in sorted(set(charges) | set(own))]


def round_skips(engine, run_id: int) -> dict[int, int]:
    """{round: users skipped for their budget} of one run (rounds that recorded any)."""
    with Session(engine) as session:
        return {int(t): int(n) for t, n in session.execute(
            select(BudgetSkip.round_index, BudgetSkip.skipped).where(BudgetSkip.run_id == run_id))}


def run_settings(ledger, secret: ServerSecret | None) -> float | None:
    """The lifetime δ of a ledger with budgets (None: no budgets), checking ``secret`` when both exist."""
    with ledger._errors(), Session(ledger.engine) as session:
        row = _settings_row(session)
        if row is not None and secret is not None:
            _check_key(row, secret)
        return None if row is None else row.delta


def read_charges(conn: Connection, keys: Sequence[bytes], run_id: int | None) -> ChargeView:
    """The budgets and charges of ``keys`` (run ``run_id``'s own charges apart), read on ``conn``."""
    row = conn.execute(select(BudgetSettings.default_epsilon, BudgetSettings.delta)
                       .where(BudgetSettings.id == 1)).one()
    default, delta = row
    unique = list(dict.fromkeys(keys))
    others: dict[bytes, list[float]] = {}
    ours: set[bytes] = set()
    own: dict[bytes, float] = {}
    for i in range(0, len(unique), _CHUNK):
        chunk = unique[i:i + _CHUNK]
        for key, run, mu2 in conn.execute(select(BudgetCharge.lifetime_key, BudgetCharge.run_id,
                                                 BudgetCharge.mu_squared)
                                          .where(BudgetCharge.lifetime_key.in_(chunk))):
            if run == run_id:
                ours.add(bytes(key))
            else:
                others.setdefault(bytes(key), []).append(float(mu2))
        own.update((bytes(k), float(e)) for k, e in conn.execute(
            select(UserBudget.lifetime_key, UserBudget.epsilon).where(UserBudget.lifetime_key.in_(chunk))))
    return ChargeView(default, delta, others, ours, own)


@contextmanager
def charging(ledger) -> Iterator[Connection]:
    """The write transaction of a run's charges: serialized with every other run's (SQLite: the write
    lock; PostgreSQL: an advisory lock, READ COMMITTED so that each statement after it sees every charge
    committed before)."""
    engine = ledger.write_engine
    if engine.dialect.name == "postgresql":
        # READ COMMITTED whatever the server's default: each statement after the lock sees every charge
        # committed before it (a REPEATABLE READ snapshot would predate the lock and miss them)
        engine = engine.execution_options(isolation_level="READ COMMITTED")
    with ledger._errors("cannot write to ledger"), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _CHARGE_LOCK})
        yield conn


def record_charges(conn: Connection, run_id: int | None, keys: Sequence[bytes], mu_squared: float, t: int,
                   skipped: int) -> None:
    """Insert run ``run_id``'s charge ``mu_squared`` on each of ``keys`` it has not charged yet (in round t),
    and record round t's skip count, on ``conn`` (inside ``charging``)."""
    charged = {bytes(k) for k in conn.execute(select(BudgetCharge.lifetime_key).where(
        BudgetCharge.run_id == run_id, BudgetCharge.lifetime_key.in_(keys))).scalars()} if keys else set()
    new = [{"lifetime_key": k, "run_id": run_id, "mu_squared": mu_squared, "round_index": t}
           for k in keys if k not in charged]
    if new:
        conn.execute(insert(BudgetCharge), new)
    done = conn.execute(update(BudgetSkip).where(BudgetSkip.run_id == run_id,
                                                 BudgetSkip.round_index == t).values(skipped=skipped)).rowcount
    if done == 0:
        conn.execute(insert(BudgetSkip).values(run_id=run_id, round_index=t, skipped=skipped))
