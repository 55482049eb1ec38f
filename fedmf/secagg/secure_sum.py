"""What a round's secure sum hands the engine: the decoded sum, the decoded count, who is in it.

SecAgg+ (``server/secagg.py``) unmasks the modular sum of the contributors' words and
``fedmf.secagg.quantize.decode_sum`` decodes it. ``SecureSum`` carries that result to
``PrivateRun.aggregate`` (``fedmf/run/private_run.py``), which privatizes it with
``RoundPrivatizer.add_sum`` instead of summing updates itself: the same correlated noise and
scaling as the central path, σ from ζ_eff = ζ·``inflation`` (``fedmf.secagg.sensitivity``), divided
by the planned cohort.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SecureSum"]


@dataclass(frozen=True)
class SecureSum:
    """One round's decoded secure sum.

    ``vector``: float64, the flat sum of the contributors' decoded quantized updates in the model
    layout's order — Σ clip(Δ, ζ) with fixed clipping, Σ clip(Δ, ζₜ)/ζₜ with adaptive clipping.
    ``unclipped``: the decoded sum of the unclipped bits (adaptive clipping), else None.
    ``contributors``: the users whose vectors are in the sum. ``inflation``: the quantization's
    stated norm inflation (``Quantization.inflation``, ≥ 1). ``rejected``: users whose protocol
    replies were refused, user → one-line reason (recorded in the ledger as rejections).
    ``metric``: the decoded sum of the contributors' clipped client-metric words, Σ⌊clip(vᵢ, 0, L)·s⌋/s
    (``fedmf.secagg.quantize.metric_word``), when the plan releases the client metric; else None."""

    vector: np.ndarray
    unclipped: int | None
    contributors: frozenset[Hashable]
    inflation: float
    rejected: Mapping[Hashable, str] = field(default_factory=dict)
    metric: float | None = None
