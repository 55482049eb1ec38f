"""Property tests for fedmf.sensitivity: every closed form and bound against brute force
over all participation patterns (and sign vectors), for small n.

Scalar brute force (d = 1) maximizes ||C u||^2 over u in {-1, 0, 1}^n with a b-min-sep
support of at most k indices. For vector-valued updates the sensitivity is
max tr(X G) over Gram matrices G of unit vectors (X = C^T C); a block-coordinate ascent
over unit vectors gives a lower bound on it, which any sound bound must dominate.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedmf import sensitivity as S
from fedmf.mechanisms.base import InverseStream, Mechanism
from fedmf.mechanisms.identity import DpSgd
from fedmf.mechanisms.toeplitz import (
    BandedInverseFractionalRoot,
    BandedInverseSquareRoot,
    BandedSquareRoot,
    BandedToeplitz,
)
from fedmf.mechanisms.tree import TreeAggregation
from fedmf.participation import FixedEpoch, MinSep, Observed
from fedmf.workloads import Workload

SETTINGS = settings(
    derandomize=True, database=None, deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
RTOL = 1e-9


# ---------------------------------------------------------------------------------------
# brute force references (independent of fedmf.sensitivity)
# ---------------------------------------------------------------------------------------


def minsep_patterns(n: int, b: int, k: int) -> list[tuple[int, ...]]:
    """Every non-empty subset of range(n) of size <= k with consecutive gaps >= b."""
    out = []
    for size in range(1, min(k, n) + 1):
        for pattern in itertools.combinations(range(n), size):
            if all(j - i >= b for i, j in zip(pattern, pattern[1:])):
                out.append(pattern)
    return out


@cache
def _sign_vectors(n: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """All u in {-1,0,1}^n (first non-zero +1) with a b-min-sep support; with support sizes."""
    rows, sizes = [], []
    for pattern in minsep_patterns(n, b, n):
        for tail in itertools.product((1.0, -1.0), repeat=len(pattern) - 1):
            u = np.zeros(n)
            u[list(pattern)] = (1.0,) + tail
            rows.append(u)
            sizes.append(len(pattern))
    return np.array(rows), np.array(sizes)


def brute_scalar_sens(c: np.ndarray, b: int, k: int) -> float:
    """max ||C u|| over sign vectors u on b-min-sep supports of size <= k."""
    n = c.shape[1]
    u, sizes = _sign_vectors(n, b)
    u = u[sizes <= k]
    return float(np.sqrt(np.max(np.sum((c @ u.T) ** 2, axis=0))))


def brute_max_over_patterns(x: np.ndarray, b: int, k: int) -> np.ndarray:
    """max over b-min-sep index sets pi (|pi| <= k, the empty set included) of sum x[pi]."""
    n = x.shape[-1]
    patterns = minsep_patterns(n, b, k)
    ind = np.zeros((len(patterns) + 1, n))
    for row, p in enumerate(patterns, start=1):
        ind[row, list(p)] = 1.0
    return np.max(x @ ind.T, axis=-1)


def vector_sens_sq_lower_bound(x: np.ndarray, sweeps: int = 40) -> float:
    """Lower bound on max tr(X G) over Gram matrices G of k unit vectors (d = k) by block
    coordinate ascent (each step aligns g_i with sum_{j != i} X_ij g_j, which never
    decreases tr(X G)), started from the best sign vector (so the result is >= the scalar
    optimum) and from random unit vectors."""
    k = x.shape[0]
    signs = [np.array((1.0,) + s) for s in itertools.product((1.0, -1.0), repeat=k - 1)]
    best_sign = max(signs, key=lambda s: float(s @ x @ s))
    rng = np.random.default_rng(0)
    starts = [np.outer(best_sign, np.eye(k)[0])] + [rng.normal(size=(k, k)) for _ in range(3)]
    best = -np.inf
    for g in starts:
        g = g / np.linalg.norm(g, axis=1, keepdims=True)
        for _ in range(sweeps):
            for i in range(k):
                v = x[i] @ g - x[i, i] * g[i]
                if np.linalg.norm(v) > 1e-15:
                    g[i] = v / np.linalg.norm(v)
        best = max(best, float(np.trace(x @ g @ g.T)))
    return best


def max_sign_quadratic(x: np.ndarray) -> float:
    k = x.shape[0]
    return max(float(np.array((1.0,) + s) @ x @ np.array((1.0,) + s)) for s in itertools.product((1.0, -1.0), repeat=k - 1))


class DenseStrategy(Mechanism):
    """A test-only mechanism with an arbitrary dense strategy C (no fast paths)."""

    kind = "test-dense"

    def __init__(self, c: np.ndarray, workload: Workload = Workload()) -> None:
        self.c = np.asarray(c, dtype=np.float64)
        self.rounds = self.c.shape[1]
        self.workload = workload

    def params(self) -> dict:
        return {}

    @classmethod
    def from_params(cls, rounds, workload, params):  # pragma: no cover - not needed
        raise NotImplementedError

    def strategy_matrix(self) -> np.ndarray:
        return self.c.copy()

    def inverse_stream(self) -> InverseStream:  # pragma: no cover - not needed
        raise NotImplementedError


# ---------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------

seeds = st.integers(0, 2**32 - 1)


@st.composite
def n_b_k(draw, max_n=10):
    n = draw(st.integers(1, max_n))
    b = draw(st.integers(1, n + 2))
    k = draw(st.integers(1, n + 1))
    return n, b, k


def nonincreasing_nonnegative(rng: np.random.Generator, length: int, zeros: bool) -> np.ndarray:
    c = np.sort(rng.uniform(0.0, 1.0, length))[::-1].copy()
    c[0] = max(c[0], 0.05)
    if zeros and length > 1:
        cut = rng.integers(1, length + 1)
        c[cut:] = 0.0
    # ties too
    if length > 2 and rng.random() < 0.3:
        c[1] = c[0]
    return c


MECH_KINDS = ["dp-sgd", "tree", "bsr", "bisr", "bifr", "toeplitz-monotone", "toeplitz-positive", "toeplitz-mixed"]


@st.composite
def mechanisms(draw, n=None, max_n=10, kinds=MECH_KINDS):
    if n is None:
        n = draw(st.integers(1, max_n))
    kind = draw(st.sampled_from(kinds))
    rng = np.random.default_rng(draw(seeds))
    p = draw(st.integers(1, n))
    if kind == "dp-sgd":
        return DpSgd(n)
    if kind == "tree":
        return TreeAggregation(n)
    if kind == "bsr":
        return BandedSquareRoot(n, p)
    if kind == "bisr":
        return BandedInverseSquareRoot(n, p)
    if kind == "bifr":
        return BandedInverseFractionalRoot(n, p, draw(st.floats(0.01, 0.99)))
    if kind == "toeplitz-monotone":
        return BandedToeplitz(n, nonincreasing_nonnegative(rng, p, zeros=draw(st.booleans())))
    if kind == "toeplitz-positive":
        return BandedToeplitz(n, rng.uniform(0.05, 1.0, p))
    c = rng.normal(size=p)
    c[0] = abs(c[0]) + 0.05
    return BandedToeplitz(n, c)


# ---------------------------------------------------------------------------------------
# max_over_patterns (VecSens)
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(nbk=n_b_k(), data=st.data())
def test_max_over_patterns_matches_brute_force(nbk, data):
    n, b, k = nbk
    x = np.array(data.draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=n, max_size=n)))
    got = S.max_over_patterns(x, b, k)
    assert np.ndim(got) == 0
    np.testing.assert_allclose(got, brute_max_over_patterns(x, b, k), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(nbk=n_b_k(), seed=seeds, batch=st.sampled_from([(1,), (4,), (2, 3)]))
def test_max_over_patterns_rows_agree_with_per_row(nbk, seed, batch):
    n, b, k = nbk
    rng = np.random.default_rng(seed)
    x = rng.normal(size=batch + (n,)) - rng.uniform(0, 1)
    x[x < -1] = 0.0  # exact zeros and ties
    got = S.max_over_patterns(x, b, k)
    assert got.shape == batch
    flat = x.reshape(-1, n)
    per_row = np.array([S.max_over_patterns(row, b, k) for row in flat]).reshape(batch)
    np.testing.assert_array_equal(got, per_row)
    np.testing.assert_allclose(got, brute_max_over_patterns(x, b, k), rtol=1e-12, atol=1e-12)


def test_max_over_patterns_hand_cases():
    x = np.array([3.0, 5.0, 4.0, -1.0, 2.0])
    assert S.max_over_patterns(x, 1, 5) == 14.0  # every positive entry
    assert S.max_over_patterns(x, 2, 5) == 9.0  # 3 + 4 + 2
    assert S.max_over_patterns(x, 2, 2) == 7.0  # 5 + 2
    assert S.max_over_patterns(x, 5, 3) == 5.0  # one index only
    assert S.max_over_patterns(-np.ones(4), 1, 3) == 0.0  # the empty pattern


def test_brute_force_reference_agrees_with_library_exhaustive():
    rng = np.random.default_rng(5)
    for n in range(1, 7):
        for b in range(1, n + 1):
            for k in (1, 2, n):
                c = np.tril(rng.normal(size=(n, n)))
                assert math.isclose(S.exhaustive_minsep(c, b, k), brute_scalar_sens(c, b, k), rel_tol=1e-12)


# ---------------------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 10), length=st.integers(1, 12), zeros=st.booleans(), seed=seeds)
def test_toeplitz_minsep_matches_exhaustive(n, length, zeros, seed):
    coef = nonincreasing_nonnegative(np.random.default_rng(seed), length, zeros)
    c = np.zeros((n, n))
    for j in range(n):
        m = min(n - j, length)
        c[j : j + m, j] = coef[:m]
    for b in range(1, n + 1):
        for k in range(1, math.ceil(n / b) + 2):
            got = S.toeplitz_minsep(coef, n, b, k)
            assert got.exact and got.method == "toeplitz-closed-form"
            assert math.isclose(got.value, brute_scalar_sens(c, b, k), rel_tol=RTOL), (b, k)


@SETTINGS
@given(n=st.integers(2, 10), length=st.integers(2, 10), seed=seeds, how=st.sampled_from(["negative", "increasing"]))
def test_toeplitz_minsep_rejects_invalid_coefficients(n, length, seed, how):
    rng = np.random.default_rng(seed)
    length = min(length, n)
    coef = np.sort(rng.uniform(0.1, 1.0, length))[::-1].copy()
    i = int(rng.integers(0 if how == "negative" else 1, length))
    if how == "negative":
        coef[i] = -rng.uniform(0.01, 1.0)
    else:
        coef[i] = coef[i - 1] + rng.uniform(0.01, 1.0)
    assert not S.is_nonnegative_nonincreasing(coef)
    with pytest.raises(ValueError):
        S.toeplitz_minsep(coef, n, 1, n)


def test_is_nonnegative_nonincreasing():
    assert S.is_nonnegative_nonincreasing(np.array([1.0, 0.5, 0.5, 0.0]))
    assert S.is_nonnegative_nonincreasing(np.array([]))
    assert not S.is_nonnegative_nonincreasing(np.array([1.0, 1.1]))
    assert not S.is_nonnegative_nonincreasing(np.array([1.0, -0.1]))
    assert not S.is_nonnegative_nonincreasing(np.array([1.0, 0.0, 0.1]))


@SETTINGS
@given(n=st.integers(1, 10), seed=seeds, data=st.data())
def test_banded_minsep_matches_exhaustive(n, seed, data):
    rng = np.random.default_rng(seed)
    b = data.draw(st.integers(1, n))
    p = data.draw(st.integers(1, b))
    c = np.tril(rng.normal(size=(n, n))) * (np.subtract.outer(np.arange(n), np.arange(n)) < p)
    if rng.random() < 0.3:
        c[:, int(rng.integers(n))] = 0.0  # an empty column
    norms = np.sum(c**2, axis=0)
    for k in range(1, math.ceil(n / b) + 2):
        got = S.banded_minsep(norms, p, b, k)
        assert got.exact
        assert math.isclose(got.value, brute_scalar_sens(c, b, k), rel_tol=RTOL, abs_tol=1e-12), k


def test_banded_minsep_rejects_more_bands_than_min_sep():
    with pytest.raises(ValueError):
        S.banded_minsep(np.ones(6), 3, 2, 2)


@SETTINGS
@given(nbk=n_b_k(max_n=9), seed=seeds, positive=st.booleans())
def test_gram_upper_bound_dominates_exhaustive(nbk, seed, positive):
    n, b, k = nbk
    b = min(b, n)
    rng = np.random.default_rng(seed)
    c = np.tril(rng.normal(size=(n, n)))
    if positive:
        c = np.abs(c)
    x = c.T @ c
    got = S.gram_upper_bound(x, b, k)
    assert not got.exact
    assert got.value >= brute_scalar_sens(c, b, k) * (1 - RTOL)
    # it also dominates the absolute-value bound of every pattern (vector-valued soundness)
    patterns = minsep_patterns(n, b, k)
    absolute = max(np.abs(x[np.ix_(p, p)]).sum() for p in patterns)
    assert got.value**2 >= absolute * (1 - RTOL)


# ---------------------------------------------------------------------------------------
# the dispatcher, through real mechanisms
# ---------------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=150)
@given(mech=mechanisms(), data=st.data())
def test_dispatcher_is_sound_and_exact_when_it_says_so(mech, data):
    n = mech.rounds
    b = data.draw(st.integers(1, n), label="b")
    k = data.draw(st.one_of(st.none(), st.integers(1, n)), label="k")
    schema = MinSep(b, k)
    got = S.sensitivity(mech, schema)
    assert mech.sensitivity(schema) == got
    c = mech.strategy_matrix()
    keff = schema.participations(n)
    brute = brute_scalar_sens(c, b, keff)
    assert got.value >= brute * (1 - RTOL)
    if got.exact:
        assert math.isclose(got.value, brute, rel_tol=RTOL)
    # the closed forms must be found whenever their conditions hold
    coef = mech.strategy_toeplitz
    if keff == 1:
        assert got.exact and math.isclose(got.value, np.sqrt(np.max(np.sum(c**2, axis=0))), rel_tol=RTOL)
    elif mech.strategy_bands is not None and mech.strategy_bands <= b:
        assert got.exact and got.method == "banded-exact"
    elif coef is not None and S.is_nonnegative_nonincreasing(coef[:n]):
        assert got.exact and got.method == "toeplitz-closed-form"


def test_dispatcher_dp_sgd_and_tree_values():
    for n in (1, 5, 8, 12):
        for b in range(1, n + 1):
            k = math.ceil(n / b)
            got = DpSgd(n).sensitivity(MinSep(b))
            assert got.exact and math.isclose(got.value, math.sqrt(k), rel_tol=1e-12)
    # tree, single participation: a leaf sits in height + 1 complete nodes when n = 2^h
    for h in range(5):
        got = TreeAggregation(2**h).sensitivity(MinSep(2**h, 1))
        assert got.exact and math.isclose(got.value, math.sqrt(h + 1), rel_tol=1e-12)


def test_dispatcher_rejects_bad_schema():
    with pytest.raises(ValueError):
        S.sensitivity(DpSgd(4), MinSep(5, 1))  # b > n
    with pytest.raises(TypeError):
        S.sensitivity(DpSgd(4), object())


@SETTINGS
@given(n=st.integers(1, 8), seed=seeds, data=st.data())
def test_dispatcher_on_arbitrary_dense_strategy(n, seed, data):
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(n + data.draw(st.integers(0, 2)), n))
    b = data.draw(st.integers(1, n))
    k = data.draw(st.integers(1, n))
    got = S.sensitivity(DenseStrategy(c), MinSep(b, k))
    brute = brute_scalar_sens(c, b, MinSep(b, k).participations(n))
    assert got.value >= brute * (1 - RTOL)
    if got.exact:
        assert math.isclose(got.value, brute, rel_tol=RTOL)


# ---------------------------------------------------------------------------------------
# one pattern
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(k=st.integers(1, 6), m=st.integers(1, 8), seed=seeds)
def test_pattern_sensitivity_nonnegative_gram_is_sqrt_sum(k, m, seed):
    c = np.abs(np.random.default_rng(seed).normal(size=(m, k)))
    x = c.T @ c
    got = S.pattern_sensitivity(x)
    assert got.exact
    assert math.isclose(got.value, math.sqrt(x.sum()), rel_tol=1e-12)
    assert math.isclose(got.value, np.linalg.norm(c @ np.ones(k)), rel_tol=1e-12)
    assert got.value**2 >= vector_sens_sq_lower_bound(x) * (1 - RTOL)


@SETTINGS
@given(k=st.integers(1, 2), m=st.integers(1, 6), seed=seeds)
def test_pattern_sensitivity_up_to_two_is_max_over_signs(k, m, seed):
    c = np.random.default_rng(seed).normal(size=(m, k))
    x = c.T @ c
    got = S.pattern_sensitivity(x)
    assert got.exact
    scalar = max_sign_quadratic(x)
    assert math.isclose(got.value, math.sqrt(scalar), rel_tol=1e-12)
    # exact for vectors too: no unit vectors do better than the best signs
    assert vector_sens_sq_lower_bound(x) <= scalar * (1 + RTOL)


@SETTINGS
@given(k=st.integers(3, 8), m=st.integers(1, 8), seed=seeds)
def test_pattern_sensitivity_is_a_sound_vector_bound(k, m, seed):
    c = np.random.default_rng(seed).normal(size=(m, k))
    x = c.T @ c
    got = S.pattern_sensitivity(x)
    lower = vector_sens_sq_lower_bound(x)
    scalar = max_sign_quadratic(x)
    assert lower >= scalar * (1 - RTOL)
    assert got.value**2 >= lower * (1 - 1e-7)
    # never looser than the two closed-form bounds (Theorem 2.1 and sum |X_ij|)
    assert got.value**2 <= min(np.abs(x).sum(), k * np.linalg.eigvalsh(x)[-1]) * (1 + RTOL)
    if np.any(x < 0):
        assert got.method in ("pattern-sdp-exact", "pattern-sdp", "pattern-bound")
    if got.exact:  # certified: the best sign vector is worst for every dimension
        assert math.isclose(got.value**2, scalar, rel_tol=1e-9)
    else:
        assert got.value**2 > scalar * (1 + 1e-9)


def _sdp_bound_is_tight(k: int, m: int, seed: int) -> None:
    """The SDP dual bound is within 1e-6 of a long block-coordinate ascent's lower bound on
    the vector sensitivity max tr(X G) (the SDP value for d >= k)."""
    c = np.random.default_rng(seed).normal(size=(m, k))
    x = c.T @ c
    got = S.pattern_sensitivity(x)
    assert got.value**2 <= vector_sens_sq_lower_bound(x, sweeps=3000) * (1 + 1e-6)


@settings(SETTINGS, max_examples=3)
@given(k=st.integers(3, 8), m=st.integers(1, 8), seed=seeds)
@example(k=8, m=8, seed=0)  # the largest X: always in the default run
def test_pattern_sensitivity_sdp_bound_is_tight(k, m, seed):
    _sdp_bound_is_tight(k, m, seed)


@pytest.mark.heavy
@SETTINGS
@given(k=st.integers(3, 8), m=st.integers(1, 8), seed=seeds)
def test_pattern_sensitivity_sdp_bound_is_tight_many(k, m, seed):
    """As above, 40 examples (~10 s)."""
    _sdp_bound_is_tight(k, m, seed)


@SETTINGS
@given(k=st.integers(3, 8), seed=seeds, scale=st.sampled_from([1e-14, 1e-12, 1e-10]))
def test_pattern_sensitivity_tiny_negative_entries_are_certified(k, seed, scale):
    """X >= 0 up to tiny negative off-diagonal entries (as in the dense optimum): the all-ones
    sign vector is certified worst, and the value is sqrt(1^T X 1) to 1e-9."""
    rng = np.random.default_rng(seed)
    c = np.abs(rng.normal(size=(k + 2, k)))
    x = c.T @ c
    i, j = sorted(rng.choice(k, size=2, replace=False))
    x[i, j] = x[j, i] = -scale * np.max(np.diag(x))
    got = S.pattern_sensitivity(x)
    assert got.exact and got.method == "pattern-sdp-exact"
    assert math.isclose(got.value**2, x.sum(), rel_tol=1e-9)
    assert got.value**2 >= max_sign_quadratic(x)


@pytest.mark.parametrize("k", [13, 14])
def test_pattern_sensitivity_beyond_sign_enumeration(k):
    """|pi| > 12: signs from rounding the SDP solution; still a sound bound above brute force,
    and exact claims match brute force over all 2^(k-1) sign vectors."""
    signs = np.array([(1.0,) + s for s in itertools.product((1.0, -1.0), repeat=k - 1)])
    rng = np.random.default_rng(k)
    for m in (2, 4, 30):
        c = rng.normal(size=(m, k))
        x = c.T @ c
        got = S.pattern_sensitivity(x)
        scalar = float(np.max(np.sum((signs @ x) * signs, axis=1)))
        assert got.value**2 >= scalar * (1 - RTOL)
        assert got.value**2 >= vector_sens_sq_lower_bound(x, sweeps=200) * (1 - 1e-7)
        if got.exact:
            assert math.isclose(got.value**2, scalar, rel_tol=1e-9)


def test_pattern_sensitivity_frustrated_triangle():
    """X = I/3 + a·S with S_12 = S_23 = 1, S_13 = -1 (the sign pattern of the momentum optimum,
    notes Sec. 3.2): scalar sens^2 = 1 + 2a (every sign vector breaks one pair), vector
    (d >= 3) sens^2 = 1 + 3a at Y_12 = Y_23 = 1/2, Y_13 = -1/2."""
    a = 0.0273
    x = np.eye(3) / 3 + a * np.array([[0.0, 1.0, -1.0], [1.0, 0.0, 1.0], [-1.0, 1.0, 0.0]])
    assert math.isclose(max_sign_quadratic(x), 1.0 + 2 * a, rel_tol=1e-12)
    got = S.pattern_sensitivity(x)
    assert not got.exact and got.method in ("pattern-sdp", "pattern-bound")
    assert math.isclose(got.value**2, 1.0 + 3 * a, rel_tol=1e-8)


def test_pattern_sensitivity_empty():
    got = S.pattern_sensitivity(np.zeros((0, 0)))
    assert got.value == 0.0 and got.exact


H2 = np.array([[2.0, 1.0, 1.0], [1.0, 2.0, -1.0], [1.0, -1.0, 2.0]]) / np.sqrt(24.0)


def test_multi_epoch_counterexample_h2_is_not_exact():
    """Multi-Epoch MF, App. H.2: the scalar sensitivity is 1, the vector-valued one larger."""
    x = H2.T @ H2
    assert math.isclose(brute_scalar_sens(H2, 1, 3), 1.0, rel_tol=1e-12)
    vector = vector_sens_sq_lower_bound(x)
    assert vector >= 1.1  # vectors beat every sign choice
    got = S.pattern_sensitivity(x)
    assert not got.exact and got.method in ("pattern-sdp", "pattern-bound")
    assert got.value >= math.sqrt(1.1)
    assert got.value**2 >= vector * (1 - 1e-9)
    # the SDP value (d >= 3): 27/24 at Y_12 = Y_13 = 1/2, Y_23 = -1/2
    assert math.isclose(got.value**2, 27 / 24, rel_tol=1e-8)
    mech = DenseStrategy(H2)
    for schema in (FixedEpoch(3, 1), Observed.from_mapping({"u": [0, 1, 2]}), MinSep(1, 3)):
        s = S.sensitivity(mech, schema)
        assert not s.exact, schema
        assert s.value >= math.sqrt(1.1), schema
    assert S.sensitivity(mech, FixedEpoch(3, 1)).method == "fixed-epoch-bound"
    assert S.sensitivity(mech, Observed.from_mapping({"u": [0, 1, 2]})).method == "observed-bound"


# ---------------------------------------------------------------------------------------
# FixedEpoch and Observed
# ---------------------------------------------------------------------------------------


@st.composite
def fixed_epoch_cases(draw):
    k = draw(st.integers(1, 4))
    b = draw(st.integers(1, 4))
    mech = draw(mechanisms(n=k * b))
    return mech, FixedEpoch(k, b)


@settings(SETTINGS, max_examples=80)
@given(case=fixed_epoch_cases())
def test_fixed_epoch_matches_brute_force_over_patterns(case):
    mech, schema = case
    k, b = schema.max_participations, schema.min_sep
    c = mech.strategy_matrix()
    got = S.fixed_epoch(mech, schema)
    assert S.sensitivity(mech, schema) == got
    scalar, all_exact = 0.0, True
    vector = 0.0
    for j in range(b):
        pattern = [j + e * b for e in range(k)]
        assert pattern in schema.patterns()
        x = c[:, pattern].T @ c[:, pattern]
        scalar = max(scalar, max_sign_quadratic(x))
        vector = max(vector, vector_sens_sq_lower_bound(x, sweeps=20))
        all_exact &= bool(k <= 2 or np.all(x >= 0))
    assert got.value**2 >= vector * (1 - 1e-7)
    if all_exact:
        assert got.exact and got.method == "fixed-epoch-exact"
        assert math.isclose(got.value, math.sqrt(scalar), rel_tol=RTOL)
    else:
        assert got.value >= math.sqrt(scalar) * (1 - RTOL)


def test_fixed_epoch_rejects_wrong_rounds():
    with pytest.raises(ValueError):
        S.fixed_epoch(DpSgd(7), FixedEpoch(2, 3))


def test_fixed_epoch_dp_sgd_and_prefix_toeplitz():
    for k, b in [(1, 1), (3, 2), (4, 5)]:
        got = S.fixed_epoch(DpSgd(k * b), FixedEpoch(k, b))
        assert got.exact and math.isclose(got.value, math.sqrt(k), rel_tol=1e-12)
    # C = prefix-sum matrix: the worst slot is j = 0, ||sum_e C e_{eb}||^2 = sum_i (#e: eb <= i)^2
    n, k, b = 12, 3, 4
    mech = BandedToeplitz(n, np.ones(n))
    expected = math.sqrt(sum((i // b + 1) ** 2 for i in range(n)))
    assert math.isclose(S.fixed_epoch(mech, FixedEpoch(k, b)).value, expected, rel_tol=1e-12)


@settings(SETTINGS, max_examples=80)
@given(mech=mechanisms(max_n=10), data=st.data())
def test_observed_single_user(mech, data):
    n = mech.rounds
    rounds = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    c = mech.strategy_matrix()
    x = c[:, rounds].T @ c[:, rounds]
    got = S.observed(mech, rounds)
    assert S.sensitivity(mech, Observed.from_mapping({"only": rounds})) == got
    scalar = max_sign_quadratic(x)
    assert got.value >= math.sqrt(scalar) * (1 - RTOL)
    if np.all(x >= 0):
        assert got.exact and got.method == "observed-exact"
        assert math.isclose(got.value, np.linalg.norm(c[:, rounds] @ np.ones(len(rounds))), rel_tol=RTOL)
    if len(rounds) <= 2:
        assert got.exact and math.isclose(got.value, math.sqrt(scalar), rel_tol=RTOL)


@SETTINGS
@given(mech=mechanisms(max_n=10), data=st.data())
def test_observed_is_the_worst_user(mech, data):
    n = mech.rounds
    users = data.draw(st.lists(st.sets(st.integers(0, n - 1), max_size=n), min_size=1, max_size=4))
    mapping = {f"u{i}": sorted(r) for i, r in enumerate(users)}
    got = S.sensitivity(mech, Observed.from_mapping(mapping))
    per_user = [S.observed(mech, r) for r in mapping.values() if r]
    if not per_user:
        assert got.value == 0.0 and got.exact
        return
    assert math.isclose(got.value, max(s.value for s in per_user), rel_tol=1e-12)
    assert got.exact == all(s.exact for s in per_user)


def test_observed_rejects_rounds_outside_run():
    with pytest.raises(ValueError):
        S.sensitivity(DpSgd(4), Observed.from_mapping({"u": [1, 4]}))
    with pytest.raises(ValueError):
        Observed.from_mapping({"u": [1, 1]})


@pytest.mark.parametrize("n,k", [(60, 6), (96, 6), (48, 4)])
def test_dense_optimum_fixed_epoch_sensitivity_is_tight(n, k):
    """The dense optimum is scaled to max_u u^T X_pi u = 1 over sign vectors; its same-pattern
    Gram entries may be slightly negative, so the vector sensitivity can exceed 1 a little. The
    SDP certificate matches a block-coordinate ascent's lower bound on it to 1e-7 (the
    |X|-sum bound overshoots it)."""
    from fedmf.mechanisms.dense_optimize import optimize_dense

    schema = FixedEpoch(k, n // k)
    mech, _ = optimize_dense(n, schema, device="cpu")
    x = mech.gram_matrix
    blocks = [x[np.ix_(p, p)] for p in schema.patterns()]
    scalar = max(max_sign_quadratic(block) for block in blocks)
    vector = max(vector_sens_sq_lower_bound(block, sweeps=300) for block in blocks)
    got = S.sensitivity(mech, schema)
    assert math.isclose(scalar, 1.0, rel_tol=1e-9)
    assert got.value**2 >= vector * (1 - RTOL)
    assert got.value**2 <= vector * (1 + 1e-7)
    if got.exact:
        assert got.method == "fixed-epoch-exact" and math.isclose(got.value**2, scalar, rel_tol=1e-9)
