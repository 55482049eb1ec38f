"""Lifetime per-user privacy budgets across the runs that share one ledger: the policy.

The ledger stores the budgets and the charges (``fedmf.ledger.budgets``); this module says what they
mean. Accounting in μ-GDP (``fedmf.accounting.gdp``): a run with noise multiplier z is (1/z)-GDP
against the worst pattern its schema allows, unamplified (valid for every sampler, amplified or not:
the scheduler never exceeds the schema); with adaptive clipping its count release adds k/σ_b² (k rounds
at most, sensitivity 1, std σ_b), and a private client-metric release k·L²/σ_m² (together k/σ_unit²,
``fedmf.accounting.releases``; ``gdp.run_mu_squared``). When a run first selects a user it inserts a
*charge*: that full worst-case μ², whatever the run later does (an aborted round, an early stop:
conservative). A user is admissible in a run if the run has charged them already, or if the sum of
their other charges plus this run's μ² stays within μ(ε_budget, δ) (Dong et al. Cor. 3.3
composition). The check and the charge happen in one write transaction that holds the write lock
(SQLite) or an advisory lock (PostgreSQL) (``ledger.budgets.charging``), so concurrent runs cannot
overspend a user together: the later one re-checks, finds the user full, and its round is aborted
before anything is sent (redone, it passes over them). Runs that were recorded before budgets were
set are not counted: set budgets before the first run.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from .accounting.gdp import compose, epsilon_for, mu_for, run_mu_squared
from .errors import ConfigError
from .ledger.budgets import (
    ChargeView,
    UserCharges,
    all_user_charges,
    charging,
    read_charges,
    record_charges,
    run_settings,
    user_charges,
)
from .ledger.db import LedgerError
from .ledger.keys import ServerSecret

__all__ = ["ConcurrentChargeError", "UserAccount", "RunBudget", "user_account", "user_accounts"]


class ConcurrentChargeError(LedgerError):
    """A concurrent run spent the lifetime budget of a user this round selected: the round is
    aborted before anything is sent, and redone (both drivers retry it: ``fedmf.run.ledger_retry``)."""


@dataclass(frozen=True)
class UserAccount:
    """One user's lifetime account (``label``: a prefix of the lifetime key's hex)."""

    label: str
    runs: int
    mu: float
    spent_epsilon: float
    budget_epsilon: float | None
    remaining_epsilon: float | None


def _account(stored: UserCharges) -> UserAccount:
    """μ of a user's charges (Dong et al. Cor. 3.3), ε spent at the lifetime δ, budget and what remains."""
    mu = compose(stored.charges)
    spent = epsilon_for(mu, stored.delta)
    budget = stored.default_epsilon if stored.own_epsilon is None else stored.own_epsilon
    return UserAccount(stored.key.hex()[:16], len(stored.charges), mu, spent, budget,
                       None if budget is None else budget - spent)


def user_account(engine, secret: ServerSecret, user: object) -> UserAccount | None:
    """One user's lifetime account, looked up by their id (``secret``: this ledger's budget secret).
    None: no budgets."""
    stored = user_charges(engine, secret, user)
    return None if stored is None else _account(stored)


def user_accounts(engine) -> list[UserAccount]:
    """Every user who has a charge or a budget of their own: runs charged, μ, ε spent (worst case at the
    lifetime δ), budget and remaining ε; sorted by label."""
    return [_account(stored) for stored in all_user_charges(engine)]


class RunBudget:
    """One run's view of the lifetime budgets: which users it may select, and their charges."""

    def __init__(self, ledger, run_id: int | None, secret: ServerSecret, mu_squared: float, delta: float) -> None:
        self._ledger, self.run_id, self._secret = ledger, run_id, secret
        self.mu_squared, self.delta = mu_squared, delta
        self.skipped: int | None = None  # the last admissible() call's count

    def __repr__(self) -> str:
        return f"RunBudget(run={self.run_id}, mu_squared={self.mu_squared:g})"

    @classmethod
    def open(cls, ledger, secret: ServerSecret | None, plan, run_id: int | None = None) -> RunBudget | None:
        """None when the ledger has no budgets and no secret is given; refuses a ledger with budgets
        without its secret, and a secret for a ledger without budgets. Called before the run is
        recorded (``run_id`` None: set it once the run exists)."""
        delta = run_settings(ledger, secret)
        if delta is None and secret is None:
            return None
        if delta is None:
            raise ConfigError("a budget secret was given but this ledger has no lifetime budgets "
                              "(set them first: fedmf budget default)")
        if secret is None:
            raise ConfigError("this ledger enforces lifetime budgets: give the run its budget secret (budget_key)")
        return cls(ledger, run_id, secret, run_mu_squared(plan), delta)

    def _blocked(self, view: ChargeView, keys: Sequence[bytes]) -> list[bool]:
        """Per key: whether charging this run's μ² would exceed the user's budget (Dong et al. Cor. 3.3)."""
        limits: dict[float, float] = {}
        out = []
        for key in keys:
            budget = view.own.get(key, view.default_epsilon)
            if key in view.ours or budget is None:
                out.append(False)
                continue
            if budget not in limits:
                limits[budget] = mu_for(budget, view.delta) ** 2
            out.append(math.fsum(view.others.get(key, [])) + self.mu_squared > limits[budget])
        return out

    def admissible(self, t: int, users: Iterable[Hashable]) -> list[Hashable]:
        """``users`` whose budget allows them in this run (order kept); ``skipped`` counts the others."""
        users = list(users)
        keys = [self._secret.lifetime_key(u) for u in users]
        with self._ledger._errors(), self._ledger.engine.connect() as conn:
            blocked = self._blocked(read_charges(conn, keys, self.run_id), keys)
            conn.rollback()
        self.skipped = sum(blocked)
        return [u for u, b in zip(users, blocked) if not b]

    def charge(self, t: int, users: Iterable[Hashable]) -> None:
        """Charge this run's μ² to each of ``users`` it has not charged yet, re-checking their budgets in
        the same write transaction, and record round t's skip count."""
        keys = list(dict.fromkeys(self._secret.lifetime_key(u) for u in users))
        with charging(self._ledger) as conn:
            if any(self._blocked(read_charges(conn, keys, self.run_id), keys)):
                raise ConcurrentChargeError(f"round {t}: a concurrent run has spent the lifetime budget of a selected "
                                            "user; redo the round")
            record_charges(conn, self.run_id, keys, self.mu_squared, t, int(self.skipped or 0))
