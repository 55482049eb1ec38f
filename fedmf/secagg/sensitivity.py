"""How quantization for secure aggregation enters the sensitivity.

Each client's quantized update x̃ satisfies ‖x̃‖₂ ≤ ζ·inflation after decoding
(``fedmf.secagg.quantize.Quantization.inflation``; Kairouz, Liu, Steinke, ICML 2021, Thm. 1), so
the sum of the decoded updates has ℓ2 sensitivity ζ·inflation where the central mode's has ζ:
every place the plan multiplies by ζ (σ = z·ζ·sens(C)) takes ζ_eff instead. Nothing else of the
accounting changes.
"""

from __future__ import annotations

from ..checks import interval, positive

__all__ = ["effective_clip_norm"]


def effective_clip_norm(clip_norm: float, inflation: float) -> float:
    """ζ_eff = ζ · inflation, the ℓ2 bound of one decoded quantized update (inflation ≥ 1)."""
    zeta = positive("clip_norm", clip_norm)
    factor = interval("quantization inflation", inflation, 1.0, float("inf"))
    return zeta * factor
