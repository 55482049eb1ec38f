"""Post-hoc accounting from the observed participation pattern (rounds per user): the one
implementation, used directly and by the audit (``fedmf.accounting.run_privacy``).

Each user u is accounted with their OWN sensitivity s_u over the rounds π they took part
in, at the noise actually added, std/ζ = z·sens_noise (sens_noise defaults to the planned
schema's sensitivity; the absolute std σ = z·ζ·sens_noise, and ε depends only on the ratio
σ/(ζ·s_u)): one Gaussian mechanism with multiplier z·sens_noise/s_u ("Multi-Epoch MF",
Thm 2.2, for the fixed pattern of user u; individual accounting as in "Scaling up BandMF"
App. H / Feldman & Zrnic 2021). The participation pattern must not depend on the user's data
(in FL it is the scheduler's choice and the device's availability), and it is treated as
public.

Sensitivities, for all users at once: by the end of round t the run released the first
R(t) = Σ_{s<=t} fresh_rows(s) noisy rows of C·X + Z, so

    s_π(t)² <= Σ_{r<R(t)} (Σ_{i∈π, i<=t} |C_ri|)²                                     (1)

exact when C >= 0 entry-wise (the all-ones direction is the worst, "Multi-Epoch MF", Eq. 3 /
Cor. 2.1). (1) is P·|C|ᵀ for the sparse user-by-round matrix P, in chunks of users (about
nnz(P)·rows multiply-adds). For C with negative entries each user's full-horizon value is
the smaller of (1) and ``fedmf.sensitivity.pattern_sensitivity`` on the Gram block (exact
where that one is). A strategy too large to hold densely is handled user by user
(``fedmf.sensitivity.observed``), without the per-round curve.

With adaptive clipping (``count_noise_std`` σ_b) each user's own k_u released counts are composed in:
1/z_u² = s_u²/(z·sens_noise)² + k_u/σ_b² (``count_release`` (1)).

Users whose rounds break the planned schema (too many, too close, outside their slot, or a
sensitivity above the planned one) are flagged and accounted with their own, larger
sensitivity — never with the planned one. The run's guarantee is the worst user's epsilon.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from scipy import sparse

from .. import checks
from .. import sensitivity as _sens
from ..errors import ConfigError, FedmfError
from ..participation import FixedEpoch, MinSep, Observed
from . import gaussian

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema

__all__ = ["UserAccount", "PosthocReport", "ObservedSensitivities", "account_observed", "account_contributions",
           "observed_sensitivities", "breaks_schema", "release_rows", "user_multipliers", "MAX_DENSE_ENTRIES"]

MAX_DENSE_ENTRIES = 100_000_000  # C (rows x rounds) is handled densely up to this size: about 800 MB
_USER_CHUNK = 2048
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
    planned_sensitivity_method: str = ""
    planned_sensitivity_exact: bool = False
    sensitivity_by_round: np.ndarray | None = None  # (n,) the worst user's (1) after each round (by_round)
    epsilon_by_round: np.ndarray | None = None  # (n,) its epsilon

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

    def sensitivities(self) -> np.ndarray:
        return np.array([u.sensitivity for u in self.users])

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


@dataclass(frozen=True)
class ObservedSensitivities:
    values: np.ndarray  # (U,) each user's sensitivity over all their recorded rounds
    exact: np.ndarray  # (U,) bool: the value is exact (else a sound upper bound)
    worst_by_round: np.ndarray | None  # (n,) max over users of (1) after each round (by_round=True)


def breaks_schema(rounds: tuple[int, ...], schema: Schema, n: int) -> str | None:
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
    raise ConfigError(f"post-hoc accounting needs a planned MinSep or FixedEpoch schema, got {schema!r}")


def release_rows(mechanism: Mechanism) -> np.ndarray:
    """R(t): how many noise rows have been released by the end of round t."""
    n = mechanism.rounds
    if mechanism.noise_rows == n:
        return np.arange(1, n + 1)
    return np.cumsum([mechanism.fresh_rows(t) for t in range(n)])


def _user_blocks(users: np.ndarray, rounds: np.ndarray, n_users: int, n: int):
    """Yield (start, stop, sparse (stop-start, n) 0/1 participation rows) for chunks of users."""
    for start in range(0, n_users, _USER_CHUNK):
        stop = min(start + _USER_CHUNK, n_users)
        lo, hi = np.searchsorted(users, [start, stop])
        yield start, stop, sparse.csr_matrix((np.ones(hi - lo), (users[lo:hi] - start, rounds[lo:hi])),
                                             shape=(stop - start, n))


def _abs_bound(mechanism: Mechanism, c: np.ndarray, users: np.ndarray, rounds: np.ndarray, n_users: int,
               by_round: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(1) for every user at the end of the run, and its maximum over users after each round.

    A sparse-sparse product when |C| is sparse (banded, tree), sparse-dense otherwise
    (measured faster than FFT convolution for ~20 participations)."""
    n = mechanism.rounds
    final_sq = np.zeros(n_users)
    worst_sq = np.zeros(n) if by_round else None
    if n_users == 0:
        return final_sq, worst_sq
    rows = release_rows(mechanism) if by_round and mechanism.noise_rows != n else None
    c_abs = np.abs(c)
    density = np.count_nonzero(c_abs) / max(c_abs.size, 1)
    c_abs_t = sparse.csr_matrix(c_abs.T) if density < 0.2 else np.ascontiguousarray(c_abs.T)
    for start, stop, block in _user_blocks(users, rounds, n_users, n):
        v = block @ c_abs_t  # (chunk, rows of C)
        v = v.toarray() if sparse.issparse(v) else np.asarray(v)
        np.square(v, out=v)
        if not by_round:
            final_sq[start:stop] = v.sum(axis=1)
            continue
        np.cumsum(v, axis=1, out=v)
        s = v if rows is None else v[:, rows - 1]  # (chunk, n)
        np.maximum(worst_sq, s.max(axis=0), out=worst_sq)
        final_sq[start:stop] = s[:, -1]
    return np.sqrt(final_sq), None if worst_sq is None else np.sqrt(worst_sq)


def observed_sensitivities(mechanism: Mechanism, users: np.ndarray, rounds: np.ndarray, n_users: int, *,
                           by_round: bool = False) -> ObservedSensitivities:
    """Every user's sensitivity over their recorded rounds (see the module docstring).

    ``users``/``rounds``: one entry per participation, sorted by user then round, users
    numbered 0 … n_users-1 (a user may have none). ``by_round`` adds the worst user's value
    of (1) after each round (needs C densely: at most ``MAX_DENSE_ENTRIES`` entries)."""
    users = np.asarray(users, dtype=np.int64)
    rounds = np.asarray(rounds, dtype=np.int64)
    n, m = mechanism.rounds, mechanism.noise_rows
    bounds = np.searchsorted(users, np.arange(n_users + 1))
    exact = np.ones(n_users, dtype=bool)
    if m * n > MAX_DENSE_ENTRIES:
        if by_round:
            raise FedmfError(f"the per-round curve needs the strategy matrix densely and {m} x {n} is too large "
                             f"(limit {MAX_DENSE_ENTRIES} entries)")
        values = np.zeros(n_users)
        cache: dict[bytes, _sens.Sensitivity] = {}
        for u in range(n_users):
            pi = rounds[bounds[u] : bounds[u + 1]]
            if pi.size:
                key = pi.tobytes()
                if key not in cache:
                    cache[key] = _sens.observed(mechanism, pi.tolist())
                values[u], exact[u] = cache[key].value, cache[key].exact
        return ObservedSensitivities(values, exact, None)
    c = np.asarray(mechanism.strategy_matrix(), dtype=np.float64)
    values, worst = _abs_bound(mechanism, c, users, rounds, n_users, by_round)
    if not np.all(c >= -1e-12 * max(1.0, float(np.abs(c).max(initial=0.0)))):
        # (1) is only a bound: the Gram block's value where it is smaller or exact
        gram = mechanism.gram()
        cache = {}
        for u in range(n_users):
            pi = rounds[bounds[u] : bounds[u + 1]]
            if pi.size:
                key = pi.tobytes()
                if key not in cache:
                    cache[key] = _sens.pattern_sensitivity(gram[np.ix_(pi, pi)])
                values[u] = min(values[u], cache[key].value)
                exact[u] = cache[key].exact
    return ObservedSensitivities(values, exact, worst)


def user_multipliers(sens: np.ndarray, std_over_clip: float, counts: np.ndarray | None,
                     count_noise_std: float | None) -> np.ndarray:
    """The Gaussian multiplier std_over_clip / sens for each sensitivity (0: inf), composed with the
    ``counts`` count releases of adaptive clipping when ``count_noise_std`` is set (``count_release`` (1))."""
    sens = np.asarray(sens, dtype=np.float64)
    with np.errstate(divide="ignore"):
        multipliers = np.where(sens > 0, std_over_clip / np.maximum(sens, 1e-300), np.inf)
    if count_noise_std is None:
        return multipliers
    from . import count_release

    return np.array([count_release.compose(z, count_noise_std, float(k))
                     for z, k in zip(multipliers.tolist(), np.asarray(counts).tolist())])


def _epsilons(sens: np.ndarray, std_over_clip: float, delta: float, accountant: str,
              counts: np.ndarray | None = None, count_noise_std: float | None = None) -> np.ndarray:
    """ε of a Gaussian with multiplier std_over_clip / sens, for each sensitivity (0: ε = 0), with
    ``counts`` count releases composed in when ``count_noise_std`` is set."""
    if np.asarray(sens).size == 0:
        return np.zeros(0)
    multipliers = user_multipliers(sens, std_over_clip, counts, count_noise_std)
    if accountant == "pld":
        return gaussian.epsilons(multipliers, delta)
    memo: dict[float, float] = {}
    return np.array([0.0 if not np.isfinite(z) else memo.setdefault(z, gaussian.epsilon(z, delta, accountant))
                     for z in multipliers.tolist()])


def _check_contributions(users: np.ndarray, rounds: np.ndarray, n_users: int, n: int, labels: Sequence[str]) -> None:
    if users.shape != rounds.shape or users.ndim != 1:
        raise ConfigError("users and rounds must be 1-D arrays of the same length (one entry per participation)")
    if len(labels) != n_users:
        raise ConfigError(f"labels must name each of the {n_users} users, got {len(labels)}")
    if users.size == 0:
        return
    if users[0] < 0 or users[-1] >= n_users or np.any(np.diff(users) < 0):
        raise ConfigError(f"users must be sorted and lie in [0, {n_users})")
    bad = (rounds < 0) | (rounds >= n)
    if np.any(bad):
        raise ConfigError(f"user {labels[int(users[np.argmax(bad)])]!r} has a round outside [0, {n})")
    same = users[1:] == users[:-1]
    if np.any(same & (rounds[1:] <= rounds[:-1])):
        u = int(users[1:][np.argmax(same & (rounds[1:] <= rounds[:-1]))])
        raise ConfigError(f"user {labels[u]!r}: rounds must be increasing (listed twice in one round?)")


def _suspects(schema: MinSep | FixedEpoch, users: np.ndarray, rounds: np.ndarray, bounds: np.ndarray,
              n: int) -> np.ndarray:
    """Users that may break ``schema`` (``breaks_schema`` decides, user by user)."""
    n_users = len(bounds) - 1
    counts = np.diff(bounds)
    if isinstance(schema, MinSep):
        suspect = counts > schema.participations(n)
        same = users[1:] == users[:-1]
        close = same & (rounds[1:] - rounds[:-1] < schema.min_sep)
        suspect[users[1:][close]] = True
        return suspect
    suspect = counts > schema.max_participations
    if users.size:
        slot = rounds % schema.min_sep
        first = slot[np.minimum(bounds[:-1], users.size - 1)]
        moved = np.zeros(n_users, dtype=bool)
        np.logical_or.at(moved, users, slot != first[users])
        suspect |= moved
    return suspect


def account_contributions(mechanism: Mechanism, noise_multiplier: float, delta: float, planned: Schema,
                          users: np.ndarray, rounds: np.ndarray, labels: Sequence[str], *, accountant: str = "pld",
                          noise_sensitivity: float | None = None, by_round: bool = False,
                          count_noise_std: float | None = None) -> PosthocReport:
    """``account_observed`` on arrays: ``users``/``rounds`` one entry per participation, sorted
    by user then round, users numbered 0 … len(labels)-1 and named by ``labels``. ``by_round``
    adds the worst user's sensitivity and ε after each round (``sensitivity_by_round``,
    ``epsilon_by_round``). ``count_noise_std``: σ_b of adaptive clipping's count release, or σ_unit of the
    round's extra Gaussian releases (``fedmf.accounting.releases``: ``RunPlan.extra_noise_std``); each
    user's actual participations k_u add k_u/σ² to 1/z² (``count_release`` (1))."""
    from . import count_release

    started = time.perf_counter()
    count_noise_std = count_release.check_count_noise_std(count_noise_std)
    z = checks.positive("noise multiplier", noise_multiplier)
    delta = checks.open_unit("delta", delta)
    gaussian.check_accountant(accountant)
    if not isinstance(planned, (MinSep, FixedEpoch)):
        raise ConfigError(f"post-hoc accounting needs a planned MinSep or FixedEpoch schema, got {planned!r}")
    n = mechanism.rounds
    users = np.asarray(users, dtype=np.int64)
    rounds = np.asarray(rounds, dtype=np.int64)
    n_users = len(labels)
    _check_contributions(users, rounds, n_users, n, labels)
    plan = _sens.sensitivity(mechanism, planned)
    planned_sens = plan.value
    noise_sens = planned_sens if noise_sensitivity is None else checks.positive("noise sensitivity", noise_sensitivity)
    std_over_clip = z * noise_sens  # the noise std in units of the clip norm: sigma / clip_norm
    bounds = np.searchsorted(users, np.arange(n_users + 1))
    counts = np.diff(bounds)
    planned_z = std_over_clip / planned_sens
    if count_noise_std is not None:
        planned_z = count_release.compose(planned_z, count_noise_std, count_release.participations(planned, n))
    planned_eps = gaussian.epsilon(planned_z, delta, accountant)
    observed = observed_sensitivities(mechanism, users, rounds, n_users, by_round=by_round)
    eps = _epsilons(observed.values, std_over_clip, delta, accountant, counts, count_noise_std)
    suspect = _suspects(planned, users, rounds, bounds, n)
    above = observed.values > planned_sens * (1 + _RTOL)
    accounts = []
    for u in range(n_users):
        pi = tuple(rounds[bounds[u] : bounds[u + 1]].tolist())
        s = float(observed.values[u])
        why = breaks_schema(pi, planned, n) if suspect[u] else None
        if why is None and above[u]:
            why = f"sensitivity {s:.6g} above the planned {planned_sens:.6g}"
        e = float(eps[u])
        # a conforming user can never be worse off than planned (their sensitivity is at most the
        # planned one); the cap only removes the last-digit difference of the two solvers
        if why is None and s <= planned_sens:
            e = min(e, planned_eps)
        accounts.append(UserAccount(str(labels[u]), pi, s, bool(observed.exact[u]), e, why))
    worst = observed.worst_by_round
    extra: dict = {}
    worst_counts = None
    if count_noise_std is not None:
        extra = {"count_noise_std": count_noise_std}
        if worst is not None:  # the most participations any user had after each round (with the worst
            worst_counts = np.zeros(n, dtype=np.int64)  # sensitivity: each at its own worst, an upper bound)
            np.maximum.at(worst_counts, rounds, np.arange(users.size) - bounds[users] + 1)
            worst_counts = np.maximum.accumulate(worst_counts)
    return PosthocReport(
        delta, z, planned_sens, planned_eps, accounts, f"gaussian-{accountant}", time.perf_counter() - started,
        extra=extra, planned_sensitivity_method=plan.method, planned_sensitivity_exact=plan.exact,
        sensitivity_by_round=worst,
        epsilon_by_round=None if worst is None else _epsilons(worst, std_over_clip, delta, accountant, worst_counts,
                                                              count_noise_std),
    )


def account_observed(mechanism: Mechanism, noise_multiplier: float, delta: float,
                     observed: Observed | Mapping[str, Iterable[int]], planned: Schema, *,
                     accountant: str = "pld", noise_sensitivity: float | None = None,
                     count_noise_std: float | None = None) -> PosthocReport:
    """Per-user epsilon from the observed rounds of every user (see the module docstring).
    ``noise_sensitivity`` defaults to the planned schema's sensitivity (the noise scale);
    ``count_noise_std``: σ_b of adaptive clipping's count release, composed with each user's rounds."""
    if not isinstance(observed, Observed):
        observed = Observed.from_mapping(observed)
    observed.validate(mechanism.rounds)
    labels = [user for user, _ in observed.rounds_by_user]
    counts = [len(r) for _, r in observed.rounds_by_user]
    users = np.repeat(np.arange(len(labels), dtype=np.int64), counts)
    rounds = np.fromiter((t for _, r in observed.rounds_by_user for t in r), dtype=np.int64, count=sum(counts))
    return account_contributions(mechanism, noise_multiplier, delta, planned, users, rounds, labels,
                                 accountant=accountant, noise_sensitivity=noise_sensitivity,
                                 count_noise_std=count_noise_std)
