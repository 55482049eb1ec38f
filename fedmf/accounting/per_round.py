"""Per-round privacy spend: epsilon after each round t = 1 … n.

After t rounds the adversary has seen the rows of C·X + Z released in rounds < t, i.e.
the prefix C_t = C[:R(t), :t] (R(t) = noise rows consumed by then; R(t) = t for square C),
and a user can only have taken part in rounds < t. So epsilon_t is the epsilon of one
Gaussian mechanism with sensitivity sens_t = sens(C_t) under the schema restricted to
rounds < t, at the noise actually added (std z·sens_planned): multiplier z·sens/sens_t
("Multi-Epoch MF", Thm 2.2 applied to the prefix; post-processing covers the prefix).
sens_t never exceeds sens_n (patterns and rows only grow with t), so the curve is
non-decreasing; it ends at the planned epsilon.

Exact sens_t for every t where a closed form applies under MinSep(b, k):
  * Toeplitz C with <= b bands, or with non-negative non-increasing coefficients:
    sens_t² = sum_{r<t} S_r², S = sum_{i<k} shift(c, i·b) ("Beyond Square Roots", Thm 1;
    Kalinin & Lampert 2024, Thm 2; the shifts starting at >= t do not reach rows < t);
  * banded C with <= b bands: VecSens over the prefix column norms (Choquette-Choo et al.
    2024, Alg. 3), vectorized over t.
Otherwise sens_t is computed at up to ``max_points`` checkpoints (exactly where
``fedmf.sensitivity`` has an exact method, else its sound upper bound, e.g. the Gram bound
for general C under MinSep with k > 1) and every other round takes the value of the next
checkpoint (an upper bound, since sens_t grows with t). ``ByRound.exact`` marks the rounds
whose epsilon rests on an exact sens_t; a method name ends in "-exact" only when all do.
Cyclic-Poisson sampling: epsilon_t composes ceil(t/b) subsampled Gaussians (same checkpoint
rule when there are more than ``max_points`` distinct counts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import sensitivity as _sens
from ..errors import ConfigTypeError
from . import cyclic_poisson, gaussian

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema
    from ..sensitivity import Sensitivity

__all__ = ["ByRound", "cyclic_poisson_curve", "unamplified_curve", "prefix_sensitivities"]


@dataclass
class ByRound:
    epsilons: np.ndarray  # epsilon after rounds 1 … n (index t-1)
    sensitivities: np.ndarray | None  # sens_t (un-amplified) or None
    method: str
    exact: np.ndarray  # per round: True where epsilon_t is the value itself, False where an upper bound
    rhos: np.ndarray | None = None  # ρ-zCDP after rounds 1 … n (un-amplified curves only)

    def to_dict(self) -> dict:
        return {"epsilon_by_round": self.epsilons.tolist(), "per_round_method": self.method,
                "per_round_exact": bool(np.all(self.exact))}


class _Prefix:
    """Duck-typed view of the first t rounds of a mechanism for ``fedmf.sensitivity``."""

    def __init__(self, mechanism: Mechanism, t: int, full: np.ndarray) -> None:
        rows = sum(mechanism.fresh_rows(s) for s in range(t))
        self.rounds = t
        self.kind = mechanism.kind
        self._matrix = full[:rows, :t]
        coef = mechanism.strategy_toeplitz
        self.strategy_toeplitz = None if coef is None or rows != t else coef
        self.strategy_bands = mechanism.strategy_bands if rows == t else None

    def strategy_matrix(self) -> np.ndarray:
        return self._matrix

    def strategy_columns(self, indices: Sequence[int]) -> np.ndarray:
        return self._matrix[:, list(indices)]

    def column_norms_sq(self) -> np.ndarray:
        return np.sum(self._matrix**2, axis=0)

    def gram(self) -> np.ndarray:
        return self._matrix.T @ self._matrix


def _toeplitz_closed_form(coef: np.ndarray, n: int, b: int, k: int) -> np.ndarray:
    """sens_t = ||S[:t]|| with S the shifted sum of ``fedmf.sensitivity.shifted_sum``
    ("Beyond Square Roots", Thm 1: the shifts starting at >= t do not reach rows < t)."""
    return np.sqrt(np.cumsum(_sens.shifted_sum(coef, n, b, k) ** 2))


def _banded_vecsens(mechanism: Mechanism, n: int, b: int, k: int, bands: int) -> np.ndarray:
    """sens_t for t = 1 … n of a banded C (<= b bands), O(n·(k + bands)).

    With <= b bands the columns of a b-min-sep pattern have disjoint supports, so
    sens_t² = max over patterns in [0, t) of sum_j w_t(j), w_t(j) = sum_{r<t} C[r, j]²
    (VecSens, Choquette-Choo et al. 2024). w_t(j) is the full column norm except for the
    last bands-1 columns, of which a pattern holds at most one (they are < b apart). With
    G[m, κ] = best sum of full norms over patterns in [0, m) with <= κ elements (forward
    DP G[m, κ] = max(G[m-1, κ], w(m-1) + G[m-b, κ-1])):
        sens_t² = max(G[t-L+1, k], max_{t-L < j < t} w_t(j) + G[j-b+1, k-1])."""
    full = np.asarray(mechanism.column_norms_sq(), dtype=np.float64)
    matrix = mechanism.strategy_matrix()
    g = np.zeros((n + 1, k + 1))
    for m in range(1, n + 1):
        g[m, 1:] = np.maximum(g[m - 1, 1:], full[m - 1] + g[max(m - b, 0), :-1])
    out = np.empty(n)
    for t in range(1, n + 1):
        best = g[max(t - bands + 1, 0), k]
        for j in range(max(t - bands + 1, 0), t):
            w = float(np.sum(matrix[j:t, j] ** 2))
            best = max(best, w + g[max(j - b + 1, 0), k - 1])
        out[t - 1] = math.sqrt(best)
    return out


def _checkpoints(n: int, max_points: int) -> np.ndarray:
    if n <= max_points:
        return np.arange(1, n + 1)
    pts = np.unique(np.round(np.linspace(1, n, max_points)).astype(int))
    return pts


def _fill(points: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Value of the next checkpoint >= t for every t = 1 … n."""
    idx = np.searchsorted(points, np.arange(1, n + 1), side="left")
    return values[idx]


def _generic(mechanism: Mechanism, schema: Schema, max_points: int) -> tuple[np.ndarray, str, np.ndarray]:
    from ..participation import FixedEpoch, MinSep, Observed

    n = mechanism.rounds
    full = mechanism.strategy_matrix()
    points = _checkpoints(n, max_points)
    values = np.empty(points.size)
    exact = np.zeros(points.size, dtype=bool)
    for j, t in enumerate(points):
        prefix = _Prefix(mechanism, int(t), full)
        if isinstance(schema, MinSep):
            if schema.participations(int(t)) == 1 or schema.min_sep > t:
                value, exact[j] = math.sqrt(float(np.max(prefix.column_norms_sq()))), True
            else:
                sens = _sens.minsep(prefix, MinSep(schema.min_sep, schema.participations(int(t))))
                value, exact[j] = sens.value, sens.exact
        elif isinstance(schema, (FixedEpoch, Observed)):
            pats = (schema.patterns() if isinstance(schema, FixedEpoch)
                    else [rounds for _, rounds in schema.rounds_by_user])
            results = [_sens.pattern_sensitivity(cols.T @ cols, _sens.gram_error(cols))
                       for cols in (prefix.strategy_columns(c) for c in ([r for r in p if r < t] for p in pats) if c)]
            worst = _sens._worst(results, "exact", "bound") if results else _sens.Sensitivity(0.0, "exact", True)
            value, exact[j] = worst.value, worst.exact
        else:
            raise ConfigTypeError(f"unknown schema {schema!r}")
        values[j] = value
    # rounds between checkpoints take the next checkpoint's value: an upper bound
    per_round = np.zeros(n, dtype=bool)
    per_round[points - 1] = exact
    name = "checkpoints" if points.size == n else f"checkpoints({points.size})"
    return _fill(points, values, n), name + ("-exact" if per_round.all() else "-upper-bound"), per_round


def _prefix_sensitivities(mechanism: Mechanism, schema: Schema,
                          max_points: int) -> tuple[np.ndarray, str, np.ndarray]:
    """sens_t, the method, and per round whether sens_t is exact (not only an upper bound)."""
    from ..participation import MinSep

    n = mechanism.rounds
    if isinstance(schema, MinSep):
        schema.validate(n)
        b, k = schema.min_sep, schema.participations(n)
        coef = mechanism.strategy_toeplitz
        bands = mechanism.strategy_bands
        square = mechanism.noise_rows == n
        if coef is not None and square and ((bands is not None and bands <= b) or k == 1
                                            or _sens.is_nonnegative_nonincreasing(coef)):
            sens_t = _toeplitz_closed_form(np.asarray(coef, dtype=np.float64), n, b, k)
            return sens_t, "toeplitz-closed-form", np.ones(n, dtype=bool)
        if bands is not None and bands <= b and square:
            return _banded_vecsens(mechanism, n, b, k, bands), "banded-exact", np.ones(n, dtype=bool)
    return _generic(mechanism, schema, max_points)


def prefix_sensitivities(mechanism: Mechanism, schema: Schema, max_points: int = 64) -> tuple[np.ndarray, str]:
    """sens_t for t = 1 … n (see the module docstring) and how they were obtained
    ("…-exact" only when every sens_t is exact)."""
    sens_t, method, _ = _prefix_sensitivities(mechanism, schema, max_points)
    return sens_t, method


def _monotone(eps: np.ndarray, final: float) -> np.ndarray:
    """Running maximum, capped at the final (planned) epsilon: both are valid upper bounds
    on a non-decreasing true curve."""
    out = np.minimum(np.maximum.accumulate(eps), final)
    out[-1] = final
    return out


def cyclic_poisson_curve(rounds: int, min_sep: int, probability: float, step_noise_multiplier: float, *,
                         delta: float, accountant: str, final: float | None, max_points: int) -> ByRound:
    """epsilon after t = 1 … n rounds of cyclic Poisson sampling: ceil(t/b) Poisson(q)-subsampled
    Gaussians with multiplier ``step_noise_multiplier`` (module docstring)."""
    n, b = rounds, min_sep
    counts = -(-np.arange(1, n + 1) // b)  # ceil(t/b)
    distinct = np.unique(counts)
    points = distinct if distinct.size <= max_points else _checkpoints(int(distinct[-1]), max_points)
    values = np.array([cyclic_poisson.epsilon(step_noise_multiplier, probability, int(c), delta, accountant)
                       for c in points])
    eps = values[np.searchsorted(points, counts, side="left")]
    if final is None:
        final = float(values[-1])
    method = "cyclic-poisson" + ("" if distinct.size <= max_points else f"-checkpoints({points.size})")
    curve = _monotone(eps, final)
    return ByRound(curve, None, method, np.isin(counts, points) & np.isclose(curve, eps, rtol=1e-12, atol=0.0))


def unamplified_curve(mechanism: Mechanism, schema: Schema, planned: Sensitivity, *, noise_multiplier: float,
                      std_per_clip: float, delta: float, accountant: str, noise_sensitivity: float | None,
                      final: float | None, max_points: int, count_noise_std: float | None = None) -> ByRound:
    """epsilon after t = 1 … n rounds of the un-amplified run: the Gaussian mechanism with
    sensitivity sens_t at noise std ``std_per_clip`` (module docstring); ``planned``: sens_n.
    ``count_noise_std``: adaptive clipping's count release composed in with the k_t = min(k, ceil(t/b))
    counts a user can have had by then (``count_release`` (1); each part at its own worst pattern,
    an upper bound that is the planned value at t = n)."""
    z, sens = noise_multiplier, planned.value
    sens_t, method, exact = _prefix_sensitivities(mechanism, schema, max_points)
    exact = exact & (sens_t <= sens)  # where capped at the planned sensitivity, that one decides
    sens_t = np.minimum(sens_t, sens)
    sens_t[-1] = sens
    exact[-1] = planned.exact
    with np.errstate(divide="ignore"):
        multipliers = np.where(sens_t > 0, std_per_clip / np.maximum(sens_t, 1e-300), np.inf)
    z_final = z if noise_sensitivity is None else std_per_clip / sens
    if count_noise_std is not None:
        from . import count_release

        n = mechanism.rounds
        k_t = [count_release.participations(schema, t) for t in range(1, n + 1)]
        multipliers = np.array([count_release.compose(float(m), count_noise_std, k)
                                for m, k in zip(multipliers.tolist(), k_t)])
        z_final = count_release.compose(z_final, count_noise_std, k_t[-1])
    if final is None:
        final = gaussian.epsilon(z_final, delta, accountant)
    if accountant == "pld":
        eps = gaussian.epsilons(multipliers, delta)
    else:
        cache: dict[float, float] = {}
        eps = np.array([0.0 if not np.isfinite(m) else cache.setdefault(m, gaussian.epsilon(m, delta, accountant))
                        for m in multipliers])
    curve = _monotone(eps, final)
    # ρ_t = 1/(2 z_t²) (Bun & Steinke 2016, Prop. 1.6), made monotone and capped like ε
    with np.errstate(divide="ignore"):
        rhos = _monotone(0.5 / np.square(multipliers), 0.5 / z_final**2)
    # the running maximum / final cap replaces a value only by an upper bound of it
    return ByRound(curve, sens_t, method, exact & np.isclose(curve, eps, rtol=1e-12, atol=0.0), rhos)
