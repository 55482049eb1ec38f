"""Per-round privacy of a recorded run, for the audit (``fedmf.audit.replay``): the plan's ε and
the worst recorded user's ε after each round, and every user's own ε.

Nothing is computed here: the plan's curve (the worst pattern the plan allows, prefix by
prefix) comes from ``accountant.epsilon_by_round``, and every observed value
(each user's sensitivity and ε, the worst user's prefix curve, who broke the plan) from
``posthoc.account_contributions``, the one implementation of post-hoc
accounting, so the audit's per-user ε is ``account_observed``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..participation import FixedEpoch, MinSep
from .posthoc import MAX_DENSE_ENTRIES, PosthocReport, account_contributions, release_rows, user_multipliers

__all__ = ["RunPrivacy", "run_privacy", "release_rows", "MAX_DENSE_ENTRIES", "EXACT_CURVE_METHODS"]

EXACT_CURVE_METHODS = ("toeplitz-closed-form", "banded-exact")  # epsilon_by_round's exact closed forms


@dataclass(frozen=True)
class RunPrivacy:
    sensitivity_plan: float  # the sensitivity the noise was calibrated to (full horizon)
    sensitivity_plan_method: str
    sensitivity_plan_exact: bool
    epsilon_plan: float  # ε at the end of the run under the plan
    plan_by_round: np.ndarray  # (n,) the plan's worst prefix sensitivity after each round
    epsilon_plan_by_round: np.ndarray  # (n,)
    plan_curve_method: str
    plan_curve_exact: bool
    worst_by_round: np.ndarray  # (n,) the worst recorded user's prefix sensitivity
    epsilon_worst_by_round: np.ndarray  # (n,)
    user_sensitivity: np.ndarray  # (U,) each user's full-horizon sensitivity from the rounds so far
    epsilon_user: np.ndarray  # (U,)
    observed_exact: bool  # every user's sensitivity is exact (not a bound)
    posthoc: PosthocReport  # every user's account, violators flagged
    rho_plan: float = 0.0  # ρ-zCDP at the end of the run under the plan (Bun & Steinke 2016, Prop. 1.6)
    rho_plan_by_round: np.ndarray | None = None  # (n,)
    rho_user: np.ndarray | None = None  # (U,) each user's ρ from their own rounds (and counts)


def run_privacy(mechanism, schema: MinSep | FixedEpoch, noise_multiplier: float, delta: float,
                users: np.ndarray, rounds: np.ndarray, n_users: int,
                labels: Sequence[str] | None = None, count_noise_std: float | None = None) -> RunPrivacy:
    """Sensitivities, ε and ρ for the audit. ``users``/``rounds``: one entry per contribution,
    sorted by user then round; ``users`` numbers the users 0 … n_users-1, ``labels`` names
    them (default: their numbers). ``count_noise_std``: σ_b of adaptive clipping's count release (or σ_unit
    of all the round's extra Gaussian releases, ``fedmf.accounting.releases``), composed with each user's
    actual participations (and the plan's k for the planned values)."""
    from .accountant import epsilon_by_round

    if labels is None:
        labels = [str(u) for u in range(n_users)]
    report = account_contributions(mechanism, noise_multiplier, delta, schema, users, rounds, labels, by_round=True,
                                   count_noise_std=count_noise_std)
    by_round = epsilon_by_round(mechanism, noise_multiplier, delta, schema, count_noise_std=count_noise_std)
    counts = np.diff(np.searchsorted(np.asarray(users, dtype=np.int64), np.arange(n_users + 1)))
    multipliers = user_multipliers(report.sensitivities(), noise_multiplier * report.planned_sensitivity, counts,
                                   count_noise_std)
    with np.errstate(divide="ignore"):
        rho_user = 0.5 / np.square(multipliers)  # Bun & Steinke 2016, Prop. 1.6 (inf multiplier: ρ = 0)
    return RunPrivacy(
        sensitivity_plan=report.planned_sensitivity,
        sensitivity_plan_method=report.planned_sensitivity_method,
        sensitivity_plan_exact=report.planned_sensitivity_exact,
        epsilon_plan=float(by_round.epsilons[-1]),
        plan_by_round=np.asarray(by_round.sensitivities, dtype=np.float64),
        epsilon_plan_by_round=np.asarray(by_round.epsilons, dtype=np.float64),
        plan_curve_method=by_round.method,
        plan_curve_exact=by_round.method in EXACT_CURVE_METHODS and report.planned_sensitivity_exact,
        worst_by_round=report.sensitivity_by_round,
        epsilon_worst_by_round=report.epsilon_by_round,
        user_sensitivity=report.sensitivities(),
        epsilon_user=report.epsilons(),
        observed_exact=all(u.sensitivity_exact for u in report.users),
        posthoc=report,
        rho_plan=float(by_round.rhos[-1]),
        rho_plan_by_round=by_round.rhos,
        rho_user=rho_user,
    )
