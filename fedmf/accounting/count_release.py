"""Adaptive clipping's count release, composed with the MF mechanism; ρ-zCDP of Gaussian runs.

Each round of an adaptively clipped run (``fedmf.round.adaptive_clipping``) releases the count of
unclipped updates plus independent N(0, σ_b²) noise. Under zero-out adjacency one participation
changes the count by at most 1 (no centring: sensitivity 1), so over a user's k participations the
counts are a Gaussian mechanism with ℓ2 sensitivity √k and std σ_b: multiplier σ_b/√k.

Composition of Gaussian mechanisms: a Gaussian with multiplier z is (1/z)-GDP, and the adaptive
composition of μᵢ-GDP mechanisms is √(Σ μᵢ²)-GDP (Dong, Roth, Su, "Gaussian Differential Privacy",
JRSS-B 2022; arXiv 1905.02383, Cor. 3.3); equivalently ρ = 1/(2z²)-zCDP composes additively (Bun & Steinke,
"Concentrated Differential Privacy", TCC 2016, Prop. 1.6 and Lemma 1.7). Hence

    un-amplified (``none``):   1/z_eff² = 1/z_mf² + k/σ_b²                                     (1)
    cyclic Poisson, per step:  1/z_step² = col²/σ_u² + 1/σ_b²                                  (2)

with z_mf the MF mechanism's own multiplier, col = max_j ‖C e_j‖ and σ_u the noise std per clip norm
(z·sens): in a cyclic-Poisson step a sampled user's update enters one column of C and one count, under
the same sampling decision, so the step is one Poisson-subsampled Gaussian whose mean shift has the
norm of (2) in units of the noise (the per-step Poisson-subsampled Gaussian of "Scaling up BandMF",
Prop. 2.1; adding the count as extra rows of that Gaussian is fedmf's own extension, checked by the
issue-25 review against a direct dp_accounting composition).
Other samplers (b-min-sep Monte Carlo, MMCC) are not composed with the count here and are refused
(``fedmf.accounting.schemes.check_releases``).

Every other Gaussian release of a participation (the private client-metric release) enters these
formulas the same way: ``fedmf.accounting.releases`` composes all of a participation's releases into one
Gaussian of sensitivity 1 and std σ_unit (its (R)), and σ_unit takes σ_b's place below (σ_unit = σ_b
when the count is the only one). So ``count_noise_std`` in this module and in the sampling schemes'
accountants (``fedmf.accounting.schemes``) is that σ_unit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import checks
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..participation import Schema

__all__ = ["check_count_noise_std", "compose", "mf_multiplier", "participations", "privacy_split", "rho",
           "RHO_AMPLIFIED_NOTE"]

#: why an amplified accountant reports no ρ
RHO_AMPLIFIED_NOTE = "no zCDP bound for amplified accounting (epsilon only)"


def check_count_noise_std(count_noise_std: float | None) -> float | None:
    """None (no count release) or a positive finite σ_b."""
    return None if count_noise_std is None else checks.positive("count_noise_std", count_noise_std)


def participations(schema: Schema, rounds: int) -> int:
    """k: the most rounds one user may take part in among the first ``rounds`` rounds under ``schema``
    (the schema's own count: ceil(t/b) capped at k for MinSep(b, k) and FixedEpoch(k, b) alike)."""
    return schema.participations(rounds)


def _count_term(count_noise_std: float, count_sensitivity_sq: float) -> float:
    """Δ²/σ_b² of the counts, as (Δ/σ_b)² so that a huge σ_b underflows to 0 instead of overflowing."""
    return (math.sqrt(count_sensitivity_sq) / count_noise_std) ** 2


def compose(noise_multiplier: float, count_noise_std: float, count_sensitivity_sq: float) -> float:
    """The multiplier of the MF Gaussian (``noise_multiplier``, may be inf) composed with the count
    release of squared sensitivity ``count_sensitivity_sq`` (k in (1), 1 in (2)):
    1/z² = 1/z_mf² + Δ²/σ_b² (Dong–Roth–Su Cor. 3.3)."""
    inverse_sq = _count_term(count_noise_std, count_sensitivity_sq)
    if inverse_sq == 0.0:
        return noise_multiplier  # σ_b so large that the count adds nothing in float64: the MF multiplier itself
    if math.isfinite(noise_multiplier):
        inverse_sq += 1.0 / noise_multiplier**2
    return math.inf if inverse_sq == 0.0 else 1.0 / math.sqrt(inverse_sq)


def mf_multiplier(total_multiplier: float, count_noise_std: float, count_sensitivity_sq: float) -> float:
    """The MF multiplier z_mf whose composition (1)/(2) with the count is ``total_multiplier``;
    a one-line error when the count alone already spends the budget."""
    count = _count_term(count_noise_std, count_sensitivity_sq)
    if count == 0.0:
        return total_multiplier
    left = 1.0 / total_multiplier**2 - count
    if not left > 0.0:
        share = count * total_multiplier**2
        floor = math.sqrt(count_sensitivity_sq) * total_multiplier
        raise ConfigError(f"adaptive-clipping-count-noise: count_noise_std {count_noise_std:g} alone spends "
                          f"{share:.3g}x the privacy budget; raise it above {floor:.6g} or raise the target epsilon")
    return 1.0 / math.sqrt(left)


def privacy_split(noise_multiplier: float, count_noise_std: float, count_sensitivity_sq: float) -> dict[str, float]:
    """The fractions of μ² = 1/z_eff² from the MF mechanism and from the count (sum 1)."""
    mf = 1.0 / noise_multiplier**2
    count = _count_term(count_noise_std, count_sensitivity_sq)
    return {"mf": mf / (mf + count), "count": count / (mf + count)}


def rho(noise_multiplier: float) -> float:
    """ρ-zCDP of a Gaussian with this multiplier: 1/(2z²) (Bun & Steinke 2016, Prop. 1.6)."""
    return 0.0 if math.isinf(noise_multiplier) else 0.5 / noise_multiplier**2
