"""MMCC: amplified epsilon of a matrix mechanism under Poisson sampling.

"Privacy Amplification for Matrix Mechanisms" (Choquette-Choo, Ganesh, Steinke, Thakurta,
ICLR 2024), Alg. 1 (MMCC) with Alg. 2 (ProbabilityTailBounds) and the practical s_{i,j} of
App. F.3. Release Cx + N(0, sigma^2) row by row, each user included in every round with
probability p; ||x_t|| <= 1 per user (clip-norm units). Row i, given rows < i, is dominated by
a product mixture of Gaussians (PMoG) whose column j has sensitivity C_ij with probability
p~_ij >= the posterior chance that the user took part in round j (Thm 4.3). Each PMoG becomes a
mixture of Gaussians (MoG) on a sensitivity grid (App. F.2); dp_accounting gives its privacy
loss distribution (both directions, add-or-remove adjacency) and the rows are composed.
Guarantee: (epsilon, delta1 + delta2)-DP, delta1 paying for the tail bounds (union bound),
delta2 the PLD's delta.

``sigma`` is the noise standard deviation in clip-norm units for the C given (the paper's
sigma); for a fedmf mechanism planned with noise multiplier z it is z * sensitivity.
C must be non-negative (Lemma C.3) and lower-triangular (adaptive rounds, Sec. 1.2).
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

from .. import checks
from ..errors import ConfigError

__all__ = ["MmccResult", "strategy", "tail_bounds", "sensitivity_pmf", "mog_pld", "mmcc", "epsilon", "lower_bound"]

#: sensitivity grid Delta_2 (App. F.2): every C_ij is rounded up to a multiple of it
GRID = 1e-3
#: dp_accounting PLD value_discretization_interval (the repository's reference setting)
DISCRETIZATION = 1e-4
#: MoG masses below this move up to the next kept sensitivity (notes pitfall 10)
TINY_MASS = 1e-12
#: p~ is rounded up to a multiple of this, so equal rows share one PLD (cache key)
_P_QUANTUM = 2.0 ** -40


@dataclass(frozen=True)
class MmccResult:
    """epsilon for (delta1 + delta2); ``distinct_rows``: row PLDs built (the rest reuse them
    by self-composition); ``max_ratio``: max p~_ij / p (1 = no posterior inflation)."""

    epsilon: float
    delta: float
    delta1: float
    delta2: float
    rows: int
    distinct_rows: int
    max_ratio: float
    sampling_probability: float
    sigma: float
    grid: float
    discretization: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def strategy(c: Any) -> np.ndarray:
    """C as a float64 array: a square array or a fedmf Mechanism; rejects C < 0 and C not
    lower-triangular."""
    if hasattr(c, "strategy_matrix"):
        matrix = np.asarray(c.strategy_matrix(), dtype=np.float64)
        if matrix.shape != (c.rounds, c.rounds):
            raise ConfigError(f"MMCC needs a square strategy C, {c.kind} has shape {matrix.shape}")
    else:
        matrix = np.asarray(c, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ConfigError(f"C must be a non-empty square matrix, got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise ConfigError("C must be finite")
    if np.any(matrix < 0):
        raise ConfigError(f"MMCC needs a non-negative C (Lemma C.3), min entry {matrix.min():.3g}")
    if np.any(np.triu(matrix, 1) != 0):
        raise ConfigError("MMCC needs a lower-triangular C (adaptive rounds): C has entries above the diagonal")
    return matrix


def _nontrivial_pairs(c: np.ndarray) -> int:
    """Pairs (i, j) with C_ij > 0 that are not the first non-zero of column j: nnz(C) - n when
    every column is used (Alg. 2 line 1); the other pairs have p~ = p exactly."""
    nonzero = c > 0
    return int(nonzero.sum() - nonzero.any(axis=0).sum())


@functools.lru_cache(maxsize=65536)
def _count_tail(m: int, p: float, dprime: float) -> int:
    """Smallest t with Pr[Binomial(m, p) > t] <= delta' (App. F.3)."""
    sf = stats.binom.sf(np.arange(m + 1), m, p)
    return int(np.argmax(sf <= dprime))


def tail_bounds(c: np.ndarray, p: float, sigma: float, delta1: float) -> np.ndarray:
    """p~_ij of Alg. 2 for a checked C (1 where C_ij = 0, as in line 4)."""
    n = c.shape[0]
    pairs = _nontrivial_pairs(c)
    out = np.ones_like(c)
    dprime = delta1 / (2 * pairs) if pairs else 1.0  # Alg. 2 line 1
    z = float(stats.norm.isf(dprime)) if pairs else 0.0  # Alg. 2 line 2: Phi^{-1}(1 - delta')
    gram = np.zeros((n, n))  # gram[j', j] = <C_{1:i-1, j'}, C_{1:i-1, j}>
    for i in range(n):
        cols = np.flatnonzero(c[i])
        if cols.size == 0:
            continue
        a2 = gram[cols, cols]
        tilde = np.full(cols.size, p)  # first non-zero of a column: epsilon_ij = 0, p~ = p
        seen = np.flatnonzero(a2 > 0)
        if seen.size and p < 1.0:
            block = gram[:i][:, cols[seen]]
            counts = (block > 0).sum(axis=0)
            top = np.cumsum(-np.sort(-block, axis=0), axis=0)
            t = np.array([_count_tail(int(m), p, dprime) for m in counts])
            s = np.where(t > 0, top[np.maximum(t - 1, 0), np.arange(seen.size)], 0.0)  # F.3: t largest
            a2s = a2[seen]
            eps = z * np.sqrt(a2s) / sigma + (2.0 * s - a2s) / (2.0 * sigma**2)  # Alg. 2 line 7
            # Alg. 2 line 8 as 1/(1 + (1-p)/p e^-eps); eps >= 0 keeps p~ >= p, which only
            # loosens the bound (Cor. B.3) where the t = 0 case would dip below p
            tilde[seen] = 1.0 / (1.0 + (1.0 - p) / p * np.exp(-np.maximum(eps, 0.0)))
        elif seen.size:
            tilde[seen] = 1.0
        out[i, cols] = tilde
        gram[np.ix_(cols, cols)] += np.outer(c[i, cols], c[i, cols])
    return out


def sensitivity_pmf(row: np.ndarray, tilde: np.ndarray, grid: float = GRID,
                    tiny: float = TINY_MASS) -> tuple[np.ndarray, np.ndarray]:
    """The MoG of one PMoG row (Def. 4.2, App. F.2): the law of sum_j Bernoulli(p~_j) * C_j with
    every C_j rounded up to the grid (Lemma B.2) and masses below ``tiny`` moved up to the next
    kept point (Cor. B.3). Returns (sensitivities, probabilities), zero-mass points dropped."""
    cols = np.flatnonzero(row)
    steps = np.ceil(row[cols] / grid).astype(np.int64)
    steps += steps * grid < row[cols]
    pmf = np.zeros(int(steps.sum()) + 1)
    pmf[0] = 1.0
    length = 1
    for k, q in zip(steps, np.minimum(tilde[cols], 1.0)):
        shifted = q * pmf[:length]
        pmf[:length] *= 1.0 - q
        pmf[k:k + length] += shifted
        length += k
    carry = 0.0
    last = len(pmf) - 1
    for idx in np.flatnonzero(pmf):
        mass = pmf[idx] + carry
        if mass < tiny and idx != last:
            pmf[idx], carry = 0.0, mass
        else:
            pmf[idx], carry = mass, 0.0
    pmf[last] += carry
    keep = np.flatnonzero(pmf > 0)
    return keep * grid, pmf[keep]


def _logsumexp(terms: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis (the MoG privacy loss, Sec. 4.1)."""
    top = terms.max(axis=-1)
    return top + np.log(np.exp(terms - top[..., None]).sum(axis=-1))


def _fast_mixture_loss():
    """dp_accounting's MixtureGaussianPrivacyLoss with its bisection vectorized: the library
    recurses once per interval in Python (millions of scalar calls per PLD); this runs every
    privacy loss's bisection at once over the same intervals and returns the same result, the
    smallest multiple of ``precision`` at or above the inverse (pessimistic, App. F.1)."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    class FastMixtureGaussianPrivacyLoss(plm.MixtureGaussianPrivacyLoss):
        def _losses(self, x: np.ndarray) -> np.ndarray:
            scaled = np.multiply.outer(x, self.sensitivities) / self._variance
            if self.adjacency_type == plm.AdjacencyType.ADD:
                return -_logsumexp(self._precompute_privacy_loss_constants + scaled)
            return _logsumexp(self._precompute_privacy_loss_constants - scaled)

        def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
            losses = np.asarray(privacy_losses, dtype=np.float64)
            lo = np.full(losses.shape, float(bounds[0]))
            hi = np.full(losses.shape, float(bounds[1]))
            active = np.flatnonzero(hi - lo > precision)
            while active.size:
                mid = (lo[active] + hi[active]) / 2
                points, where = np.unique(mid, return_inverse=True)
                split = self._losses(points)[where]
                below = losses[active] < split  # the loss at mid is still above: go right
                lo[active[below]] = mid[below]
                hi[active[~below]] = mid[~below]
                active = active[hi[active] - lo[active] > precision]
            return np.floor(hi / precision) * precision

    return FastMixtureGaussianPrivacyLoss


def mog_pld(sigma: float, sensitivities: np.ndarray, probabilities: np.ndarray,
            discretization: float = DISCRETIZATION):
    """PLD of MoG(probabilities, sensitivities) with noise sigma, both directions, pessimistic
    connect-the-dots: ``from_mixture_gaussian_mechanism`` with a faster inverse privacy loss."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.pld import privacy_loss_mechanism as plm

    loss_class = _fast_mixture_loss()

    def pmf(adjacency):
        loss = loss_class(sigma, list(sensitivities), list(probabilities), pessimistic_estimate=True,
                          adjacency_type=adjacency)
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(
            loss, pessimistic_estimate=True, value_discretization_interval=discretization, use_connect_dots=True)

    return pld_lib.PrivacyLossDistribution(pmf(plm.AdjacencyType.REMOVE), pmf(plm.AdjacencyType.ADD))


def _check(p: float, sigma: float, grid: float, discretization: float) -> tuple[float, float]:
    p = checks.probability("sampling probability", p)
    sigma = checks.positive("sigma", sigma)
    checks.positive("sensitivity grid", grid)
    checks.positive("discretization", discretization)
    return p, sigma


def _compose(c: np.ndarray, tilde: np.ndarray, sigma: float, delta2: float, grid: float,
             discretization: float) -> tuple[float, int]:
    """epsilon(delta2) of the composed row PMoGs (Alg. 1 lines 2-4), identical rows built once."""
    tilde = np.minimum(1.0, np.ceil(tilde / _P_QUANTUM) * _P_QUANTUM)
    counts: dict[tuple[bytes, bytes], int] = {}
    mogs: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray]] = {}
    for i in range(c.shape[0]):
        if not np.any(c[i] > 0):
            continue  # sensitivity 0: the row releases nothing about the user
        sens, probs = sensitivity_pmf(c[i], tilde[i], grid)
        key = (sens.tobytes(), probs.tobytes())
        counts[key] = counts.get(key, 0) + 1
        mogs.setdefault(key, (sens, probs))
    total = None
    for key, count in counts.items():
        sens, probs = mogs[key]
        pld = mog_pld(sigma, sens, probs, discretization)
        if count > 1:
            pld = pld.self_compose(count)
        total = pld if total is None else total.compose(pld)
    if total is None:
        return 0.0, 0
    return float(total.get_epsilon_for_delta(delta2)), len(counts)


def mmcc(c: Any, p: float, sigma: float, delta1: float, delta2: float, *, grid: float = GRID,
         discretization: float = DISCRETIZATION) -> MmccResult:
    """MMCC(C, p, sigma, delta1, delta2) (Alg. 1, Thm 4.3): (epsilon, delta1 + delta2)-DP.
    Without non-trivial pairs (nnz(C) - n = 0, e.g. C diagonal) delta1 is unused: reported as 0."""
    started = time.perf_counter()
    matrix = strategy(c)
    p, sigma = _check(p, sigma, grid, discretization)
    delta1 = checks.open_unit("delta1", delta1)
    delta2 = checks.open_unit("delta2", delta2)
    if _nontrivial_pairs(matrix) == 0:
        delta1 = 0.0
    tilde = tail_bounds(matrix, p, sigma, delta1)
    eps, distinct = _compose(matrix, tilde, sigma, delta2, grid, discretization)
    ratio = float(tilde[matrix > 0].max() / p) if np.any(matrix > 0) else 1.0
    return MmccResult(eps, delta1 + delta2, delta1, delta2, int(np.any(matrix > 0, axis=1).sum()), distinct,
                      ratio, p, sigma, grid, discretization, time.perf_counter() - started)


def epsilon(c: Any, p: float, sigma: float, delta: float, *, delta1_fraction: float = 0.5,
            grid: float = GRID, discretization: float = DISCRETIZATION) -> MmccResult:
    """MMCC epsilon for total delta = delta1 + delta2, delta1 = delta1_fraction * delta; when C
    is diagonal (no tail bounds) all of delta goes to delta2."""
    delta = checks.open_unit("delta", delta)
    fraction = checks.number("delta1 fraction", delta1_fraction)
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"delta1 fraction must lie in (0, 1), got {delta1_fraction!r}")
    matrix = strategy(c)
    if _nontrivial_pairs(matrix) == 0:
        return mmcc(matrix, p, sigma, delta / 2, delta, grid=grid, discretization=discretization)
    return mmcc(matrix, p, sigma, fraction * delta, (1.0 - fraction) * delta, grid=grid,
                discretization=discretization)


def lower_bound(c: Any, p: float, sigma: float, delta2: float, *, grid: float = GRID,
                discretization: float = DISCRETIZATION) -> float:
    """The same composition with p~ = p (rows treated as independent, Sec. 4.2): MMCC's epsilon
    at delta2 is never below it (p~ >= p, Cor. B.3)."""
    matrix = strategy(c)
    p, sigma = _check(p, sigma, grid, discretization)
    delta2 = checks.open_unit("delta2", delta2)
    return _compose(matrix, np.full(matrix.shape, p), sigma, delta2, grid, discretization)[0]
