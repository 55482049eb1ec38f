"""Amplified BandMF with cyclic Poisson sampling, and DP-SGD with Poisson sampling,
through dp_accounting events.

Cyclic Poisson ("(Amplified) Banded Matrix Factorization", Choquette-Choo et al. 2023;
"Scaling up BandMF" Prop. 2.1 / notes §3.3): the users are split into b groups, group
(t mod b) is active in round t and each of its users is included with probability q.
If C is lower-triangular with at most b bands, the columns of one user's rounds
t, t+b, t+2b, … have disjoint row supports, so the run is the adaptive composition of
ceil(n/b) Poisson-subsampled Gaussian mechanisms (worst group: the one active in round
0), each with sensitivity ||C e_t|| <= max column norm:
    SelfComposed(PoissonSampled(q, Gaussian(noise_std_per_clip_norm / max_col_norm)), ceil(n/b)).
b = 1 and C = I is DP-SGD with Poisson sampling (n steps at rate q).
``noise_std_per_clip_norm`` is the noise standard deviation divided by the clip norm (z·sens).
"""

from __future__ import annotations

import functools
import math

from scipy import optimize

from .. import checks
from .gaussian import check_accountant

__all__ = ["event", "epsilon", "delta", "calibrate", "steps"]

#: dp_accounting PLD discretization (accounting.json's reference values use 1e-4)
DISCRETIZATION = 1e-4


def steps(rounds: int, min_sep: int) -> int:
    """Rounds in which the worst group is active: ceil(n/b)."""
    return -(-checks.positive_int("rounds", rounds) // checks.positive_int("min_sep", min_sep))


def event(noise_multiplier: float, sampling_probability: float, count: int):
    """The dp_accounting event: count-fold Poisson-subsampled Gaussian."""
    import dp_accounting

    inner = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_probability < 1.0:
        inner = dp_accounting.PoissonSampledDpEvent(sampling_probability, inner)
    return dp_accounting.SelfComposedDpEvent(inner, count) if count > 1 else inner


def _accountant(accountant: str):
    import dp_accounting

    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=DISCRETIZATION)


@functools.lru_cache(maxsize=4096)
def _epsilon(z: float, q: float, count: int, delta: float, accountant: str) -> float:
    acc = _accountant(accountant)
    acc.compose(event(z, q, count))
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def _delta(z: float, q: float, count: int, epsilon: float, accountant: str) -> float:
    acc = _accountant(accountant)
    acc.compose(event(z, q, count))
    return float(acc.get_delta(epsilon))


def _check(noise_multiplier, sampling_probability, count, accountant):
    return (
        checks.positive("noise multiplier", noise_multiplier),
        checks.probability("sampling probability", sampling_probability),
        checks.positive_int("steps", count),
        check_accountant(accountant),
    )


def epsilon(noise_multiplier: float, sampling_probability: float, count: int, delta: float,
            accountant: str = "pld") -> float:
    """epsilon(delta) of ``count`` Poisson-subsampled Gaussians (multiplier = noise std /
    per-participation sensitivity). Cached."""
    z, q, count, accountant = _check(noise_multiplier, sampling_probability, count, accountant)
    return _epsilon(z, q, count, checks.open_unit("delta", delta), accountant)


def delta(noise_multiplier: float, sampling_probability: float, count: int, epsilon: float,
          accountant: str = "pld") -> float:
    z, q, count, accountant = _check(noise_multiplier, sampling_probability, count, accountant)
    return _delta(z, q, count, checks.positive("epsilon", epsilon), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon_coarse(z: float, q: float, count: int, delta: float, accountant: str) -> float:
    if accountant == "rdp":
        return _epsilon(z, q, count, delta, accountant)
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=COARSE_DISCRETIZATION)
    acc.compose(event(z, q, count))
    return float(acc.get_epsilon(delta))


#: discretization of the calibration search; the result is then checked at DISCRETIZATION
COARSE_DISCRETIZATION = 1e-3


@functools.lru_cache(maxsize=1024)
def _calibrate(epsilon: float, delta: float, q: float, count: int, accountant: str, rtol: float) -> float:
    """Brent's method on log z with a coarse PLD (fast), then the answer is checked, and
    nudged up if needed, with the reference discretization: epsilon(z) <= target holds for
    the accountant that ``epsilon`` uses."""
    from . import gaussian

    def excess(log_z: float) -> float:  # epsilon(z) - target, decreasing in z
        return _epsilon_coarse(math.exp(log_z), q, count, delta, accountant) - epsilon

    # bracket: with q = 1 the composition is one Gaussian with multiplier z/sqrt(count),
    # so sqrt(count)·z_gauss suffices; amplification only lowers it.
    hi = math.log(math.sqrt(count) * gaussian.calibrate(epsilon, delta) * 1.01)
    lo = hi - 1.0
    while excess(lo) < 0:
        lo -= 1.0
    while excess(hi) > 0:  # numerical safety
        hi += 0.5
    log_z = optimize.brentq(excess, lo, hi, xtol=rtol / 4, rtol=rtol / 4)
    z = math.exp(log_z + rtol / 2)
    step = max(rtol, 1e-5)
    while _epsilon(z, q, count, delta, accountant) > epsilon:
        z *= 1 + step
        step *= 2
    return z


def calibrate(epsilon: float, delta: float, sampling_probability: float, count: int,
              accountant: str = "pld", rtol: float = 1e-6) -> float:
    """The smallest multiplier (within ``rtol``, on the safe side) whose ``count``-fold
    Poisson-subsampled Gaussian is (epsilon, delta)-DP. Cached."""
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    q = checks.probability("sampling probability", sampling_probability)
    count = checks.positive_int("steps", count)
    return _calibrate(epsilon, delta, q, count, check_accountant(accountant), float(rtol))
