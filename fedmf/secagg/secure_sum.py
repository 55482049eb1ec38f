"""What a round's secure sum hands the engine: the modular sum's residues, their encoding, who is in it.

SecAgg+ (``server/secagg.py``) unmasks the modular sum W of the contributors' words. ``SecureSum``
carries W, *not decoded*, with its ``Quantization`` (scale s, modulus 2^b) to ``PrivateRun.aggregate``
(``fedmf/run/private_run.py``), which privatizes it with ``RoundPrivatizer.add_sum`` instead of summing
updates itself: the same correlated noise as the central path, σ from ζ_eff = ζ·``inflation``
(``fedmf.secagg.sensitivity``), added to the residues *before* they are centred
(``fedmf.secagg.quantize.noisy_centred``: REVIEW-i36-privacy-path HIGH-1), then divided by the
planned cohort.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .quantize import Quantization

__all__ = ["SecureSum"]


@dataclass(frozen=True)
class SecureSum:
    """One round's secure sum, as unmasked.

    ``words``: uint64, the modular sum W (each word < 2^``quantization.bits``) of the contributors'
    words: the update's ``quantization.dim`` values in the model layout's order (Σ clip(Δ, ζ)·s with
    fixed clipping, Σ clip(Δ, ζₜ)/ζₜ·s with adaptive clipping), then the unclipped bits' sum (adaptive
    clipping), then the clipped client-metric words' sum, Σ⌊clip(vᵢ, 0, L)·s⌋ (``metric_word``), when the
    plan releases the client metric. ``quantization``: the run's encoding (scale, bits, inflation ≥ 1).
    ``contributors``: the users whose words are in the sum. ``rejected``: users whose protocol replies
    were refused, user → one-line reason (recorded in the ledger as rejections)."""

    words: np.ndarray
    quantization: Quantization
    contributors: frozenset[Hashable]
    rejected: Mapping[Hashable, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, quantization: Quantization, rejected: Mapping[Hashable, str] | None = None) -> SecureSum:
        """The zero sum of nobody (a cohort too small for SecAgg+): all words 0."""
        return cls(np.zeros(quantization.length, dtype=np.uint64), quantization, frozenset(), dict(rejected or {}))

    @property
    def inflation(self) -> float:
        """The quantization's stated norm inflation (``Quantization.inflation``)."""
        return self.quantization.inflation
