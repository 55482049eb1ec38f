"""Sensitivity of a strategy matrix C under a participation schema.

sens(C) = sup over one user's neighbouring streams of ||C (x - x')||_F, with each
round's difference bounded by 1 in l2 (Multi-Epoch MF, Definition 1). Every function
returns a ``Sensitivity`` that says how it was obtained and whether it is exact.
Closed forms are only applied when their conditions hold; otherwise a sound upper bound
is used and ``exact`` is False.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError, ConfigTypeError
from .participation import FixedEpoch, MinSep, Observed, Schema

if TYPE_CHECKING:
    from .mechanisms.base import Mechanism

__all__ = [
    "Sensitivity",
    "max_over_patterns",
    "toeplitz_minsep",
    "shifted_sum",
    "banded_minsep",
    "gram_upper_bound",
    "pattern_sensitivity",
    "fixed_epoch",
    "observed",
    "sensitivity",
    "exhaustive_minsep",
    "is_nonnegative_nonincreasing",
]

_TOL = 1e-12


@dataclass(frozen=True)
class Sensitivity:
    value: float
    method: str
    exact: bool

    def to_dict(self) -> dict:
        return {"sensitivity": self.value, "sensitivity_method": self.method, "sensitivity_exact": self.exact}


def max_over_patterns(x: np.ndarray, min_sep: int, max_participations: int) -> np.ndarray:
    """max_u <x, u> over 0/1 vectors u whose support is a b-min-sep set of at most k
    indices, for each row of x (last axis). Dynamic program, O(n·k) per row.

    Source: "(Amplified) Banded Matrix Factorization" (Choquette-Choo et al. 2024,
    arXiv 2306.08153), Alg. 3 (VecSens): F[i, k] = max(x_i + F[i+b, k-1], F[i+1, k]).
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    f = np.zeros(x.shape[:-1] + (n + min_sep,))
    for _ in range(max_participations):
        f[..., :n] = x + f[..., min_sep : min_sep + n]
        f = np.maximum.accumulate(f[..., ::-1], axis=-1)[..., ::-1]
    return f[..., 0]


def is_nonnegative_nonincreasing(coefficients: np.ndarray) -> bool:
    c = np.asarray(coefficients, dtype=np.float64)
    scale = np.max(np.abs(c)) if c.size else 0.0
    tol = _TOL * scale
    return bool(np.all(c >= -tol) and np.all(np.diff(c) <= tol))


def toeplitz_minsep(coefficients: np.ndarray, n: int, min_sep: int, max_participations: int) -> Sensitivity:
    """Exact MinSep sensitivity of a lower-triangular Toeplitz C with non-negative,
    non-increasing coefficients c_0, c_1, … (zero beyond the array): the worst user takes
    part in rounds 0, b, 2b, … ("Beyond Square Roots", Theorem 1; Kalinin & Lampert 2024,
    Thm 2):  sens = || sum_{i<k} shift(c, i·b) ||_2, truncated to n rows.

    Raises ValueError when the coefficients violate the theorem's conditions.
    """
    c = np.zeros(n)
    coef = np.asarray(coefficients, dtype=np.float64)[:n]
    c[: coef.size] = coef
    if not is_nonnegative_nonincreasing(c):
        raise ConfigError("Toeplitz closed form needs non-negative, non-increasing coefficients")
    return Sensitivity(float(np.linalg.norm(shifted_sum(c, n, min_sep, max_participations))),
                       "toeplitz-closed-form", True)


def shifted_sum(coefficients: np.ndarray, n: int, min_sep: int, max_participations: int) -> np.ndarray:
    """S = sum_{i<k} shift(c, i·b), truncated to n rows: C·x for the Toeplitz C with first
    column c and the pattern x = rounds 0, b, 2b, … ("Beyond Square Roots", Theorem 1)."""
    c = np.zeros(n)
    coef = np.asarray(coefficients, dtype=np.float64)[:n]
    c[: coef.size] = coef
    s = np.zeros(n)
    for i in range(max_participations):
        start = i * min_sep
        if start >= n:
            break
        s[start:] += c[: n - start]
    return s


def banded_minsep(column_norms_sq: np.ndarray, num_bands: int, min_sep: int, max_participations: int) -> Sensitivity:
    """Exact MinSep sensitivity of a lower-triangular C with ``num_bands`` <= b bands.

    The columns of two participations >= b apart have disjoint supports, so
    sens^2 = max_pi sum_{i in pi} ||C e_i||^2, found by VecSens (Choquette-Choo et al.
    2024, Sec. 4; exact for vector-valued updates too since the columns are orthogonal).
    """
    if num_bands > min_sep:
        raise ConfigError(f"banded closed form needs bands <= min_sep, got {num_bands} > {min_sep}")
    value = max_over_patterns(np.asarray(column_norms_sq), min_sep, max_participations)
    return Sensitivity(float(np.sqrt(value)), "banded-exact", True)


def gram_upper_bound(gram: np.ndarray, min_sep: int, max_participations: int) -> Sensitivity:
    """Sound upper bound for any C from X = C^T C: for each row the best pattern of
    |X_ij|, then the best pattern over those row maxima ("(Amplified) Banded MF",
    arXiv 2306.08153, Alg. 4). Valid for vector-valued updates since
    ||sum_i C_i g_i||^2 <= sum_ij |X_ij|."""
    rows = max_over_patterns(np.abs(gram), min_sep, max_participations)
    value = max_over_patterns(rows, min_sep, max_participations)
    return Sensitivity(float(np.sqrt(value)), "upper-bound", False)


#: largest pattern size whose 2^(k-1) sign vectors are enumerated (2048 at k = 12)
_SIGN_ENUMERATION = 12
#: an upper bound within this relative distance of a sign vector's value certifies that sign
#: vector optimal for every model dimension ("pattern-sdp-exact")
_CERTIFY_RTOL = 1e-9


@cache
def _sign_vectors(k: int) -> np.ndarray:
    """The 2^(k-1) vectors in {+-1}^k with first entry +1, shape (2^(k-1), k)."""
    tails = np.array(list(itertools.product((1.0, -1.0), repeat=k - 1))).reshape(-1, k - 1)
    return np.hstack([np.ones((tails.shape[0], 1)), tails])


def _dual_bound(x: np.ndarray, lam: np.ndarray) -> float:
    """Weak-duality upper bound on max tr(X Y) over PSD Y with diag(Y) <= 1, from any lam:
    tr(X Y) = tr((X - diag lam) Y) + sum lam_i Y_ii <= k·mu+ + sum lam_i+, with
    mu = lambda_max(X - diag lam) (Boyd & Vandenberghe, Sec. 5.2; the max-cut SDP dual,
    Goemans & Williamson 1995). A slack covers eigvalsh's backward error (Golub & Van Loan,
    Sec. 8.1: |error| <= c·k·eps·||.||_2)."""
    k = x.shape[0]
    shifted = x - np.diag(lam)
    mu = float(np.linalg.eigvalsh(shifted)[-1])
    slack = 4.0 * k * np.finfo(np.float64).eps * float(np.linalg.norm(shifted))
    return float(np.maximum(lam, 0.0).sum()) + k * max(mu + slack, 0.0)


def _mixing(x: np.ndarray, sweeps: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Approximate maximizer of tr(X V V^T) over V with unit rows (the SDP with Y = V V^T of rank
    <= k) by the mixing method (Wang, Chang & Kolter 2017, arXiv 1706.00476, Alg. 1): v_i <-
    g_i/||g_i||, g_i = sum_{j != i} X_ij v_j. Returns (V, lam) with lam_i = X_ii + ||g_i||, the
    dual variables of its KKT condition (diag(lam) - X) Y = 0. Deterministic start."""
    k = x.shape[0]
    v = np.random.default_rng(0).normal(size=(k, k))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    off = x - np.diag(np.diag(x))
    before = -np.inf
    for _ in range(sweeps):
        for i in range(k):
            g = off[i] @ v
            norm = float(np.linalg.norm(g))
            if norm > 0.0:
                v[i] = g / norm
        value = float(np.sum((x @ v) * v))
        if value - before <= 1e-15 * abs(value):
            break
        before = value
    return v, np.diag(x) + np.linalg.norm(off @ v, axis=1)


def _best_sign(x: np.ndarray, v: np.ndarray | None) -> np.ndarray:
    """A sign vector u maximizing u^T X u: all 2^(k-1) for k <= 12, else the best hyperplane
    rounding of V (Goemans & Williamson 1995) improved by single flips (a lower bound only)."""
    k = x.shape[0]
    if k <= _SIGN_ENUMERATION:
        signs = _sign_vectors(k)
        return signs[int(np.argmax(np.sum((signs @ x) * signs, axis=1)))]
    if v is None:
        raise RuntimeError(f"|pi| = {k} > {_SIGN_ENUMERATION} needs the SDP solution V to round")  # a caller's bug
    candidates = np.sign(v @ np.random.default_rng(1).normal(size=(k, 64))).T
    candidates[candidates == 0] = 1.0
    u = candidates[int(np.argmax(np.sum((candidates @ x) * candidates, axis=1)))].copy()
    while True:  # flipping u_i changes u^T X u by -4 u_i (sum_{j != i} X_ij u_j)
        gain = -4.0 * u * (x @ u - np.diag(x) * u)
        i = int(np.argmax(gain))
        if gain[i] <= 1e-15 * abs(float(u @ x @ u)):
            return u
        u[i] = -u[i]


_UNIT_ROUNDOFF = np.finfo(np.float64).eps / 2


def _gamma(n: int) -> float:
    """gamma_n = n·u / (1 − n·u): the relative error bound of an n-term float64 sum or inner
    product (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Lemma 3.1, Eq. 3.4)."""
    return n * _UNIT_ROUNDOFF / (1.0 - n * _UNIT_ROUNDOFF)


def gram_error(cols: np.ndarray) -> float:
    """A bound on sum_ij |fl(C^T C)_ij − (C^T C)_ij| for the pattern's columns C (m rows): each entry
    is an m-term inner product, |error_ij| <= gamma_m (|C|^T |C|)_ij (Higham, Eq. 3.5), and
    sum_ij (|C|^T |C|)_ij = ||(|C| 1)||^2."""
    cols = np.asarray(cols, dtype=np.float64)
    row_sums = np.abs(cols).sum(axis=1)
    return _gamma(cols.shape[0]) * float(row_sums @ row_sums)


def _sqrt_up(value: float) -> float:
    """sqrt rounded up (the square root is correctly rounded; one ulp up makes it an upper bound)."""
    return float(np.nextafter(np.sqrt(value), np.inf))


def pattern_sensitivity(sub_gram: np.ndarray, gram_err: float = 0.0) -> Sensitivity:
    """Sensitivity of one participation pattern pi from X = X[pi, pi], for updates of any
    dimension d: sens^2 = max sum_ij X_ij g_i.g_j over ||g_i|| <= 1, i.e. max tr(X Y) over Gram
    matrices Y of such vectors (Multi-Epoch MF, Definition 1 and App. H).

    Exact when X >= 0 (Eq. 3, Corollary 2.1: the all-ones direction is worst) or |pi| <= 2
    (Theorem H.1 case 1: the best sign vector is worst). Otherwise the least of sound upper
    bounds: the SDP dual bound (``_dual_bound``) at the best sign vector's multipliers
    lam = u o (X u) and at the mixing method's multipliers, sum |X_ij|, and |pi|·lambda_max
    (Theorem 2.1). When that bound is within 1e-9 (relative) of the best sign vector's value
    u^T X u it certifies u optimal for every d: "pattern-sdp-exact". "pattern-sdp" is exact for
    d >= |pi| up to the solver's accuracy, but above the scalar (d = 1) value.
    """
    x = np.asarray(sub_gram, dtype=np.float64)
    k = x.shape[0]
    if k == 0:
        return Sensitivity(0.0, "pattern-exact", True)
    # every value below is an upper bound: X's own rounding (``gram_err``, from ``gram_error`` of
    # the columns it was formed from) plus the k^2-term sums over X, and the square root rounded up
    slack = gram_err + _gamma(k * k) * float(np.abs(x).sum())
    if np.all(x >= 0):
        return Sensitivity(_sqrt_up(float(x.sum()) + slack), "pattern-exact", True)
    if k <= 2:
        signs = np.array([[1.0] * k, [1.0, -1.0][:k]])
        value = max(float(s @ x @ s) for s in signs)
        return Sensitivity(_sqrt_up(value + slack), "pattern-exact", True)
    mixing = None if k <= _SIGN_ENUMERATION else _mixing(x)
    u = _best_sign(x, None if mixing is None else mixing[0])
    lower = float(u @ x @ u)
    bounds = {"pattern-sdp-exact": _dual_bound(x, u * (x @ u))}
    if bounds["pattern-sdp-exact"] > lower * (1.0 + _CERTIFY_RTOL):
        if mixing is None:
            mixing = _mixing(x)
        bounds = {"pattern-sdp": min(bounds.pop("pattern-sdp-exact"), _dual_bound(x, mixing[1]))}
        bounds["pattern-bound"] = min(float(np.abs(x).sum()), k * float(np.linalg.eigvalsh(x)[-1]))
    method = min(bounds, key=bounds.__getitem__)
    value = bounds[method]
    exact = bool(value <= lower * (1.0 + _CERTIFY_RTOL))
    if exact:
        method = "pattern-sdp-exact"
    return Sensitivity(_sqrt_up(value + slack), method, exact)


def _worst(results: Sequence[Sensitivity], exact_name: str, bound_name: str) -> Sensitivity:
    worst = max(results, key=lambda s: s.value)
    exact = all(s.exact for s in results)
    return Sensitivity(worst.value, exact_name if exact else bound_name, exact)


def fixed_epoch(mechanism: Mechanism, schema: FixedEpoch) -> Sensitivity:
    """Sensitivity under FixedEpoch(k, b): the worst of the b patterns {j, j+b, …}
    (Multi-Epoch MF, Sec. 2, Eq. 3 per pattern)."""
    schema.validate(mechanism.rounds)
    results = []
    for pattern in schema.patterns():
        cols = mechanism.strategy_columns(pattern)
        results.append(pattern_sensitivity(cols.T @ cols, gram_error(cols)))
    return _worst(results, "fixed-epoch-exact", "fixed-epoch-bound")


def observed(mechanism: Mechanism, rounds: Sequence[int]) -> Sensitivity:
    """Sensitivity of one user's observed participation rounds."""
    cols = mechanism.strategy_columns(list(rounds))
    result = pattern_sensitivity(cols.T @ cols, gram_error(cols))
    return Sensitivity(result.value, "observed-exact" if result.exact else "observed-bound", result.exact)


_GRAM_LIMIT = 8192


def minsep(mechanism: Mechanism, schema: MinSep) -> Sensitivity:
    """MinSep(b, k) sensitivity, exact whenever a closed form's conditions hold."""
    n = mechanism.rounds
    schema.validate(n)
    b, k = schema.min_sep, schema.participations(n)
    if k == 1:
        # Single participation: the largest column norm (Li et al. 2015, Prop. 3).
        return Sensitivity(float(np.sqrt(np.max(mechanism.column_norms_sq()))), "single-participation", True)
    bands = mechanism.strategy_bands
    if bands is not None and bands <= b:
        return banded_minsep(mechanism.column_norms_sq(), bands, b, k)
    coef = mechanism.strategy_toeplitz
    if coef is not None and is_nonnegative_nonincreasing(coef):
        return toeplitz_minsep(coef, n, b, k)
    if n > _GRAM_LIMIT:
        raise ConfigError(
            f"no closed form applies to this strategy under min_sep={b}, and the general bound "
            f"needs an n x n Gram matrix (n={n} > {_GRAM_LIMIT})"
        )
    return gram_upper_bound(mechanism.gram(), b, k)


def sensitivity(mechanism: Mechanism, schema: Schema) -> Sensitivity:
    """Sensitivity of ``mechanism``'s strategy under any schema (for ``Observed``: the worst user)."""
    if isinstance(schema, MinSep):
        return minsep(mechanism, schema)
    if isinstance(schema, FixedEpoch):
        return fixed_epoch(mechanism, schema)
    if isinstance(schema, Observed):
        schema.validate(mechanism.rounds)
        results = [observed(mechanism, r) for _, r in schema.rounds_by_user if r]
        if not results:
            return Sensitivity(0.0, "observed-exact", True)
        return _worst(results, "observed-exact", "observed-bound")
    raise ConfigTypeError(f"unknown schema {schema!r}")


def _minsep_patterns(n: int, min_sep: int, k: int) -> itertools.chain:
    def extend(prefix: list[int], start: int):
        yield prefix
        if len(prefix) == k:
            return
        for t in range(start, n):
            yield from extend(prefix + [t], t + min_sep)

    return extend([], 0)


def exhaustive_minsep(strategy: np.ndarray, min_sep: int, max_participations: int | None = None) -> float:
    """Scalar (d = 1) sensitivity by brute force over every b-min-sep pattern and every
    sign vector (Multi-Epoch MF, Sec. 3.2). Exponential: for checking small cases only."""
    c = np.asarray(strategy, dtype=np.float64)
    n = c.shape[1]
    k = MinSep(min_sep, max_participations).participations(n)
    if n > 24:
        raise ConfigError("exhaustive sensitivity is limited to n <= 24")
    best = 0.0
    for pattern in _minsep_patterns(n, min_sep, k):
        if not pattern:
            continue
        cols = c[:, pattern]
        for tail in itertools.product((1.0, -1.0), repeat=len(pattern) - 1):
            u = np.array((1.0,) + tail)
            best = max(best, float(np.sum((cols @ u) ** 2)))
    return float(np.sqrt(best))
