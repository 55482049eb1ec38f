"""The Gaussian noise on adaptive clipping's count of unclipped updates (and on the private client-metric
release's sum): each its own stream.

Round t's draw N(0, σ_b²) (Andrew et al., NeurIPS 2021, Alg. 1: b̃ₜ = Σ bᵢ + N(0, σ_b²)) comes from
``fedmf.round.normal`` seeded with a keyed hash of the run's noise secret, the round and the round's
noise salt:

    seed_t = BLAKE2b-128(key = noise seed, salt = salt_t, person = "fedmf-count-v1", message = LE64(t))

(RFC 7693). Its personalization differs from every key of the correlated noise (``fedmf.round.draws``:
"fedmf-noise-s1", "fedmf-noise-v2"), so the two streams never share a seed; the salt is the one
round t's correlated noise is keyed by (b"" for unsalted, repeatable test runs), so a redone
round draws a fresh count, and an unsalted run draws the same count again. The committed count
itself is kept in the ledger and ζₜ₊₁ in the checkpoint, so a resumed run never needs to redraw it.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from .normal import fill_normal

__all__ = ["count_noise", "metric_noise", "PERSON", "METRIC_PERSON"]

PERSON = b"fedmf-count-v1"
#: the private client-metric release's stream (``fedmf.round.client_metrics``): the same construction under
#: its own personalization, so it never shares a seed with the count or the correlated noise
METRIC_PERSON = b"fedmf-metric-v1"


def _keyed_normal(key: bytes, t: int, salt: bytes, person: bytes) -> float:
    digest = hashlib.blake2b(struct.pack("<Q", t), key=key, salt=salt, person=person, digest_size=16).digest()
    out = torch.empty(1, dtype=torch.float64)
    fill_normal(out, int.from_bytes(digest, "little"))
    return float(out[0])


def count_noise(key: bytes, t: int, salt: bytes, std: float) -> float:
    """Round t's noise on the count of unclipped updates, ``std``·N(0, 1), in float64."""
    return float(std) * _keyed_normal(key, t, salt, PERSON)


def metric_noise(key: bytes, t: int, salt: bytes, std: float) -> float:
    """Round t's noise on the sum of the clipped client metric, ``std``·N(0, 1), in float64 (seed as
    above with person "fedmf-metric-v1")."""
    return float(std) * _keyed_normal(key, t, salt, METRIC_PERSON)
