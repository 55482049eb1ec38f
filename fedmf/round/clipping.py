"""Clipping policies: what a round's clip norm ζ is and everything that follows from it.

    policy = clipping_policy(plan)          # FixedClipping or AdaptiveClipping, once per run
    zeta, threshold = policy.clip_norm, policy.zero_threshold
    total.add_(flat, alpha=policy.factor(bound, clipped, margin))
    mean = policy.scale_back(total + noise)  # then policy.release(key, t, salt, contributed)

A policy owns, for the round it serves next: ζ, the ℓ∞ zeroing threshold, the factor each accepted
update is summed with, the std the correlated-noise generator draws with, the scaling of the noisy
sum to the released mean, the round's extra release (adaptive clipping's noisy count) and its
checkpoint entry. The privatizer (``fedmf.round.privatize``) applies it and never asks which policy it has.

* ``FixedClipping``: ζ = ``plan.clip_norm`` in every round. Each update is clipped to ζ and summed
  as is; the generator's std is σ = z·ζ·sens ("Multi-Epoch Matrix Factorization Mechanisms",
  Sec. 2 and Thm 2.2); the mean is (xₜ + σ·(C⁻¹Z)ₜ) ÷ m. Nothing else is released; no state.
* ``AdaptiveClipping``: ζₜ is fixed before round t's updates are seen (ζ₀ = ``plan.clip_norm``).
  The sum is normalized, Σ clip(Δᵢ, ζₜ)/ζₜ (sensitivity 1 per participation), the generator's
  std is z·sens (``plan.std_per_clip``), the mean is (sum + z·sens·(C⁻¹Z)ₜ)·ζₜ/m
  (post-processing). It releases the count of summed updates with norm ≤ ζₜ plus N(0, σ_b²) from
  its own keyed stream (``fedmf.round.count_noise``) and moves to ζₜ₊₁ by Andrew et al. (NeurIPS 2021),
  Alg. 1, clamped to ζ₀·[1/R, R] (``fedmf.round.adaptive_clipping``). Its checkpoint entry is
  ``{"adaptive_clipping": {"clip_norm": ζₜ₊₁}}`` in the privatizer's state.

m is always the plan's expected users per round, never the number received (ARCHITECTURE.md rule 2).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from .count_noise import count_noise

if TYPE_CHECKING:
    from ..plan import RunPlan
    from .privatize import UserReport

__all__ = ["ClippingPolicy", "FixedClipping", "AdaptiveClipping", "clipping_policy"]

#: the privatizer state's key of adaptive clipping's entry (the on-disk checkpoint format)
STATE_KEY = "adaptive_clipping"


class ClippingPolicy(ABC):
    """ζ of the round served next and what follows from it (module docstring). Holds no secret."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        #: ζ of the next round
        self.clip_norm = float(plan.clip_norm)

    #: std of the correlated-noise generator (per unit of the sum as this policy keeps it)
    generator_std: float

    @property
    @abstractmethod
    def noise_std(self) -> float:
        """The absolute noise std of the next round, z·ζ·sens (its report's ``noise_std``)."""

    @property
    @abstractmethod
    def reported_clip_norm(self) -> float | None:
        """ζ as the next round's report records it (None: ζ is the plan's, not recorded per round)."""

    @property
    @abstractmethod
    def zero_threshold(self) -> float | None:
        """The next round's ℓ∞ zeroing threshold (None: never zeroed)."""

    @property
    @abstractmethod
    def sum_unit(self) -> float:
        """The unit the sum is kept in: the released mean is (sum + noise)·``sum_unit``/m."""

    @abstractmethod
    def factor(self, bound: float, clipped: bool, margin: float) -> float:
        """What an update of ℓ2 norm at most ``bound`` is summed with (``clipped``: bound > ζ);
        ``margin`` < 1 absorbs the rounding of the scaling in the working dtype."""

    @abstractmethod
    def scale_back(self, noisy_sum: torch.Tensor) -> torch.Tensor:
        """The released mean from the noisy sum, in place."""

    def release(self, key: bytes, t: int, salt: bytes, contributed: Iterable[UserReport],
                noised: Callable[[float], float] | None = None) -> float | None:
        """Round t's extra release from the contributed users (None: none), and the move to the next
        round's ζ. ``key``: the run's noise secret; ``salt``: the round's noise salt (b"": unsalted);
        ``noised``: when the server did not see the updates (a secure sum), the noisy count from the
        count's noise (added to the bits' residue before it is centred), else counted from ``contributed``."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """This policy's entries of the privatizer's state."""
        return {}

    def read_state(self, state: Mapping[str, Any]) -> float:
        """The next round's ζ in a privatizer ``state`` (checked; nothing changes)."""
        return float(self.plan.clip_norm)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clip_norm = self.read_state(state)


class FixedClipping(ClippingPolicy):
    """ζ = ``plan.clip_norm`` in every round; noise σ = z·ζ·sens on the raw sum; ÷ m."""

    def __init__(self, plan: RunPlan) -> None:
        super().__init__(plan)
        self.generator_std = plan.noise_std

    @property
    def noise_std(self) -> float:
        return self.plan.noise_std

    @property
    def reported_clip_norm(self) -> None:
        return None

    @property
    def zero_threshold(self) -> float | None:
        return self.plan.zero_threshold

    @property
    def sum_unit(self) -> float:
        return 1.0

    def factor(self, bound: float, clipped: bool, margin: float) -> float:
        # ℓ2 clipping of the whole update to ζ: x·min(1, ζ/‖x‖) (Multi-Epoch MF Sec. 2, ζ-bounded rows),
        # with ‖x‖ replaced by a rigorous upper bound of it
        return self.clip_norm / bound * margin if clipped else 1.0

    def scale_back(self, noisy_sum: torch.Tensor) -> torch.Tensor:
        return noisy_sum.div_(self.plan.expected_users)


class AdaptiveClipping(ClippingPolicy):
    """ζₜ by Andrew et al. (NeurIPS 2021), Alg. 1 (``plan.adaptive_clipping``); the mechanism runs on
    the normalized sum Σ clip(Δ, ζₜ)/ζₜ with std z·sens, scaled back by ζₜ/m."""

    def __init__(self, plan: RunPlan) -> None:
        super().__init__(plan)
        self.rule = plan.adaptive_clipping
        self.generator_std = plan.std_per_clip

    @property
    def noise_std(self) -> float:
        return self.plan.noise_std_at(self.clip_norm)

    @property
    def reported_clip_norm(self) -> float:
        return self.clip_norm

    @property
    def zero_threshold(self) -> float | None:
        return self.plan.zero_threshold_at(self.clip_norm)

    @property
    def sum_unit(self) -> float:
        return self.clip_norm

    def factor(self, bound: float, clipped: bool, margin: float) -> float:
        # clip(Δ, ζₜ)/ζₜ = Δ·min(1/ζₜ, 1/‖Δ‖), norm ≤ 1 (the margin absorbs the rounding of 1/ζₜ too)
        return margin / (bound if clipped else self.clip_norm)

    def scale_back(self, noisy_sum: torch.Tensor) -> torch.Tensor:
        return noisy_sum.mul_(self.clip_norm / self.plan.expected_users)

    def release(self, key: bytes, t: int, salt: bytes, contributed: Iterable[UserReport],
                noised: Callable[[float], float] | None = None) -> float:
        """b̃ₜ·m = Σ 1[‖Δᵢ‖ ≤ ζₜ] + N(0, σ_b²), then ζₜ₊₁ = next_clip_norm(ζₜ, b̃ₜ·m, m) (Alg. 1).
        A zeroed update (ℓ∞ > threshold ≥ ζₜ, so ‖Δ‖ > ζₜ) counts as clipped. ``noised``: a secure
        sum's noisy count from the same noise draw (``RoundPrivatizer.finish``)."""
        noise = count_noise(key, t, salt, self.rule.count_noise_std)
        if noised is not None:
            noisy = noised(noise)
        else:
            noisy = sum(1 for u in contributed if not (u.clipped or u.zeroed)) + noise
        self.clip_norm = self.rule.next_clip_norm(self.clip_norm, noisy, self.plan.expected_users,
                                                  initial_clip_norm=self.plan.clip_norm)
        return noisy

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: {"clip_norm": self.clip_norm}}

    def read_state(self, state: Mapping[str, Any]) -> float:
        saved = state.get(STATE_KEY)
        clip_norm = saved.get("clip_norm") if isinstance(saved, Mapping) else None
        if not (isinstance(clip_norm, float) and math.isfinite(clip_norm) and clip_norm > 0):
            raise CheckpointError("privatizer state lacks the adaptive clip norm (a positive float)")
        low, high = self.rule.clip_norm_bounds(self.plan.clip_norm)
        if not low <= clip_norm <= high:  # next_clip_norm clamps every ζₜ to [ζ₀/R, ζ₀·G]
            raise CheckpointError(f"privatizer state's adaptive clip norm {clip_norm:g} is outside the rule's "
                                  f"range [{low:g}, {high:g}] (a checkpoint of another plan or edited)")
        return float(clip_norm)


def clipping_policy(plan: RunPlan) -> ClippingPolicy:
    """The plan's policy: adaptive when ``plan.adaptive_clipping`` is set, else fixed."""
    return FixedClipping(plan) if plan.adaptive_clipping is None else AdaptiveClipping(plan)
