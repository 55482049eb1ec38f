"""fedmf.accounting.gaussian and cyclic_poisson: every analytic value of
tests/data/accounting.json, agreement with dp_accounting, calibration (and its
cache), monotonicity and input validation."""

from __future__ import annotations

import math
import time

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

from fedmf.accounting import cyclic_poisson, gaussian
from tests.reference import load_cases

CASES = load_cases("accounting.json")


def cases(name: str) -> list[dict]:
    return [c for c in CASES if c["name"] == name]


# ---------------------------------------------------------------------------------------
# reference values
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", cases("gaussian"), ids=lambda c: f"z={c['noise_multiplier']}")
def test_reference_gaussian_epsilon(case):
    eps = gaussian.epsilon(case["noise_multiplier"], case["delta"])
    assert abs(eps - case["epsilon"]) <= case["tol"] * case["epsilon"]
    vec = gaussian.epsilons([case["noise_multiplier"]], case["delta"])[0]
    assert abs(vec - eps) <= 1e-10 * eps


@pytest.mark.parametrize("case", cases("gaussian calibration"), ids=lambda c: f"eps={c['epsilon']}")
def test_reference_gaussian_calibration(case):
    z = gaussian.calibrate(case["epsilon"], case["delta"])
    assert abs(z - case["noise_multiplier"]) <= case["tol"] * case["noise_multiplier"]
    # on the safe side of the curve
    assert GaussianPrivacyLoss(z, sensitivity=1.0).get_delta_for_epsilon(case["epsilon"]) <= case["delta"]


@pytest.mark.parametrize("case", cases("dp-sgd poisson"), ids=lambda c: f"z={c['noise_multiplier']}-n={c['rounds']}")
def test_reference_dpsgd_poisson(case):
    eps = cyclic_poisson.epsilon(case["noise_multiplier"], case["sampling_probability"], case["rounds"], case["delta"])
    assert abs(eps - case["epsilon"]) <= case["tol"] * case["epsilon"]


# ---------------------------------------------------------------------------------------
# the exact Gaussian curve
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("z", [0.3, 0.6529353843582156, 1.0, 4.0, 25.0])
def test_closed_form_matches_dp_accounting(z):
    eps = np.array([0.0, 0.1, 1.0, 3.0, 8.0])
    ours = gaussian.delta_for_epsilon(z, eps)
    ref = np.array([GaussianPrivacyLoss(z, sensitivity=1.0).get_delta_for_epsilon(e) for e in eps])
    assert np.allclose(ours, ref, rtol=1e-9, atol=1e-300)
    if z < 1.0:
        return  # the discretized accountant is slow for small multipliers
    # and the discretized PLD accountant at the default interval
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z))
    assert abs(acc.get_epsilon(1e-6) - gaussian.epsilon(z, 1e-6)) <= 1e-4 * max(1.0, gaussian.epsilon(z, 1e-6))


def test_epsilon_inverts_delta():
    z = np.exp(np.linspace(np.log(0.2), np.log(50), 41))
    eps = gaussian.epsilons(z, 1e-6)
    back = gaussian.delta_for_epsilon(z, eps)
    assert np.all(back <= 1e-6) and np.all(back >= 1e-6 * (1 - 1e-8))


def test_monotone_in_noise_and_delta():
    z = np.linspace(0.3, 30, 200)
    eps = gaussian.epsilons(z, 1e-6)
    assert np.all(np.diff(eps) < 0)  # less noise => larger epsilon
    assert gaussian.epsilon(1.0, 1e-8) > gaussian.epsilon(1.0, 1e-6) > gaussian.epsilon(1.0, 1e-3)


def test_zero_epsilon_and_infinite_noise():
    # delta above delta(0): epsilon 0; a user who never took part: infinite multiplier
    assert gaussian.epsilons([50.0, np.inf], 0.5).tolist() == [0.0, 0.0]
    assert gaussian.epsilon(50.0, 0.5) == 0.0


def test_rdp_is_looser_than_pld():
    for z in (0.7, 2.0, 10.0):
        assert gaussian.epsilon(z, 1e-6, "rdp") > gaussian.epsilon(z, 1e-6)
    z = gaussian.calibrate(1.0, 1e-6, "rdp")
    assert z > gaussian.calibrate(1.0, 1e-6)
    assert gaussian.epsilon(z, 1e-6, "rdp") <= 1.0 + 1e-6


def test_calibration_is_cached():
    gaussian.calibrate(3.3, 1e-7)
    started = time.perf_counter()
    for _ in range(1000):
        gaussian.calibrate(3.3, 1e-7)
    assert time.perf_counter() - started < 0.1


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-6, 2.0, math.nan, math.inf, "x", True])
def test_bad_delta(bad):
    with pytest.raises(ValueError, match="delta"):
        gaussian.epsilon(1.0, bad)
    with pytest.raises(ValueError, match="delta"):
        gaussian.calibrate(1.0, bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_noise_and_epsilon(bad):
    with pytest.raises(ValueError, match="noise"):
        gaussian.epsilon(bad, 1e-6)
    with pytest.raises(ValueError, match="epsilon"):
        gaussian.calibrate(bad, 1e-6)
    with pytest.raises(ValueError, match="accountant"):
        gaussian.epsilon(1.0, 1e-6, "moments")


# ---------------------------------------------------------------------------------------
# cyclic Poisson / DP-SGD with Poisson sampling
# ---------------------------------------------------------------------------------------
def test_cyclic_poisson_is_dpsgd_with_n_over_b_steps():
    # "Scaling up BandMF" Prop. 2.1: BandMF with b groups = DP-SGD for n/b steps
    assert cyclic_poisson.steps(2048, 64) == 32 and cyclic_poisson.steps(100, 7) == 15
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(3.0)), 15))
    assert cyclic_poisson.epsilon(3.0, 0.05, 15, 1e-6) == pytest.approx(acc.get_epsilon(1e-6), rel=1e-12)


def test_cyclic_poisson_full_sampling_is_composed_gaussian():
    # q = 1: k Gaussians with multiplier z compose to one with multiplier z/sqrt(k)
    eps = cyclic_poisson.epsilon(2.0, 1.0, 4, 1e-6)
    assert eps == pytest.approx(gaussian.epsilon(1.0, 1e-6), rel=2e-3)


def test_cyclic_poisson_monotone():
    base = cyclic_poisson.epsilon(3.0, 0.05, 10, 1e-6)
    assert cyclic_poisson.epsilon(3.0, 0.05, 20, 1e-6) > base  # more rounds
    assert cyclic_poisson.epsilon(2.5, 0.05, 10, 1e-6) > base  # less noise
    assert cyclic_poisson.epsilon(3.0, 0.10, 10, 1e-6) > base  # more participation


def test_cyclic_poisson_calibration_inverts():
    z = cyclic_poisson.calibrate(0.5, 1e-6, 0.05, 10)
    assert cyclic_poisson.epsilon(z, 0.05, 10, 1e-6) <= 0.5
    assert cyclic_poisson.epsilon(z * (1 - 1e-3), 0.05, 10, 1e-6) > 0.5
    started = time.perf_counter()
    assert cyclic_poisson.calibrate(0.5, 1e-6, 0.05, 10) == z
    assert time.perf_counter() - started < 0.01


def test_cyclic_poisson_validation():
    with pytest.raises(ValueError, match="probability"):
        cyclic_poisson.epsilon(1.0, 0.0, 10, 1e-6)
    with pytest.raises(ValueError, match="probability"):
        cyclic_poisson.epsilon(1.0, 1.5, 10, 1e-6)
    with pytest.raises(ValueError, match="steps"):
        cyclic_poisson.epsilon(1.0, 0.1, 0, 1e-6)
