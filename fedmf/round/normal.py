"""Seeded Gaussian draws whose tails reach as far as the privacy analysis assumes.

``torch.randn`` in float32 on CPU turns 24-bit uniforms into normals by Box–Muller, so no
draw ever exceeds sqrt(-2 ln 2^-24) ≈ 5.77 in magnitude: noise with bounded support is
distinguishable with probability about P(N(0,1) > 5.77 - Δ/σ) (≈ 1e-6 for Δ = σ), which a
guarantee with δ = 1e-8 does not allow. Float64 ``torch.randn`` is several times slower.

Here each value comes from the Box–Muller transform (Box & Muller 1958, trigonometric form):
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

_M53 = np.uint64((1 << 53) - 1)
_ONE = np.uint64(1)
MAX_ABS = math.sqrt(-2.0 * math.log(2.0**-53))  # the largest |z| this sampler can return
_LOCAL = threading.local()


def _scratch(size: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    key = (size, np.dtype(dtype).str)
    cache = _LOCAL.__dict__.setdefault("scratch", {})
    if key not in cache:
        cache.clear()
        cache[key] = (np.empty(size, np.uint64), np.empty(size, dtype), np.empty(size, dtype))
    return cache[key]


def box_muller(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Turn 3q uint64 words into 4q standard normals written to ``out`` (float32 or float64):
    words[:2q] give the radii (53 bits each), words[2q:] two 32-bit angles each. numpy only,
    single-threaded and without the GIL, so several threads can fill chunks at once."""
    q = words.size // 3
    h = 2 * q
    if out.size != 4 * q or words.size != 3 * q:
        raise ValueError("box_muller needs 3q words for 4q values")
    bits, radius, angle = _scratch(h, out.dtype)
    np.bitwise_and(words[:h], _M53, out=bits)
    np.add(bits, _ONE, out=bits)
    radius[:] = bits
    np.multiply(radius, 2.0**-53, out=radius)  # u = (k + 1)·2^-53 in (0, 1]
    np.log(radius, out=radius)
    np.multiply(radius, -2.0, out=radius)
    np.sqrt(radius, out=radius)  # r = sqrt(-2 ln u)
    angle[:] = words[h:].view(np.uint32)
    np.multiply(angle, 2.0 * math.pi * 2.0**-32, out=angle)  # θ = 2π v
    np.cos(angle, out=out[:h])
    np.multiply(out[:h], radius, out=out[:h])
    np.sin(angle, out=out[h:])
    np.multiply(out[h:], radius, out=out[h:])
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
    words = np.random.SFC64(seed).random_raw(3 * q)
    direct = out.dtype in (torch.float32, torch.float64)
    target = out.numpy() if direct else np.empty(count, np.float32)
    if 4 * q == count:
        box_muller(words, target)
    else:
        target[:] = box_muller(words, np.empty(4 * q, target.dtype))[:count]
    if scale != 1.0:
        np.multiply(target, scale, out=target)
    if not direct:
        out.copy_(torch.from_numpy(target))
    return out
