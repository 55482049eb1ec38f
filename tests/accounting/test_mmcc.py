"""MMCC (fedmf.accounting.mmcc) against dp_accounting, the paper's App. F.5 values, brute force
and the dominance inequalities of the paper (Cor. B.3)."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import stats

from fedmf import mechanisms
from fedmf.accounting import mmcc
from fedmf.participation import MinSep

# Both PLDs use value_discretization_interval 1e-4 on the same loss grid; what differs is the
# MoG's binary-search inverse (precision 1e-6, pessimistic) and float rounding: observed 1e-9.
SAME_GRID_TOL = 1e-6
# Two pessimistic PLDs of mechanisms where one dominates the other can cross by at most a few
# loss-grid steps (1e-4 each) per composed row PLD; used only for the dominance inequalities.
DOMINANCE_TOL = 1e-3


def _bsr(n: int, bands: int) -> np.ndarray:
    return mechanisms.build("bsr", n, MinSep(1, n), num_bands=bands).strategy_matrix()


def _dpsgd_epsilon(p: float, sigma: float, n: int, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), n)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("n,p,sigma", [(32, 1 / 16, 1.0), (20, 0.3, 2.0)])
def test_identity_is_composed_subsampled_gaussian(n, p, sigma):
    result = mmcc.epsilon(np.eye(n), p, sigma, 1e-6)
    assert result.delta1 == 0.0 and result.delta2 == 1e-6  # diagonal C: no tail bounds, all delta to delta2
    assert result.distinct_rows == 1 and result.rows == n and result.max_ratio == 1.0
    assert result.epsilon == pytest.approx(_dpsgd_epsilon(p, sigma, n, 1e-6), abs=SAME_GRID_TOL)


def test_identity_matches_paper_dpsgd_value():
    # App. F.5: DP-SGD, 128 steps, p = 1/128, sigma = 1, delta = 1e-6: "epsilon = 0.806" (3 digits)
    result = mmcc.epsilon(np.eye(128), 1 / 128, 1.0, 1e-6)
    assert abs(result.epsilon - 0.806) < 5e-4


def _last_iterate_epsilon(n: int, delta: float) -> float:
    """Exact epsilon(delta) of one release N(S, n) vs N(0, n), S ~ Binomial(n, 1/n), add or
    remove: ln P/Q is increasing in y (and > ln Pr[S = 0]), so each hockey-stick divergence is
    a difference of Gaussian tails at the root of ln P/Q = +-eps (independent of any PLD)."""
    from scipy.optimize import brentq
    from scipy.special import logsumexp

    sigma, s = math.sqrt(n), np.arange(n + 1)
    w = stats.binom.pmf(s, n, 1 / n)

    def loss(y: float) -> float:
        return float(logsumexp((2 * s * y - s**2) / (2 * sigma**2), b=w))

    def hockey(eps: float) -> float:
        y = brentq(lambda v: loss(v) - eps, -1e3, 1e3, xtol=1e-14)
        add = np.sum(w * stats.norm.sf((y - s) / sigma)) - math.exp(eps) * stats.norm.sf(y / sigma)
        if loss(-1e3) + eps >= 0:  # ln Q/P never exceeds eps
            return add
        y = brentq(lambda v: loss(v) + eps, -1e3, 1e3, xtol=1e-14)
        remove = stats.norm.cdf(y / sigma) - math.exp(eps) * np.sum(w * stats.norm.cdf((y - s) / sigma))
        return max(add, remove)

    return brentq(lambda e: hockey(e) - delta, 1e-3, 20.0, xtol=1e-12)


@pytest.mark.parametrize("n", [16, pytest.param(128, marks=pytest.mark.heavy)])
def test_last_iterate_mixture_matches_paper(n):
    # App. F.5, linear losses, last iterate: one release with sensitivity ~ Binomial(n, 1/n) and
    # noise std sqrt(n) = C with a single all-ones last row. n = 128 (heavy, ~6 s): add-or-remove
    # value 0.41994 (notes §9.1 #2, confirmed by numerical integration 0.419944; the paper's 0.291
    # is the ADD direction only). Both n against the exact value. Our PLD is pessimistic (never
    # below, up to float noise) and moves masses < 1e-12 up, costing far less than 1e-3.
    c = np.zeros((n, n))
    c[-1] = 1.0
    result = mmcc.epsilon(c, 1 / n, math.sqrt(n), 1e-6)
    assert result.delta1 == 0.0 and result.rows == 1
    exact = _last_iterate_epsilon(n, 1e-6)
    if n == 128:
        assert exact == pytest.approx(0.419944, abs=1e-6)
    assert exact - 1e-5 <= result.epsilon <= exact + 1e-3


@pytest.mark.parametrize("n,expected,ratio", [(2, 0.3668, 1.223), (4, 0.3493, 1.446)])
def test_opt_cc_matches_prototype(n, expected, ratio):
    # notes §9.3 (independent prototype, 4 digits): opt-CC C, p = 1/n, sigma = 10 ||C e_1||,
    # delta1 = delta2 = 5e-7, grid 1e-3. Its ratio to the unamplified 0.3969 is within 4% of the
    # paper's Fig. 8 fit y = -0.0313 x + 1.1625 (x = sqrt(log2 n + 1)).
    c = _bsr(n, n)
    sigma = 10 * np.linalg.norm(c[:, 0])
    result = mmcc.epsilon(c, 1 / n, sigma, 1e-6)
    assert result.delta1 == result.delta2 == 5e-7
    assert result.epsilon == pytest.approx(expected, abs=1e-4)
    assert result.max_ratio == pytest.approx(ratio, abs=1e-3)
    fit = -0.0313 * math.sqrt(math.log2(n) + 1) + 1.1625
    assert 0.3969 / result.epsilon == pytest.approx(fit, rel=0.04)


def _brute_tail_bounds(c, p, sigma, delta1):
    n = c.shape[0]
    pairs = sum(1 for i in range(n) for j in range(n) if c[i, j] > 0 and np.any(c[:i, j] > 0))
    dprime = delta1 / (2 * pairs)
    z = stats.norm.isf(dprime)
    out = np.ones_like(c)
    for i in range(n):
        for j in range(n):
            if c[i, j] == 0:
                continue
            col = c[:i, j]
            a2 = float(col @ col)
            if a2 == 0:
                out[i, j] = p
                continue
            dots = sorted((float(c[:i, k] @ col) for k in range(n) if c[:i, k] @ col > 0), reverse=True)
            t = next(t for t in range(len(dots) + 1) if stats.binom.sf(t, len(dots), p) <= dprime)
            eps = z * math.sqrt(a2) / sigma + (2 * sum(dots[:t]) - a2) / (2 * sigma**2)
            out[i, j] = max(p, p * math.exp(eps) / (p * math.exp(eps) + 1 - p))
    return out, dprime


def test_tail_bounds_brute_force():
    rng = np.random.default_rng(3)
    c = np.tril(rng.uniform(0.1, 1.0, (5, 5)))
    c[3, 1] = 0.0
    for p, sigma, delta1 in [(0.3, 1.5, 0.2), (0.05, 4.0, 1e-6)]:
        expected, dprime = _brute_tail_bounds(c, p, sigma, delta1)
        got = mmcc.tail_bounds(c, p, sigma, delta1)
        np.testing.assert_allclose(got, expected, rtol=1e-12)
        assert np.all(got[c > 0] >= p) and np.all(got <= 1.0)
        # F.3: the count tail + top-t sum s really bounds Pr[sum_j' x_j' <C_j', C_j> > s] by delta'
        i, j = 4, 0
        gram = c[:i].T @ c[:i]
        dots = gram[:, j][gram[:, j] > 0]
        m = len(dots)
        t = next(t for t in range(m + 1) if stats.binom.sf(t, m, p) <= dprime)
        s = np.sort(dots)[::-1][:t].sum()
        tail = sum(p ** sum(x) * (1 - p) ** (m - sum(x))
                   for x in itertools.product((0, 1), repeat=m) if np.dot(x, dots) > s + 1e-12)
        assert tail <= dprime


def test_sensitivity_pmf_brute_force():
    row = np.array([0.3, 0.0, 0.25, 1.0, 0.1234])
    tilde = np.array([0.2, 1.0, 0.5, 0.05, 0.7])
    grid = 0.01
    sens, probs = mmcc.sensitivity_pmf(row, tilde, grid, tiny=0.0)
    steps = np.ceil(row / grid)  # 30, 0, 25, 100, 13: every entry rounded up
    exact: dict[int, float] = {}
    cols = np.flatnonzero(row)
    for bits in itertools.product((0, 1), repeat=len(cols)):
        weight = np.prod([tilde[j] if b else 1 - tilde[j] for j, b in zip(cols, bits)])
        k = int(sum(steps[j] for j, b in zip(cols, bits) if b))
        exact[k] = exact.get(k, 0.0) + weight
    keys = sorted(exact)
    np.testing.assert_allclose(sens, np.array(keys) * grid, rtol=1e-15)
    np.testing.assert_allclose(probs, [exact[k] for k in keys], rtol=1e-12)


def test_tiny_masses_move_up():
    row = np.array([1.0, 1.0, 1.0])
    tilde = np.array([1e-5, 1e-5, 1e-5])
    sens, probs = mmcc.sensitivity_pmf(row, tilde, 0.5, tiny=1e-12)
    # P[2 in] = 3e-10 kept, P[3 in] = 1e-15 is the top point (kept, nothing above it)
    np.testing.assert_allclose(sens, [0.0, 1.0, 2.0, 3.0])
    tilde = np.array([1e-7, 1e-7, 1.0])
    sens, probs = mmcc.sensitivity_pmf(row, tilde, 0.5, tiny=1e-12)
    # sums 1 (most mass), 2 (2e-7), 3 (1e-14 < tiny, but the top): mass never moves down
    np.testing.assert_allclose(sens, [1.0, 2.0, 3.0])
    assert math.isclose(probs.sum(), 1.0, rel_tol=1e-12)
    sens, probs = mmcc.sensitivity_pmf(np.array([1.0, 2.0]), np.array([1e-13, 0.5]), 1.0, tiny=1e-12)
    # P[1] = 5e-14 moves up to 2, P[3] = 5e-14 stays (top)
    np.testing.assert_allclose(sens, [0.0, 2.0, 3.0])
    np.testing.assert_allclose(probs, [0.5 * (1 - 1e-13), 0.5 * (1 - 1e-13) + 5e-14, 5e-14], rtol=1e-12)


def test_mog_pld_equals_library():
    sens, probs = np.array([0.0, 0.5, 1.3, 2.0]), np.array([0.7, 0.2, 0.09, 0.01])
    ours = mmcc.mog_pld(1.0, sens, probs, 1e-2)
    ref = pld_lib.from_mixture_gaussian_mechanism(1.0, sens, probs, value_discretization_interval=1e-2)
    for mine, theirs in ((ours._pmf_remove, ref._pmf_remove), (ours._pmf_add, ref._pmf_add)):
        assert mine._lower_loss == theirs._lower_loss and mine._infinity_mass == theirs._infinity_mass
        np.testing.assert_array_equal(mine._probs, theirs._probs)


def test_toeplitz_rows_cached_and_mechanism_input():
    mech = mechanisms.build("bsr", 12, MinSep(2, 6), num_bands=2)
    result = mmcc.epsilon(mech, 0.1, 3.0, 1e-6)
    assert result.rows == 12 and result.distinct_rows <= 3  # rows >= 2b - 1 identical (App. F.4)
    assert result.epsilon == mmcc.epsilon(mech.strategy_matrix(), 0.1, 3.0, 1e-6).epsilon
    assert result.delta1 == result.delta2 == 5e-7
    custom = mmcc.epsilon(mech, 0.1, 3.0, 1e-6, delta1_fraction=0.2)
    assert custom.delta1 == pytest.approx(2e-7) and custom.delta2 == pytest.approx(8e-7)


def test_monotone_in_sigma_and_p():
    # p~ falls with sigma and rises with p (Alg. 2: eps_ij, the count tail t), and the MoG PLD is
    # monotone in sigma, sensitivities and p~ (Lemma B.2, Cor. B.3), so these are strict here.
    c = _bsr(8, 3)
    tb = [mmcc.tail_bounds(c, 0.1, s, 5e-7) for s in (3.0, 5.0)]
    assert np.all(tb[1][c > 0] <= tb[0][c > 0])
    eps_sigma = [mmcc.epsilon(c, 0.1, s, 1e-6).epsilon for s in (3.0, 5.0)]
    eps_p = [mmcc.epsilon(c, q, 4.0, 1e-6).epsilon for q in (1 / 16, 1 / 8)]
    assert eps_sigma[1] < eps_sigma[0]
    assert eps_p[0] < eps_p[1]


def test_between_independent_rows_and_unamplified():
    c = _bsr(8, 3)
    p, sigma, delta2, grid = 1 / 8, 3.0, 5e-7, mmcc.GRID
    result = mmcc.mmcc(c, p, sigma, 5e-7, delta2)
    lower = mmcc.lower_bound(c, p, sigma, delta2)
    # p~ >= p: the PMoG with p dominates (Cor. B.3)
    assert lower <= result.epsilon + DOMINANCE_TOL
    assert result.max_ratio > 1.0 and lower < result.epsilon
    # p~ <= 1: dominated by every user in every round, rows Gaussian with sensitivity (rounded C 1)_i,
    # composed = one Gaussian with sensitivity ||rounded C 1||_2 (Lemma B.2, Cor. B.3)
    rows = (np.ceil(c / grid) * grid).sum(axis=1)
    full = pld_lib.from_gaussian_mechanism(sigma / np.linalg.norm(rows)).get_epsilon_for_delta(delta2)
    assert result.epsilon <= full + DOMINANCE_TOL
    assert mmcc.lower_bound(np.eye(8), p, sigma, delta2) == mmcc.mmcc(np.eye(8), p, sigma, 5e-7, delta2).epsilon


def test_full_participation_is_one_gaussian():
    # p = 1: every user in every round, so each row is a Gaussian with sensitivity (rounded C 1)_i and
    # their composition one Gaussian with sensitivity ||rounded C 1||_2; both PLDs pessimistic on the
    # 1e-4 loss grid (observed difference 3e-8)
    c = _bsr(6, 3)
    result = mmcc.mmcc(c, 1.0, 5.0, 5e-7, 5e-7)
    rows = (np.ceil(c / mmcc.GRID) * mmcc.GRID).sum(axis=1)
    full = pld_lib.from_gaussian_mechanism(5.0 / np.linalg.norm(rows)).get_epsilon_for_delta(5e-7)
    assert result.max_ratio == 1.0
    assert result.epsilon == pytest.approx(full, abs=1e-4)


@pytest.mark.parametrize("c,kwargs,message", [
    (-np.eye(3), {}, "non-negative"),
    (np.triu(np.ones((3, 3))), {}, "lower-triangular"),
    (np.ones((3, 2)), {}, "square"),
    (np.eye(3), {"p": 0.0}, "sampling probability"),
    (np.eye(3), {"p": 1.5}, "sampling probability"),
    (np.eye(3), {"sigma": 0.0}, "sigma"),
    (np.eye(3), {"sigma": -1.0}, "sigma"),
    (np.eye(3), {"delta": 0.0}, "delta"),
    (np.eye(3), {"delta1_fraction": 0.0}, "delta1 fraction"),
    (np.eye(3), {"delta1_fraction": 1.0}, "delta1 fraction"),
])
def test_bad_input(c, kwargs, message):
    args = {"p": 0.1, "sigma": 1.0, "delta": 1e-6} | kwargs
    with pytest.raises(ValueError, match=message):
        mmcc.epsilon(c, args.pop("p"), args.pop("sigma"), args.pop("delta"), **args)
