"""Adaptive clipping: the clip norm ζₜ follows a target quantile of the update norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive Clipping"
(NeurIPS 2021), Alg. 1, with the sign as published: each round the server counts the updates whose
norm is at most ζₜ (unclipped), releases the count with Gaussian noise of std ``count_noise_std``,
and moves ζ geometrically toward the target quantile γ,

    b̃ₜ = (Σᵢ 1[‖Δᵢ‖ ≤ ζₜ] + N(0, σ_b²)) / m,        ζₜ₊₁ = ζₜ · exp(−η · (b̃ₜ − γ)),

so ζ shrinks when more than γ of the updates fit under it and grows when fewer do. m is the plan's
expected users per round (never the number received: ARCHITECTURE.md rule 2). ζₜ is fixed before
round t's updates are clipped, and round t's correlated noise is scaled by the same ζₜ; ζₜ₊₁ is a
function of released values only (post-processing). The count's release is a second Gaussian
mechanism that the accountant composes with the MF mechanism (``fedmf.accounting``).

This module is the description (``AdaptiveClipping``, frozen) and the update rule; the privatizer
applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from . import checks
from .errors import ConfigError

__all__ = ["AdaptiveClipping", "DEFAULT_LEARNING_RATE", "DEFAULT_COUNT_NOISE_FRACTION", "MAX_LOG_STEP",
           "CLIP_NORM_RANGE"]

#: η of Andrew et al. (Sec. 3.1: 0.2 works across their tasks)
DEFAULT_LEARNING_RATE = 0.2
#: σ_b = m / 20 (Andrew et al., Sec. 3.1 and Sec. 4: "σ_b = m/20")
DEFAULT_COUNT_NOISE_FRACTION = 1.0 / 20.0
#: |η·(b̃ − γ)| is clamped here so that ζ stays a finite positive float whatever noise the count
#: draws (post-processing; unreachable unless σ_b/m is huge)
MAX_LOG_STEP = 30.0
#: ζₜ stays within [ζ₀ / CLIP_NORM_RANGE, ζ₀ · CLIP_NORM_RANGE]: hostile clients (all far above or
#: all far below ζ) cannot drive ζ to 0 or past the model's dtype (post-processing: no privacy cost)
CLIP_NORM_RANGE = 1e6


@dataclass(frozen=True)
class AdaptiveClipping:
    """How ζ adapts: ``target_quantile`` γ ∈ (0, 1) (the fraction of updates left unclipped),
    ``learning_rate`` η > 0, ``count_noise_std`` σ_b > 0 (absolute std of the noise on the count of
    unclipped updates, in updates). The initial ζ₀ is the plan's ``clip_norm``."""

    target_quantile: float
    learning_rate: float
    count_noise_std: float

    @classmethod
    def create(cls, target_quantile: float, *, expected_users: float, learning_rate: float = DEFAULT_LEARNING_RATE,
               count_noise_std: float | None = None) -> "AdaptiveClipping":
        """Validated; ``count_noise_std`` defaults to m/20 (Andrew et al.)."""
        gamma = checks.interval("target_quantile", target_quantile, 0.0, 1.0, low_open=True, high_open=True)
        eta = checks.positive("learning_rate", learning_rate)
        m = checks.positive("expected_users", expected_users)
        sigma_b = m * DEFAULT_COUNT_NOISE_FRACTION if count_noise_std is None else checks.positive(
            "count_noise_std", count_noise_std)
        return cls(float(gamma), float(eta), float(sigma_b))

    def next_clip_norm(self, clip_norm: float, noisy_unclipped: float, expected_users: float, *,
                       initial_clip_norm: float) -> float:
        """ζₜ₊₁ = ζₜ·exp(−η·(b̃ₜ − γ)) with b̃ₜ = ``noisy_unclipped`` / m (Andrew et al., Alg. 1),
        kept within ζ₀·[1/CLIP_NORM_RANGE, CLIP_NORM_RANGE] (ζ₀ = ``initial_clip_norm``)."""
        fraction = noisy_unclipped / expected_users
        step = -self.learning_rate * (fraction - self.target_quantile)
        step = min(max(step, -MAX_LOG_STEP), MAX_LOG_STEP)
        low, high = initial_clip_norm / CLIP_NORM_RANGE, initial_clip_norm * CLIP_NORM_RANGE
        return min(max(clip_norm * math.exp(step), low), high)

    def to_dict(self) -> dict[str, Any]:
        return {"target_quantile": self.target_quantile, "learning_rate": self.learning_rate,
                "count_noise_std": self.count_noise_std}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AdaptiveClipping":
        if not isinstance(data, Mapping):
            raise ConfigError(f"adaptive_clipping must be a mapping, got {type(data).__name__}")
        try:
            gamma, eta, sigma_b = data["target_quantile"], data["learning_rate"], data["count_noise_std"]
        except KeyError as e:
            raise ConfigError(f"adaptive_clipping lacks {e}") from None
        return cls.create(gamma, expected_users=1.0, learning_rate=eta, count_noise_std=sigma_b)
