"""μ-Gaussian differential privacy: composition, the (ε, δ) conversion and a run's μ², for lifetime
budgets (``fedmf.budgets``).

Dong, Roth, Su, "Gaussian Differential Privacy" (JRSS-B 2022, arXiv 1905.02383):

* Cor. 3.3: the composition of μ₁-, …, μₖ-GDP mechanisms is √(μ₁² + … + μₖ²)-GDP;
* Cor. 2.13: μ-GDP is (ε, δ(ε))-DP for every ε ≥ 0, with
  δ(ε) = Φ(−ε/μ + μ/2) − e^ε · Φ(−ε/μ − μ/2)
  (the same curve as Balle and Wang 2018, "analytic Gaussian mechanism", Thm. 8, at μ = Δ/σ).

A Gaussian mechanism of sensitivity Δ and noise std σ is (Δ/σ)-GDP; a matrix-factorization run with
noise multiplier z (σ = z·ζ·sens) is (1/z)-GDP against the worst participation pattern its schema
allows (no amplification). All math in float64.
"""

from __future__ import annotations

import math

from .. import checks

__all__ = ["delta_for", "epsilon_for", "mu_for", "compose", "run_mu_squared", "MU_MAX"]

#: the largest μ ``mu_for`` returns (δ(ε) → 1 long before: no budget is that large)
MU_MAX = 1e3
_XTOL = 1e-13
_RTOL = 1e-15


def delta_for(mu: float, epsilon: float) -> float:
    """δ(ε) of a μ-GDP mechanism (Dong et al. Cor. 2.13), computed as Φ(a) − exp(ε + log Φ(b))."""
    if mu <= 0:
        return 0.0
    from scipy.special import log_ndtr, ndtr  # here: `fedmf budget set` computes no δ and loads no scipy

    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    return max(float(ndtr(a) - math.exp(epsilon + float(log_ndtr(b)))), 0.0)


def epsilon_for(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for a μ-GDP mechanism (δ(ε) decreases in ε)."""
    mu = checks.non_negative("mu", mu)
    delta = checks.open_unit("delta", delta)
    if delta_for(mu, 0.0) <= delta:
        return 0.0
    high = max(1.0, mu * mu)
    while delta_for(mu, high) > delta:
        high *= 2.0
    from scipy.optimize import brentq

    epsilon = float(brentq(lambda e: delta_for(mu, e) - delta, 0.0, high, xtol=_XTOL, rtol=_RTOL))
    while delta_for(mu, epsilon) > delta:  # the root may sit a rounding error below: stay on the safe side
        epsilon += _XTOL + _RTOL * epsilon
    return epsilon


def mu_for(epsilon: float, delta: float) -> float:
    """The largest μ whose mechanism is (ε, δ)-DP (δ(ε) increases in μ): the GDP form of an (ε, δ) budget."""
    epsilon = checks.non_negative("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    if delta_for(MU_MAX, epsilon) <= delta:
        return MU_MAX
    low, high = 0.0, 1.0
    while delta_for(high, epsilon) <= delta:
        low, high = high, 2.0 * high
    from scipy.optimize import brentq

    mu = float(brentq(lambda m: delta_for(m, epsilon) - delta, low, high, xtol=_XTOL, rtol=_RTOL))
    while mu > 0 and delta_for(mu, epsilon) > delta:  # the root may sit a rounding error above: stay inside
        mu = max(mu - _XTOL - _RTOL * mu, 0.0)
    return mu


def compose(mu_squares: list[float] | tuple[float, ...]) -> float:
    """μ of the composition of mechanisms with the given μ² (Dong et al. Cor. 3.3): √Σμ²."""
    return math.sqrt(math.fsum(mu_squares))


def run_mu_squared(plan) -> float:
    """μ² of a run's worst case, unamplified: 1/z² (σ = z·ζ·sens) plus, with extra Gaussian releases
    (adaptive clipping's count, the private client-metric release), k/σ_unit² for k participations'
    releases (σ_unit: ``fedmf.accounting.releases`` (R); σ_b with the count alone; Dong et al. Cor. 3.3)."""
    from .count_release import participations

    mu2 = 1.0 / plan.noise_multiplier ** 2
    if plan.extra_noise_std is not None:
        mu2 += participations(plan.schema, plan.rounds) / plan.extra_noise_std ** 2
    return mu2
