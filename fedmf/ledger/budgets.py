"""Lifetime per-user privacy budgets across the runs that share one ledger.

A user's budget is an ε at the ledger's lifetime δ (default 1e-10): their own (``user_budgets``) or
the ledger-wide default (``budget_settings``; none: not limited). Users are linked across runs by a
lifetime key, ``ServerSecret.lifetime_key`` under a ledger-wide budget secret (a 0600 file the
operator keeps and gives every run; the ledger stores only its key check).

Accounting in μ-GDP (``fedmf.accounting.gdp``): a run with noise multiplier z is (1/z)-GDP against the
worst pattern its schema allows, unamplified (valid for every sampler, amplified or not: the
scheduler never exceeds the schema); with adaptive clipping its count release adds k/σ_b² (k rounds
at most, sensitivity 1, std σ_b), and a private client-metric release k·L²/σ_m² (together k/σ_unit²,
``fedmf.accounting.releases``). When a run first selects a user it inserts a *charge*: that full
worst-case μ², whatever the run later does (an aborted round, an early stop: conservative). A user is
admissible in a run if the run has charged them already, or if the sum of their other charges plus
this run's μ² stays within μ(ε_budget, δ) (Dong et al. Cor. 3.3 composition). The check and the
charge happen in one write transaction that holds the write lock (SQLite) or an advisory lock
(PostgreSQL), so concurrent runs cannot overspend a user together: the later one re-checks, finds
the user full, and its round is aborted before anything is sent (redone, it passes over them).
Runs that were recorded before budgets were set are not counted: set budgets before the first run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.orm import Session

from .. import checks
from ..accounting.gdp import compose, epsilon_for, mu_for
from ..errors import ConfigError
from .db import LedgerError
from .keys import ServerSecret
from .models import BudgetCharge, BudgetSettings, BudgetSkip, UserBudget

__all__ = ["ConcurrentChargeError", "DEFAULT_LIFETIME_DELTA", "BudgetSettingsInfo", "UserAccount", "RunBudget",
           "load_budget_secret", "set_default", "set_user", "set_users", "user_account", "settings", "user_accounts",
           "run_mu_squared", "round_skips"]

DEFAULT_LIFETIME_DELTA = 1e-10
_CHUNK = 5000
#: PostgreSQL: the transaction-scoped advisory lock that serializes charges of concurrent runs (SQLite:
#: a writing transaction holds the database's write lock from its start)
_CHARGE_LOCK = 0x66656462756467  # "fedbudg"


class ConcurrentChargeError(LedgerError):
    """A concurrent run spent the lifetime budget of a user this round selected: the round is
    aborted before anything is sent, and redone (both drivers retry it: ``fedmf.ledger_retry``)."""


@dataclass(frozen=True)
class BudgetSettingsInfo:
    default_epsilon: float | None
    delta: float


@dataclass(frozen=True)
class UserAccount:
    """One user's lifetime account (``label``: a prefix of the lifetime key's hex)."""

    label: str
    runs: int
    mu: float
    spent_epsilon: float
    budget_epsilon: float | None
    remaining_epsilon: float | None


def load_budget_secret(path: str | os.PathLike, *, create: bool = False) -> ServerSecret:
    """The budget secret in the 0600 file ``path`` (``create``: made if absent)."""
    from ..checkpoint import load_or_create_secret

    if not create and not os.path.exists(path):
        raise ConfigError(f"budget secret file {os.fspath(path)!r} does not exist (fedmf budget default creates it)")
    return ServerSecret(load_or_create_secret(path))


def run_mu_squared(plan) -> float:
    """μ² of a run's worst case, unamplified: 1/z² (σ = z·ζ·sens) plus, with extra Gaussian releases
    (adaptive clipping's count, the private client-metric release), k/σ_unit² for k participations'
    releases (σ_unit: ``fedmf.accounting.releases`` (R); σ_b with the count alone; Dong et al. Cor. 3.3)."""
    from ..accounting.count_release import participations

    mu2 = 1.0 / plan.noise_multiplier ** 2
    if plan.extra_noise_std is not None:
        mu2 += participations(plan.schema, plan.rounds) / plan.extra_noise_std ** 2
    return mu2


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


def user_account(engine, secret: ServerSecret, user: object) -> UserAccount | None:
    """One user's lifetime account, looked up by their id: the lifetime key under ``secret`` (which
    must be this ledger's budget secret) selects their charges and own budget. None: no budgets."""
    key = secret.lifetime_key(user)
    with Session(engine) as session:
        row = _settings_row(session)
        if row is None:
            return None
        _check_key(row, secret)
        charges = [float(m) for m in session.scalars(select(BudgetCharge.mu_squared)
                                                     .where(BudgetCharge.lifetime_key == key))]
        own = session.scalar(select(UserBudget.epsilon).where(UserBudget.lifetime_key == key))
        default, delta = row.default_epsilon, row.delta
    mu = compose(charges)
    spent = epsilon_for(mu, delta)
    budget = default if own is None else float(own)
    return UserAccount(key.hex()[:16], len(charges), mu, spent, budget, None if budget is None else budget - spent)


def settings(engine) -> BudgetSettingsInfo | None:
    """The ledger's budget settings (None: no budgets)."""
    with Session(engine) as session:
        row = _settings_row(session)
        return None if row is None else BudgetSettingsInfo(row.default_epsilon, row.delta)


def user_accounts(engine) -> list[UserAccount]:
    """Every user who has a charge or a budget of their own: runs charged, μ, ε spent (worst case at the
    lifetime δ), budget and remaining ε; sorted by label."""
    with Session(engine) as session:
        row = _settings_row(session)
        if row is None:
            return []
        charges: dict[bytes, list[float]] = {}
        for key, mu2 in session.execute(select(BudgetCharge.lifetime_key, BudgetCharge.mu_squared)):
            charges.setdefault(bytes(key), []).append(float(mu2))
        own = {bytes(k): float(e) for k, e in session.execute(select(UserBudget.lifetime_key, UserBudget.epsilon))}
        default, delta = row.default_epsilon, row.delta
    out = []
    for key in sorted(set(charges) | set(own)):
        mu = compose(charges.get(key, []))
        spent = epsilon_for(mu, delta)
        budget = own.get(key, default)
        out.append(UserAccount(key.hex()[:16], len(charges.get(key, [])), mu, spent, budget,
                               None if budget is None else budget - spent))
    return out


def round_skips(engine, run_id: int) -> dict[int, int]:
    """{round: users skipped for their budget} of one run (rounds that recorded any)."""
    with Session(engine) as session:
        return {int(t): int(n) for t, n in session.execute(
            select(BudgetSkip.round_index, BudgetSkip.skipped).where(BudgetSkip.run_id == run_id))}


class RunBudget:
    """One run's view of the lifetime budgets: which users it may select, and their charges."""

    def __init__(self, ledger, run_id: int | None, secret: ServerSecret, mu_squared: float, delta: float) -> None:
        self._ledger, self.run_id, self._secret = ledger, run_id, secret
        self.mu_squared, self.delta = mu_squared, delta
        self.skipped: int | None = None  # the last admissible() call's count

    def __repr__(self) -> str:
        return f"RunBudget(run={self.run_id}, mu_squared={self.mu_squared:g})"

    @classmethod
    def open(cls, ledger, secret: ServerSecret | None, plan, run_id: int | None = None) -> "RunBudget | None":
        """None when the ledger has no budgets and no secret is given; refuses a ledger with budgets
        without its secret, and a secret for a ledger without budgets. Called before the run is
        recorded (``run_id`` None: set it once the run exists)."""
        with ledger._errors(), Session(ledger.engine) as session:
            row = _settings_row(session)
            if row is not None and secret is not None:
                _check_key(row, secret)
            delta = None if row is None else row.delta
        if row is None and secret is None:
            return None
        if row is None:
            raise ConfigError("a budget secret was given but this ledger has no lifetime budgets "
                              "(set them first: fedmf budget default)")
        if secret is None:
            raise ConfigError("this ledger enforces lifetime budgets: give the run its budget secret (budget_key)")
        return cls(ledger, run_id, secret, run_mu_squared(plan), delta)

    def _blocked(self, conn, keys: Sequence[bytes]) -> list[bool]:
        """Per key: whether charging this run's μ² would exceed the user's budget (Dong et al. Cor. 3.3)."""
        row = conn.execute(select(BudgetSettings.default_epsilon, BudgetSettings.delta)
                           .where(BudgetSettings.id == 1)).one()
        default, delta = row
        unique = list(dict.fromkeys(keys))
        charges: dict[bytes, list[float]] = {}
        ours: set[bytes] = set()
        own: dict[bytes, float] = {}
        for i in range(0, len(unique), _CHUNK):
            chunk = unique[i:i + _CHUNK]
            for key, run, mu2 in conn.execute(select(BudgetCharge.lifetime_key, BudgetCharge.run_id,
                                                     BudgetCharge.mu_squared)
                                              .where(BudgetCharge.lifetime_key.in_(chunk))):
                if run == self.run_id:
                    ours.add(bytes(key))
                else:
                    charges.setdefault(bytes(key), []).append(float(mu2))
            own.update((bytes(k), float(e)) for k, e in conn.execute(
                select(UserBudget.lifetime_key, UserBudget.epsilon).where(UserBudget.lifetime_key.in_(chunk))))
        limits: dict[float, float] = {}
        out = []
        for key in keys:
            budget = own.get(key, default)
            if key in ours or budget is None:
                out.append(False)
                continue
            if budget not in limits:
                limits[budget] = mu_for(budget, delta) ** 2
            out.append(math.fsum(charges.get(key, [])) + self.mu_squared > limits[budget])
        return out

    def admissible(self, t: int, users: Iterable[Hashable]) -> list[Hashable]:
        """``users`` whose budget allows them in this run (order kept); ``skipped`` counts the others."""
        users = list(users)
        keys = [self._secret.lifetime_key(u) for u in users]
        with self._ledger._errors(), self._ledger.engine.connect() as conn:
            blocked = self._blocked(conn, keys)
            conn.rollback()
        self.skipped = sum(blocked)
        return [u for u, b in zip(users, blocked) if not b]

    def charge(self, t: int, users: Iterable[Hashable]) -> None:
        """Charge this run's μ² to each of ``users`` it has not charged yet, re-checking their budgets in
        the same write transaction, and record round t's skip count."""
        keys = list(dict.fromkeys(self._secret.lifetime_key(u) for u in users))
        engine = self._ledger.write_engine
        if engine.dialect.name == "postgresql":
            # READ COMMITTED whatever the server's default: each statement after the lock sees every charge
            # committed before it (a REPEATABLE READ snapshot would predate the lock and miss them)
            engine = engine.execution_options(isolation_level="READ COMMITTED")
        with self._ledger._errors("cannot write to ledger"), engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _CHARGE_LOCK})
            if any(self._blocked(conn, keys)):
                raise ConcurrentChargeError(f"round {t}: a concurrent run has spent the lifetime budget of a selected "
                                            "user; redo the round")
            charged = {bytes(k) for k in conn.execute(select(BudgetCharge.lifetime_key).where(
                BudgetCharge.run_id == self.run_id, BudgetCharge.lifetime_key.in_(keys))).scalars()} if keys else set()
            new = [{"lifetime_key": k, "run_id": self.run_id, "mu_squared": self.mu_squared, "round_index": t}
                   for k in keys if k not in charged]
            if new:
                conn.execute(insert(BudgetCharge), new)
            skipped = int(self.skipped or 0)
            done = conn.execute(update(BudgetSkip).where(BudgetSkip.run_id == self.run_id,
                                                         BudgetSkip.round_index == t).values(skipped=skipped)).rowcount
            if done == 0:
                conn.execute(insert(BudgetSkip).values(run_id=self.run_id, round_index=t, skipped=skipped))
