"""Estimate-Verify-Release (fedmf.accounting.evr) and the high-level b-min-sep paths of
fedmf.accounting.epsilon / calibrate."""

from __future__ import annotations

import math

import pytest

from fedmf import MinSep
from fedmf.accounting import MonteCarloOptions, calibrate, epsilon, evr, gaussian
from fedmf.accounting.bminsep import BMinSep
from fedmf.accounting.montecarlo import MonteCarloAccountant
from fedmf.mechanisms.toeplitz import BandedToeplitz


@pytest.mark.parametrize("target, expected", [(1e-3, 75_013), (1 / 180_000, 20_076_506), (1 / 360_000, 41_879_185),
                                              (2e-6, 59_299_627)])
def test_minimum_samples(target, expected):
    # notes/bandmf_b_min_sep_subsampling.md §5.6(d) (agrees with jax_privacy)
    assert evr.minimum_samples(target) == expected
    assert evr.overall_delta(expected, target / 2) <= target < evr.overall_delta(expected - 1, target / 2)


def test_overall_and_base_delta():
    # production case of the paper (§5.1): 7.5e9 samples at base delta/2
    assert evr.overall_delta(7_500_000_000, 1.301e-8 / 2) == pytest.approx(1.505e-8, rel=1e-3)
    assert evr.base_delta(7_500_000_000, 1.301e-8) == pytest.approx(5.138e-9, rel=1e-3)
    base = evr.base_delta(100_000, 1e-3)
    assert evr.overall_delta(100_000, base) <= 1e-3 < evr.overall_delta(100_000, base * 1.001)
    assert evr.failure_probability(1000, 0.01, 0.005) == 1.0
    assert evr.failure_probability(100_000, 1e-3, 2e-3) == pytest.approx(
        math.exp(-100_000 * (1e-3 * math.log(0.5) + (1 - 1e-3) * math.log((1 - 1e-3) / (1 - 2e-3)))))
    with pytest.raises(ValueError, match="too few"):
        evr.base_delta(100, 1e-3)


def _scheme():
    return BMinSep.from_coefficients([1.0, 0.5], 48, 4, 0.1)


def test_evr_verifies_below_the_fallback():
    acc = MonteCarloAccountant(_scheme())
    fallback = 5.0
    result = evr.calibrate(acc, 1.0, 2e-2, fallback, seed=3, candidates=2)
    assert result.verified and result.noise_multiplier < fallback
    assert result.overall_delta <= 2e-2 and result.samples == evr.minimum_samples(2e-2)
    # verified from the most private candidate down, each with fresh samples (distinct keys)
    sigmas = [v.noise_multiplier for v in result.verifications]
    assert sigmas == sorted(sigmas, reverse=True)
    assert len({v.key for v in result.verifications}) == len(result.verifications)
    assert all(v.passed for v in result.verifications[:-1])
    chosen = next(v for v in result.verifications if v.noise_multiplier == result.noise_multiplier)
    assert chosen.passed and max(chosen.delta_positive, chosen.delta_negative) <= result.base_delta
    # an independent, larger estimate at the chosen noise is consistent with the claim
    check = acc.estimate(result.noise_multiplier, 1.0, 60_000, seed=99, confidence=0.99)
    assert check.lower <= 2e-2


def test_evr_falls_back_when_nothing_verifies():
    acc = MonteCarloAccountant(_scheme())
    # a fallback below the amplified noise: every candidate (all < fallback) fails
    result = evr.calibrate(acc, 1.0, 2e-2, 0.3, seed=1, candidates=2)
    assert not result.verified and result.noise_multiplier == 0.3


def test_evr_rejects_too_few_samples():
    with pytest.raises(ValueError, match="certify only"):
        evr.calibrate(MonteCarloAccountant(_scheme()), 1.0, 1e-3, 5.0, samples=1000)


def _mechanism(n=48):
    return BandedToeplitz(n, [0.9, 0.45])


def test_high_level_calibrate_bminsep():
    mech, schema = _mechanism(), MinSep(4)
    result = calibrate(mech, 1.0, 2e-2, schema, sampling="bminsep:0.1",
                       monte_carlo=MonteCarloOptions(seed=5, candidates=2))
    sens = mech.sensitivity(schema).value
    assert result.accountant == "bminsep-evr"
    assert result.noise_std_per_clip_norm == pytest.approx(result.noise_multiplier * sens)
    # amplification: less noise than the un-amplified calibration
    assert result.noise_multiplier < gaussian.calibrate(1.0, 2e-2)
    assert result.details["evr"]["fallback_noise_multiplier"] == pytest.approx(
        gaussian.calibrate(1.0, result.details["evr"]["base_delta"]) * sens)


def test_high_level_epsilon_bminsep():
    mech, schema = _mechanism(), MinSep(4)
    result = epsilon(mech, 0.5, 2e-2, schema, sampling="bminsep:0.1", monte_carlo=MonteCarloOptions(seed=2))
    assert result.accountant == "bminsep-monte-carlo"
    d = result.details
    assert result.epsilon == d["epsilon_monte_carlo"] < d["epsilon_unamplified"]
    assert max(d["delta_positive"], d["delta_negative"]) <= d["base_delta"] and d["overall_delta"] <= 2e-2
    # the point estimate at delta itself is below the verified epsilon (verified at delta' < delta)
    assert d["epsilon_estimate"] <= result.epsilon
    # with a lot of noise the un-amplified bound is reported (it is a guarantee)
    big = epsilon(mech, 50.0, 2e-2, schema, sampling="bminsep:0.9", monte_carlo=MonteCarloOptions(seed=2))
    assert big.epsilon <= big.details["epsilon_unamplified"]


def test_bminsep_needs_bands_within_min_sep():
    with pytest.raises(ValueError, match="bands"):
        epsilon(BandedToeplitz(48, [1.0, 0.5, 0.2]), 1.0, 1e-2, MinSep(2), sampling="bminsep:0.1")
    with pytest.raises(ValueError, match="non-negative"):
        epsilon(BandedToeplitz(48, [1.0, -0.5]), 1.0, 1e-2, MinSep(2), sampling="bminsep:0.1")
    with pytest.raises(ValueError, match="per-round"):
        epsilon(_mechanism(), 1.0, 1e-2, MinSep(4), sampling="bminsep:0.1", per_round=True)
