"""Adaptive clipping: the clip norm ζₜ follows a target quantile of the update norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive Clipping"
(NeurIPS 2021), Alg. 1, with the sign as published: each round the server counts the updates whose
norm is at most ζₜ (unclipped), releases the count with Gaussian noise of std ``count_noise_std``,
and moves ζ geometrically toward the target quantile γ,

    b̃ₜ = (Σᵢ 1[‖Δᵢ‖ ≤ ζₜ] + N(0, σ_b²)) / m,        ζₜ₊₁ = clamp(ζₜ · exp(−η · (b̃ₜ − γ)), ζ₀/R, ζ₀·G),

so ζ shrinks when more than γ of the updates fit under it and grows when fewer do, and never leaves
one range around ζ₀ (R = ``clip_norm_range``, default 10, and G = ``max_growth``, default R: the clamp
that stops a runaway; G = 1 makes ζ₀ a ceiling that ζ only goes below). m is the plan's
expected users per round (never the number received: ARCHITECTURE.md rule 2). ζₜ is fixed before
round t's updates are clipped, and round t's correlated noise is scaled by the same ζₜ; ζₜ₊₁ is a
function of released values only (post-processing). The count's release is a second Gaussian
mechanism that the accountant composes with the MF mechanism (``fedmf.accounting``).

This module is the description (``AdaptiveClipping``, frozen) and the update rule; the round's
clipping policy of the same name (``fedmf.round.clipping.AdaptiveClipping``) applies it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import checks
from ..errors import ConfigError

__all__ = ["AdaptiveClipping", "DEFAULT_LEARNING_RATE", "DEFAULT_COUNT_NOISE_FRACTION", "MAX_LOG_STEP",
           "DEFAULT_CLIP_NORM_RANGE", "LEGACY_CLIP_NORM_RANGE", "AT_BOUND_ROUNDS", "GROWTH_ROUNDS",
           "trajectory_warnings", "adaptive_metrics"]

#: η of Andrew et al. (Sec. 3.1: 0.2 works across their tasks)
DEFAULT_LEARNING_RATE = 0.2
#: σ_b = m / 20 (Andrew et al., Sec. 3.1 and Sec. 4: "σ_b = m/20")
DEFAULT_COUNT_NOISE_FRACTION = 1.0 / 20.0
#: |η·(b̃ − γ)| is clamped here so that ζ stays a finite positive float whatever noise the count
#: draws (post-processing; unreachable unless σ_b/m is huge)
MAX_LOG_STEP = 30.0
#: ζₜ stays within [ζ₀ / R, ζ₀ · R] (R = ``clip_norm_range``), by default one decade either way of ζ₀:
#: the released update scales with ζ (all updates clipped: the step is ζ·server-lr, and the noise
#: z·ζ·sens grows with it), so a ζ that follows noise-inflated norms upward runs away (EXPERIMENTS.md,
#: "Adaptive clipping that cannot run away"); the clamp is post-processing (no privacy cost) and also
#: keeps hostile clients from driving ζ to 0 or past the model's dtype
DEFAULT_CLIP_NORM_RANGE = 10.0
#: the range of plans written before ``clip_norm_range`` existed (their dict has no such key)
LEGACY_CLIP_NORM_RANGE = 1e6
#: ``trajectory_warnings``: ζ at one bound for this many consecutive rounds is reported
AT_BOUND_ROUNDS = 10
#: ``trajectory_warnings``: ζ rising in this many consecutive rounds is reported (from ζ₀ = the
#: γ-quantile / 10 the rule needs ln(10)/(η·γ) = 23 rounds at η = 0.2, γ = 0.5 to get there)
GROWTH_ROUNDS = 25
_BOUND_TOL = 1e-9


@dataclass(frozen=True)
class AdaptiveClipping:
    """How ζ adapts: ``target_quantile`` γ ∈ (0, 1) (the fraction of updates left unclipped),
    ``learning_rate`` η > 0, ``count_noise_std`` σ_b > 0 (absolute std of the noise on the count of
    unclipped updates, in updates), ``clip_norm_range`` R ≥ 1 and ``max_growth`` G ≥ 1 (ζ stays within
    [ζ₀/R, ζ₀·G]; G None: R). The initial ζ₀ is the plan's ``clip_norm``."""

    target_quantile: float
    learning_rate: float
    count_noise_std: float
    clip_norm_range: float = DEFAULT_CLIP_NORM_RANGE
    max_growth: float | None = None

    @classmethod
    def create(cls, target_quantile: float, *, expected_users: float, learning_rate: float = DEFAULT_LEARNING_RATE,
               count_noise_std: float | None = None,
               clip_norm_range: float = DEFAULT_CLIP_NORM_RANGE,
               max_growth: float | None = None) -> AdaptiveClipping:
        """Validated; ``count_noise_std`` defaults to m/20 (Andrew et al.), ``max_growth`` to
        ``clip_norm_range``."""
        gamma = checks.interval("target_quantile", target_quantile, 0.0, 1.0, low_open=True, high_open=True)
        eta = checks.positive("learning_rate", learning_rate)
        m = checks.positive("expected_users", expected_users)
        sigma_b = m * DEFAULT_COUNT_NOISE_FRACTION if count_noise_std is None else checks.positive(
            "count_noise_std", count_noise_std)
        span = checks.interval("clip_norm_range", clip_norm_range, 1.0, LEGACY_CLIP_NORM_RANGE)
        growth = None if max_growth is None else float(
            checks.interval("max_growth", max_growth, 1.0, LEGACY_CLIP_NORM_RANGE))
        if growth == float(span):  # G = R is the default rule: one description, one fingerprint
            growth = None
        return cls(float(gamma), float(eta), float(sigma_b), float(span), growth)

    @property
    def growth(self) -> float:
        """G: ζ never exceeds ζ₀·G (``max_growth``, or R when it is not set)."""
        return _growth(self.clip_norm_range, self.max_growth)

    def clip_norm_bounds(self, initial_clip_norm: float) -> tuple[float, float]:
        """[ζ₀/R, ζ₀·G]: the range ζₜ never leaves."""
        return _bounds(initial_clip_norm, self.clip_norm_range, self.max_growth)

    def next_clip_norm(self, clip_norm: float, noisy_unclipped: float, expected_users: float, *,
                       initial_clip_norm: float) -> float:
        """ζₜ₊₁ = ζₜ·exp(−η·(b̃ₜ − γ)) with b̃ₜ = ``noisy_unclipped`` / m (Andrew et al., Alg. 1),
        kept within [ζ₀/R, ζ₀·G] (ζ₀ = ``initial_clip_norm``). A function of ζₜ, the released noisy
        count and public constants (η, γ, m, ζ₀, R, G) only: post-processing."""
        fraction = noisy_unclipped / expected_users
        step = -self.learning_rate * (fraction - self.target_quantile)
        step = min(max(step, -MAX_LOG_STEP), MAX_LOG_STEP)
        low, high = self.clip_norm_bounds(initial_clip_norm)
        return min(max(clip_norm * math.exp(step), low), high)

    def to_dict(self) -> dict[str, Any]:
        """The rule's description (R = the legacy 10⁶ and an unset G are left out: plans written before
        they existed keep their fingerprints, and read back as they were)."""
        out = {"target_quantile": self.target_quantile, "learning_rate": self.learning_rate,
               "count_noise_std": self.count_noise_std}
        if self.clip_norm_range != LEGACY_CLIP_NORM_RANGE:
            out["clip_norm_range"] = self.clip_norm_range
        if self.max_growth is not None:
            out["max_growth"] = self.max_growth
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdaptiveClipping:
        if not isinstance(data, Mapping):
            raise ConfigError(f"adaptive_clipping must be a mapping, got {type(data).__name__}")
        try:
            gamma, eta, sigma_b = data["target_quantile"], data["learning_rate"], data["count_noise_std"]
        except KeyError as e:
            raise ConfigError(f"adaptive_clipping lacks {e}") from None
        return cls.create(gamma, expected_users=1.0, learning_rate=eta, count_noise_std=sigma_b,
                          clip_norm_range=data.get("clip_norm_range", LEGACY_CLIP_NORM_RANGE),
                          max_growth=data.get("max_growth"))


def _growth(clip_norm_range: float, max_growth: float | None) -> float:
    """G: ``max_growth``, or R when it is not set."""
    return clip_norm_range if max_growth is None else max_growth


def _bounds(initial_clip_norm: float, clip_norm_range: float, max_growth: float | None) -> tuple[float, float]:
    """[ζ₀/R, ζ₀·G]: the one place the rule's range is computed (the rule and its warnings)."""
    return initial_clip_norm / clip_norm_range, initial_clip_norm * _growth(clip_norm_range, max_growth)


def _longest_streak(flags: Sequence[bool]) -> tuple[int, int]:
    """(length, first index) of the longest run of True in ``flags`` (the earliest on ties)."""
    best, start, run = (0, 0), 0, 0
    for i, flag in enumerate(flags):
        run = run + 1 if flag else 0
        if run == 1:
            start = i
        if run > best[0]:
            best = (run, start)
    return best


def trajectory_warnings(zetas: Sequence[float], rounds: Sequence[int], initial_clip_norm: float,
                        clip_norm_range: float, max_growth: float | None = None) -> list[str]:
    """One line per sign that ζ did not settle on its quantile: ζₜ at a bound ζ₀/R or ζ₀·G for
    ``AT_BOUND_ROUNDS`` or more consecutive rounds, or rising in ``GROWTH_ROUNDS`` or more consecutive
    rounds (a runaway: larger ζ, larger noise z·ζ·sens, larger update norms, larger ζ). ``zetas[i]``
    is the ζ of round ``rounds[i]`` (committed rounds, in order). Reads released values only."""
    out: list[str] = []
    zetas = [float(z) for z in zetas]
    growth = _growth(clip_norm_range, max_growth)
    low, high = _bounds(initial_clip_norm, clip_norm_range, max_growth)
    upper_hint = ("ζ no longer follows the update norms' target quantile (it lies above the range, or "
                  "the norms grow with the noise) and acts as a fixed clip norm at this bound; a larger bound "
                  "makes every step and its noise larger: lower the server learning rate with it")
    if growth == 1.0:
        upper_hint = ("ζ₀ is the ceiling and fewer than the target quantile of the updates fit under it: the run "
                      "clipped as a fixed ζ₀ would, and the count's share of the budget bought nothing")
    for name, bound, factor, hint in (
            ("upper", high, f"ζ₀ · {growth:g}", upper_hint),
            ("lower", low, f"ζ₀ / {clip_norm_range:g}",
             "the update norms' target quantile lies below the range: lower --clip-norm")):
        length, first = _longest_streak([abs(z - bound) <= _BOUND_TOL * bound for z in zetas])
        if length >= AT_BOUND_ROUNDS:
            out.append(f"ζ sat at its {name} bound {bound:.6g} ({factor}) for {length} rounds "
                       f"({rounds[first]}–{rounds[first + length - 1]}): " + hint)
    rises = [False] + [b > a for a, b in zip(zetas, zetas[1:])]
    length, first = _longest_streak(rises)
    if length >= GROWTH_ROUNDS:
        a, b = first - 1, first + length - 1
        out.append(f"ζ rose in each of {length} consecutive rounds ({rounds[a]}–{rounds[b]}, {zetas[a]:.6g} → "
                   f"{zetas[b]:.6g}): it did not settle on the target quantile; if the held-out loss rose with it, "
                   "the run ran away (larger ζ, larger noise, larger update norms)")
    return out


def adaptive_metrics(clip_norm: float, noisy_unclipped: float, expected_users: float) -> dict[str, float]:
    """A committed adaptive round's released metrics: ``clip-norm`` ζₜ and ``noisy-unclipped-fraction`` b̃ₜ/m."""
    return {"clip-norm": float(clip_norm), "noisy-unclipped-fraction": float(noisy_unclipped) / expected_users}
