"""Seeded Gaussian draws whose tails reach as far as the privacy analysis assumes.

``torch.randn`` in float32 on CPU turns 24-bit uniforms into normals by Box–Muller, so no
draw ever exceeds sqrt(-2 ln 2^-24) ≈ 5.77 in magnitude: noise with bounded support is
distinguishable with probability about P(N(0,1) > 5.77 - Δ/σ) (≈ 1e-6 for Δ = σ), which a
guarantee with δ = 1e-8 does not allow. Float64 ``torch.randn`` is several times slower.

Here each value comes from the polar form of Box–Muller (Box & Muller 1958):
    z1 = r cos θ, z2 = r sin θ,  r = sqrt(-2 ln u),  θ = 2π v,
with u = (k + 1)·2^-53 from 53 random bits (so |z| can reach sqrt(106 ln 2) ≈ 8.57) and v from
32 random bits, the bits coming from numpy's SFC64 generator seeded per chunk. Three 64-bit
words make four values: two carry the radii, one the two angles.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

__all__ = ["fill_normal", "MAX_ABS"]

_M53 = (1 << 53) - 1
_LOW32 = 0xFFFFFFFF
MAX_ABS = math.sqrt(-2.0 * math.log(2.0**-53))  # the largest |z| this sampler can return
_LOCAL = threading.local()


def _scratch(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = (size, dtype)
    cache = _LOCAL.__dict__.setdefault("scratch", {})
    if key not in cache:
        cache.clear()
        cache[key] = (torch.empty(size, dtype=torch.int64), torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype))
    return cache[key]


def box_muller(words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Turn 3q int64 words into 4q standard normals written to ``out`` (CPU, float32/64):
    words[:2q] give the radii (53 bits each), words[2q:] two 32-bit angles each."""
    q = words.numel() // 3
    h = 2 * q
    if out.numel() != 4 * q or words.numel() != 3 * q:
        raise ValueError("box_muller needs 3q words for 4q values")
    bits, radius, angle = _scratch(h, out.dtype)
    torch.bitwise_and(words[:h], _M53, out=bits).add_(1)
    radius.copy_(bits).mul_(2.0**-53).log_().mul_(-2.0).sqrt_()  # r = sqrt(-2 ln u), u in (0, 1]
    torch.bitwise_and(words[h:], _LOW32, out=bits[:q])
    torch.bitwise_right_shift(words[h:], 32, out=bits[q:])  # signed: θ in [-π, π) is as uniform
    angle.copy_(bits).mul_(2.0 * math.pi * 2.0**-32)
    torch.cos(angle, out=out[:h]).mul_(radius)
    torch.sin(angle, out=out[h:]).mul_(radius)
    return out


def fill_normal(out: torch.Tensor, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Fill the contiguous 1-D tensor ``out`` with ``scale``·N(0, 1) draws determined by ``seed``
    (a non-negative int below 2^128). CPU: SFC64 bits and the Box–Muller above; other devices:
    float64 ``torch.randn`` (53-bit uniforms) cast to ``out``'s dtype."""
    count = out.numel()
    if count == 0:
        return out
    if out.device.type != "cpu":
        generator = torch.Generator(device=out.device)
        generator.manual_seed(seed & ((1 << 63) - 1))
        values = torch.randn(count, generator=generator, dtype=torch.float64, device=out.device)
        return out.copy_(values.mul_(scale))
    q = -(-count // 4)
    words = torch.from_numpy(np.random.SFC64(seed).random_raw(3 * q).view(np.int64))
    work = out.dtype if out.dtype in (torch.float32, torch.float64) else torch.float32
    if 4 * q == count and work == out.dtype:
        box_muller(words, out)
    else:
        out.copy_(box_muller(words, torch.empty(4 * q, dtype=work))[:count])
    if scale != 1.0:
        out.mul_(scale)
    return out
