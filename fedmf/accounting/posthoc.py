"""Post-hoc accounting from the observed participation pattern (rounds per user).

Each user u is accounted with their OWN sensitivity s_u = ||C restricted to u's rounds||
(``fedmf.sensitivity.observed``: exact when C[:, π]^T C[:, π] >= 0 or |π| <= 2, else a
sound bound), at the noise actually added, std z·sens_planned: one Gaussian mechanism with
multiplier z·sens_planned/s_u ("Multi-Epoch MF", Thm 2.2, for the fixed pattern of user u;
individual accounting as in "Scaling up BandMF" App. H / Feldman & Zrnic 2021). The
participation pattern must not depend on the user's data (in FL it is the scheduler's
choice and the device's availability), and it is treated as public.

Users whose rounds break the planned schema (too many, too close, outside their slot, or a
sensitivity above the planned one) are flagged and accounted with their own, larger
sensitivity — never with the planned one. The run's guarantee is the worst user's epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from .. import sensitivity as _sens
from ..participation import FixedEpoch, MinSep, Observed
from . import _validate, gaussian

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema

__all__ = ["UserAccount", "PosthocReport", "account_observed", "breaks_schema"]

_RTOL = 1e-9


@dataclass(frozen=True)
class UserAccount:
    user: str
    rounds: tuple[int, ...]
    sensitivity: float
    sensitivity_exact: bool
    epsilon: float
    violation: str | None  # why the user broke the plan, or None


@dataclass
class PosthocReport:
    delta: float
    noise_multiplier: float
    planned_sensitivity: float
    planned_epsilon: float
    users: list[UserAccount]
    accountant: str
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def worst(self) -> UserAccount | None:
        return max(self.users, key=lambda u: (u.epsilon, u.user)) if self.users else None

    @property
    def epsilon(self) -> float:
        """The run's guarantee: the worst user's epsilon."""
        return self.worst.epsilon if self.users else 0.0

    @property
    def violators(self) -> list[UserAccount]:
        return [u for u in self.users if u.violation is not None]

    def epsilons(self) -> np.ndarray:
        return np.array([u.epsilon for u in self.users])

    def distribution(self) -> dict:
        eps = self.epsilons()
        if eps.size == 0:
            return {"users": 0}
        q = np.quantile(eps, [0.0, 0.5, 0.9, 0.99, 1.0])
        return {"users": int(eps.size), "min": float(q[0]), "median": float(q[1]), "p90": float(q[2]),
                "p99": float(q[3]), "max": float(q[4]), "mean": float(eps.mean()),
                "above_planned": int(np.sum(eps > self.planned_epsilon * (1 + _RTOL)))}

    def to_dict(self, per_user: bool = False) -> dict:
        worst = self.worst
        out = {
            "epsilon": self.epsilon, "delta": self.delta, "noise_multiplier": self.noise_multiplier,
            "planned_sensitivity": self.planned_sensitivity, "planned_epsilon": self.planned_epsilon,
            "accountant": self.accountant, "seconds": self.seconds,
            "worst_user": None if worst is None else {"user": worst.user, "epsilon": worst.epsilon,
                                                      "sensitivity": worst.sensitivity,
                                                      "participations": len(worst.rounds),
                                                      "violation": worst.violation},
            "distribution": self.distribution(),
            "violators": [{"user": u.user, "epsilon": u.epsilon, "sensitivity": u.sensitivity,
                           "rounds": list(u.rounds), "violation": u.violation} for u in self.violators],
            **self.extra,
        }
        if per_user:
            out["users"] = [{"user": u.user, "epsilon": u.epsilon, "sensitivity": u.sensitivity,
                             "participations": len(u.rounds)} for u in self.users]
        return out


def breaks_schema(rounds: tuple[int, ...], schema: "Schema", n: int) -> str | None:
    """Why ``rounds`` is not allowed by ``schema`` (None when it is)."""
    if any(t < 0 or t >= n for t in rounds):
        return f"round outside [0, {n})"
    if isinstance(schema, MinSep):
        k = schema.participations(n)
        if len(rounds) > k:
            return f"{len(rounds)} participations > {k}"
        gaps = [j - i for i, j in zip(rounds, rounds[1:])]
        if gaps and min(gaps) < schema.min_sep:
            return f"two participations {min(gaps)} rounds apart < min_sep {schema.min_sep}"
        return None
    if isinstance(schema, FixedEpoch):
        if len({t % schema.min_sep for t in rounds}) > 1:
            return f"rounds in more than one slot (mod {schema.min_sep})"
        if len(rounds) > schema.max_participations:
            return f"{len(rounds)} participations > {schema.max_participations}"
        return None
    raise ValueError(f"post-hoc accounting needs a planned MinSep or FixedEpoch schema, got {schema!r}")


def account_observed(mechanism: "Mechanism", noise_multiplier: float, delta: float,
            observed: Observed | Mapping[str, Iterable[int]], planned: "Schema", *,
            accountant: str = "pld", noise_sensitivity: float | None = None) -> PosthocReport:
    """Per-user epsilon from the observed rounds of every user (see the module docstring).
    ``noise_sensitivity`` defaults to the planned schema's sensitivity (the noise scale)."""
    import time

    started = time.perf_counter()
    z = _validate.noise(noise_multiplier)
    delta = _validate.delta(delta)
    gaussian.check_accountant(accountant)
    if not isinstance(observed, Observed):
        observed = Observed.from_mapping(observed)
    n = mechanism.rounds
    observed.validate(n)
    planned_sens = mechanism.sensitivity(planned).value
    noise_sens = planned_sens if noise_sensitivity is None else _validate.noise(noise_sensitivity, "noise sensitivity")
    std = z * noise_sens
    planned_eps = gaussian.epsilon(std / planned_sens, delta, accountant)
    cache: dict[tuple[int, ...], _sens.Sensitivity] = {}
    users, sens_values = [], []
    for user, rounds in observed.rounds_by_user:
        if rounds not in cache:
            cache[rounds] = _sens.observed(mechanism, rounds) if rounds else _sens.Sensitivity(0.0, "observed-exact", True)
        s = cache[rounds]
        why = breaks_schema(rounds, planned, n)
        if why is None and s.value > planned_sens * (1 + _RTOL):
            why = f"sensitivity {s.value:.6g} above the planned {planned_sens:.6g}"
        users.append((user, rounds, s, why))
        sens_values.append(s.value)
    sens_arr = np.array(sens_values)
    with np.errstate(divide="ignore"):
        multipliers = np.where(sens_arr > 0, std / np.maximum(sens_arr, 1e-300), np.inf)
    if accountant == "pld":
        eps = gaussian.epsilons(multipliers, delta) if multipliers.size else np.zeros(0)
    else:
        memo: dict[float, float] = {}
        eps = np.array([0.0 if not np.isfinite(m) else memo.setdefault(m, gaussian.epsilon(m, delta, accountant))
                        for m in multipliers])
    # a conforming user can never be worse off than planned (their sensitivity is at most the
    # planned one); the cap only removes the last-digit difference of the two solvers
    accounts = []
    for (user, rounds, s, why), e in zip(users, eps):
        e = float(e)
        if why is None:
            e = min(e, planned_eps) if s.value <= planned_sens else e
        accounts.append(UserAccount(user, rounds, s.value, s.exact, e, why))
    return PosthocReport(delta, z, planned_sens, planned_eps, accounts, f"gaussian-{accountant}",
                         time.perf_counter() - started)
