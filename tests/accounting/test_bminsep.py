"""The b-min-sep dominating pair (fedmf.accounting.bminsep) and its Monte Carlo
accountant (fedmf.accounting.montecarlo): the reference privacy losses, a brute-force enumeration for
3 and 4 bands (cold and warm start, Toeplitz and general banded C), the scaled and
log-space recursions against each other, the sampler against the Markov chain, and the
Monte Carlo estimate against dp_accounting for C = I."""

from __future__ import annotations

import itertools

import dp_accounting
import numpy as np
import pytest
from scipy.special import logsumexp

from fedmf.accounting import bminsep, montecarlo
from fedmf.accounting.bminsep import BMinSep, log_likelihood_ratio, privacy_loss
from fedmf.accounting.montecarlo import MonteCarloAccountant
from tests.reference import load_cases, load_file

CASES = load_cases("accounting.json")
LOSS_CASES = load_file("accounting.json")["bminsep_privacy_loss"]["cases"]


# ---------------------------------------------------------------------------------------
# brute force: the exact mixture over every participation vector x
# ---------------------------------------------------------------------------------------
def toeplitz(c, n):
    m = np.zeros((n, n))
    for i in range(n):
        for k, ck in enumerate(c):
            if i + k < n:
                m[i + k, i] = ck
    return m


def brute_force(y, strategy, b, p, sigma, warm=False):
    """ln P(y)/Q(y) = ln sum_x Pr[x] N(Cx, σ²)(y)/N(0, σ²)(y), Pr[x] from the b-min-sep
    chain (cold start: available at round 0; warm start: the stationary law of Alg. 2)."""
    n = len(y)
    y = np.asarray(y, float)
    if warm and b > 1:
        starts = [(0, 1 / (1 + (b - 1) * p))] + [(k, p / (1 + (b - 1) * p)) for k in range(1, b)]
    else:
        starts = [(0, 1.0)]
    terms = []
    for x in itertools.product((0, 1), repeat=n):
        for first, weight in starts:  # first = first round the client is available
            prob, available, ok = weight, first, True
            for t in range(n):
                if t < available:
                    if x[t]:
                        ok = False
                        break
                    continue
                prob *= p if x[t] else 1 - p
                if x[t]:
                    available = t + b
            if ok and prob > 0:
                m = strategy @ np.array(x, float)
                terms.append(np.log(prob) + (2 * m @ y - m @ m) / (2 * sigma**2))
    return float(logsumexp(terms))


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: f"c={c['c']}-y={c['y']}-warm={c['warm']}")
def test_reference_log_likelihood_ratio(case):
    ours = log_likelihood_ratio(case["y"], case["c"], case["b"], case["p"], 1.0, warm_start=case["warm"])
    assert ours == pytest.approx(case["log_ratio"], abs=1e-12)
    assert brute_force(case["y"], toeplitz(case["c"], case["n"]), case["b"], case["p"], 1.0, case["warm"]) == \
        pytest.approx(case["log_ratio"], abs=1e-12)


@pytest.mark.parametrize("bands", [3, 4])
@pytest.mark.parametrize("warm", [False, True])
def test_brute_force_three_and_four_bands(bands, warm):
    """The truncated column norms of the last L-1 columns must be in the right order
    (jax_privacy HEAD has them reversed): checked for L = 3, 4 and b = L … L+2."""
    rng = np.random.default_rng(10 * bands + warm)
    for _trial in range(6):
        n = int(rng.integers(bands, 9))
        b = int(bands + rng.integers(0, 3))
        p = float(rng.uniform(0.1, 0.9))
        sigma = float(rng.uniform(0.4, 1.5))
        c = rng.uniform(0.1, 1.0, bands)
        y = rng.normal(0.5, 1.0, n)
        exact = brute_force(y, toeplitz(c, n), b, p, sigma, warm)
        assert log_likelihood_ratio(y, c, b, p, sigma, warm) == pytest.approx(exact, abs=1e-11)
        scheme = BMinSep.from_coefficients(c, n, b, p, warm)
        both = privacy_loss(scheme, np.stack([y, -y], axis=1), sigma)  # scaled recursion
        assert both[0] == pytest.approx(exact, abs=1e-11)


def test_reversed_tail_norms_would_be_wrong():
    """The jax_privacy bug (cumsum in forward order) changes this value; ours matches the
    brute force (notes §4.2)."""
    c, n, b, p = np.array([1.0, 0.6, 0.3]), 5, 3, 0.4
    y = np.array([0.3, -0.2, 1.1, 0.4, 0.9])
    exact = brute_force(y, toeplitz(c, n), b, p, 1.0)
    assert log_likelihood_ratio(y, c, b, p, 1.0) == pytest.approx(exact, abs=1e-12)
    scheme = BMinSep.from_coefficients(c, n, b, p)
    assert scheme.column_norms_sq[-1] == pytest.approx(c[0] ** 2)
    assert scheme.column_norms_sq[-2] == pytest.approx(c[0] ** 2 + c[1] ** 2)


def test_general_banded_strategy_matches_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(5):
        n, L = int(rng.integers(3, 8)), int(rng.integers(1, 4))
        b = L + int(rng.integers(0, 2))
        strategy = np.zeros((n, n))
        for i in range(n):
            for k in range(L):
                if i + k < n:
                    strategy[i + k, i] = rng.uniform(0.1, 1.0)
        scheme = BMinSep(bminsep.bands_from_matrix(strategy, L), b, 0.3, bool(trial % 2))
        y = rng.normal(0.0, 1.0, n)
        exact = brute_force(y, strategy, b, 0.3, 0.8, bool(trial % 2))
        for method in ("log", "scaled"):
            assert privacy_loss(scheme, y, 0.8, method) == pytest.approx(exact, abs=1e-11)


def test_warm_start_with_certain_selection_is_balls_in_bins():
    # p = 1, warm start: one uniformly random slot of b, cycled (notes §3.4)
    c, n, b = np.array([1.0, 0.5]), 6, 3
    y = np.array([0.2, 1.0, -0.3, 0.8, 0.1, 0.5])
    strategy = toeplitz(c, n)
    terms = []
    for slot in range(b):
        x = (np.arange(n) % b == slot).astype(float)
        m = strategy @ x
        terms.append((2 * m @ y - m @ m) / 2 - np.log(b))
    assert log_likelihood_ratio(y, c, b, 1.0, 1.0, warm_start=True) == pytest.approx(logsumexp(terms), abs=1e-12)


def test_scaled_and_log_recursions_agree_on_many_samples():
    rng = np.random.default_rng(0)
    for n, c, b, p, sigma, warm in [(200, [1.0, 0.5, 0.25], 4, 0.05, 1.0, False), (150, [1.0, 0.7], 8, 0.3, 0.3, True),
                                    (120, [1.0], 3, 0.6, 0.05, False)]:
        scheme = BMinSep.from_coefficients(c, n, b, p, warm)
        y = rng.normal(0.3, 1.0, (n, 300))
        fast, slow = privacy_loss(scheme, y, sigma, "scaled"), privacy_loss(scheme, y, sigma, "log")
        assert np.all(np.isfinite(fast))
        assert np.max(np.abs(fast - slow)) <= 1e-9 * max(1.0, np.max(np.abs(slow)))


@pytest.mark.parametrize("b", [4, 6])  # windows of two participations may overlap (b < 2L-1) or not
def test_pair_sampler_matches_the_loss_of_its_draws(b):
    """The chunk kernel (shared Gaussian draws, sparse signal, scaled recursion) against
    privacy_loss in log space on the y it stands for: y_Q = σz, y_P = Cx + σz."""
    sigma, n, count = 0.7, 30, 400
    scheme = BMinSep.from_coefficients([0.8, 0.5, 0.3], n, b, 0.15, warm_start=True)
    loss_q, loss_p = montecarlo._chunk_losses(scheme, sigma, np.random.default_rng(5), count, scheme.gram_band(), "auto")
    # the same draws again, to rebuild y
    rng = np.random.default_rng(5)
    z = rng.standard_normal((n, count))
    t, cols = montecarlo._participations(scheme, rng, count)
    x = np.zeros((n, count))
    x[t, cols] = 1.0
    y_q = sigma * z
    y_p = toeplitz([0.8, 0.5, 0.3], n) @ x + y_q
    assert np.allclose(loss_q, privacy_loss(scheme, y_q, sigma, "log"), atol=1e-9)
    assert np.allclose(loss_p, privacy_loss(scheme, y_p, sigma, "log"), atol=1e-9)


@pytest.mark.parametrize("warm", [False, True])
def test_participation_marginals(warm):
    """Pr[x_i = 1] from the sampler against the chain: cold start u_i = p(1 - sum of the
    last b-1 u), warm start the stationary rate p/(1+(b-1)p) (notes §3.2-3.3)."""
    n, b, p, count = 12, 3, 0.3, 200_000
    scheme = BMinSep.from_coefficients([1.0], n, b, p, warm)
    rows, _ = montecarlo._participations(scheme, np.random.default_rng(1), count)
    freq = np.bincount(rows, minlength=n) / count
    if warm:
        expected = np.full(n, p / (1 + (b - 1) * p))
    else:
        expected = np.zeros(n)
        for i in range(n):
            expected[i] = p * (1 - expected[max(0, i - b + 1):i].sum())
    assert np.max(np.abs(freq - expected)) < 5 * np.sqrt(0.25 / count)


def test_sampler_is_the_dominating_pair():
    """E_P[Q/P] = 1 and E_Q[P/Q] = 1: the samples come from the P and Q the loss function
    describes."""
    scheme = BMinSep.from_coefficients([1.0, 0.6, 0.3], 48, 5, 0.2, warm_start=True)
    result = MonteCarloAccountant(scheme, keep=400_000).losses(1.5, 100_000, seed=7)
    pos, neg = result.positive, result.negative  # all kept
    assert result.floor == -np.inf
    assert np.mean(np.exp(-pos)) == pytest.approx(1.0, abs=0.02)
    assert np.mean(np.exp(-neg)) == pytest.approx(1.0, abs=0.02)  # neg = ln Q/P on y ~ Q


def test_monte_carlo_matches_dp_accounting_for_identity():
    """C = I, b = 1 is DP-SGD with Poisson sampling: the estimate of delta(P||Q) must
    contain dp_accounting's value in its confidence interval (accounting.json)."""
    case = next(c for c in CASES if c["name"].startswith("monte-carlo"))
    scheme = BMinSep.from_coefficients(case["coefficients"], case["rounds"], case["min_sep"],
                                       case["sampling_probability"])
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        case["sampling_probability"], dp_accounting.GaussianDpEvent(case["noise_multiplier"])), case["rounds"]))
    analytic = acc.get_delta(case["epsilon"])
    assert analytic == pytest.approx(case["delta"], abs=1e-5)
    est = MonteCarloAccountant(scheme).estimate(case["noise_multiplier"], case["epsilon"], 300_000, seed=11,
                                                confidence=0.999)
    assert est.lower <= analytic <= est.upper
    assert est.lower <= case["delta"] <= est.upper
    assert est.upper - est.lower < 2e-3
    assert est.delta_negative < est.delta_positive  # remove direction dominates here


@pytest.mark.heavy
def test_monte_carlo_matches_dp_accounting_with_a_million_samples():
    case = next(c for c in CASES if c["name"].startswith("monte-carlo"))
    scheme = BMinSep.from_coefficients([1.0], case["rounds"], 1, case["sampling_probability"])
    est = MonteCarloAccountant(scheme, workers=2).estimate(1.0, 1.0, 1_000_000, seed=3, confidence=0.99)
    assert abs(est.delta - case["delta"]) <= 3e-4
    assert est.lower <= case["delta"] <= est.upper


def test_results_do_not_depend_on_chunking_or_workers_seed():
    scheme = BMinSep.from_coefficients([1.0, 0.5], 40, 3, 0.1)
    one = MonteCarloAccountant(scheme, chunk_size=1000).losses(1.0, 5000, seed=4, epsilons=(0.5,))
    two = MonteCarloAccountant(scheme, chunk_size=1000, keep=10).losses(1.0, 5000, seed=4, epsilons=(0.5,))
    assert one.exact[0.5] == two.exact[0.5]
    assert one.delta(0.5) == pytest.approx(one.exact[0.5], rel=1e-12)
    other = MonteCarloAccountant(scheme, chunk_size=1000).losses(1.0, 5000, seed=5, epsilons=(0.5,))
    assert other.exact[0.5] != one.exact[0.5]
    parallel = MonteCarloAccountant(scheme, chunk_size=1000, workers=2).losses(1.0, 5000, seed=4, epsilons=(0.5,))
    assert parallel.exact[0.5] == pytest.approx(one.exact[0.5], rel=1e-12)
    assert np.array_equal(parallel.positive, one.positive)


def test_estimate_monotone_in_noise_and_rounds():
    scheme = BMinSep.from_coefficients([1.0, 0.5], 64, 2, 0.1)
    acc = MonteCarloAccountant(scheme)
    hi_noise = acc.estimate(1.5, 1.0, 40_000, seed=1)
    lo_noise = acc.estimate(0.8, 1.0, 40_000, seed=1)
    assert lo_noise.lower > hi_noise.upper  # less noise => larger delta
    longer = MonteCarloAccountant(BMinSep.from_coefficients([1.0, 0.5], 256, 2, 0.1)).estimate(0.8, 1.0, 40_000, seed=1)
    assert longer.lower > lo_noise.upper  # more rounds => larger delta


def test_loss_samples_epsilon_is_consistent():
    scheme = BMinSep.from_coefficients([1.0, 0.5], 64, 2, 0.1)
    result = MonteCarloAccountant(scheme).losses(1.0, 20_000, seed=2)
    eps = result.epsilon(1e-2)
    assert max(result.delta(eps)) <= 1e-2 < max(result.delta(eps * 0.99))


def test_kl_confidence_bounds():
    up, lo = montecarlo.kl_upper_bound(0.01, 100_000, 0.95), montecarlo.kl_lower_bound(0.01, 100_000, 0.95)
    assert lo < 0.01 < up and up - 0.01 == pytest.approx(0.01 - lo, rel=0.1)
    assert montecarlo.kl_lower_bound(0.0, 100, 0.95) == 0.0
    assert 0 < montecarlo.kl_upper_bound(0.0, 1000, 0.95) < 0.005


@pytest.mark.parametrize("kwargs, match", [
    ({"coefficients": [1.0, -0.1]}, "non-negative"),
    ({"coefficients": [1.0, 0.5, 0.2], "min_sep": 2}, "L <= min_sep"),
    ({"sampling_probability": 0.0}, "probability"),
    ({"sampling_probability": 1.5}, "probability"),
    ({"noise_multiplier": 0.0}, "noise"),
    ({"min_sep": 0}, "min_sep"),
    ({"y": [np.nan, 1.0]}, "finite"),
    ({"coefficients": [0.0, 0.0]}, "zero"),
])
def test_log_likelihood_ratio_validation(kwargs, match):
    args = {"y": [1.0, 0.5], "coefficients": [1.0], "min_sep": 2, "sampling_probability": 0.3,
            "noise_multiplier": 1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        log_likelihood_ratio(**args)


def test_trailing_zero_bands_do_not_count():
    # a length-3 coefficient vector with a zero tail is a 2-band C: fine with b = 2
    assert log_likelihood_ratio([1, 1, 1], [1.0, 0.5, 0.0], 2, 0.5, 1.0) == pytest.approx(0.9239798890121712, abs=1e-12)


def test_threads_give_the_same_result_as_one_worker_even_when_one_takes_every_chunk():
    """Workers pull chunks from a shared queue, so one may get none (it used to crash) and the
    order of the per-chunk sums varies; the result must equal the one-worker result exactly."""
    from fedmf.accounting.montecarlo import _TopK

    assert _TopK(10).result().size == 0
    scheme = BMinSep.from_coefficients([1.0], 50, 1, 0.1)
    one = MonteCarloAccountant(scheme, workers=1, chunk_size=500).losses(0.5, 1000, seed=3, epsilons=(0.5,))
    for seed in range(20):
        many = MonteCarloAccountant(scheme, workers=2, chunk_size=500).losses(0.5, 1000, seed=seed, epsilons=(0.5,))
        if seed == 3:
            assert many.exact == one.exact
            np.testing.assert_array_equal(many.positive, one.positive)
            np.testing.assert_array_equal(many.negative, one.negative)
