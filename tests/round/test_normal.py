"""The Gaussian sampler behind the noise engine: distribution, tails, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedmf.round.normal import MAX_ABS, box_muller, fill_normal

TORCH_FLOAT32_CAP = math.sqrt(-2 * math.log(2.0**-24))  # where float32 torch.randn stops on CPU


def _draws(count: int, seed: int = 7, dtype=torch.float64) -> np.ndarray:
    return fill_normal(torch.empty(count, dtype=dtype), seed).numpy().astype(np.float64)


def test_values_are_standard_normal():
    z = _draws(2_000_000)
    n = z.size
    assert stats.kstest(z, "norm").statistic < 2.0 / math.sqrt(n)  # KS critical value at p ≈ 0.001 is 1.95/√n
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(np.mean(z**4) - 3) < 5 * math.sqrt(96 / n)  # Var(z^4) = 105 - 9
    # the two halves of a chunk (cos and sin of the same radius and angle) are independent
    q = n // 4
    half = 2 * q
    first, second = z[:half], z[half : 2 * half]
    assert abs(np.corrcoef(first**2, second**2)[0, 1]) < 5 / math.sqrt(half)
    assert abs(np.corrcoef(first, second)[0, 1]) < 5 / math.sqrt(half)


def test_tail_frequency_matches_the_gaussian():
    z = _draws(8_000_000, seed=3, dtype=torch.float32)
    for t in (3.0, 4.0):
        expected = math.erfc(t / math.sqrt(2)) * z.size
        assert abs(np.sum(np.abs(z) > t) - expected) < 5 * math.sqrt(expected)


def test_tails_reach_beyond_the_float32_torch_cap():
    words = np.zeros(3, np.uint64)  # radius bits 0 -> u = 2^-53; angle 0
    out = box_muller(words, np.empty(4, np.float32))
    assert out[0] == pytest.approx(MAX_ABS, rel=1e-6)
    assert MAX_ABS > 8.5 > TORCH_FLOAT32_CAP + 2.7
    all_ones = np.full(3, np.iinfo(np.uint64).max, np.uint64)  # u = 1 -> r = 0
    assert np.all(box_muller(all_ones, np.empty(4, np.float64)) == 0)


@pytest.mark.parametrize("count", [1, 3, 4, 5, 1001])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_deterministic_any_size_and_dtype(count, dtype):
    a = fill_normal(torch.empty(count, dtype=dtype), 123, 2.5)
    b = fill_normal(torch.empty(count, dtype=dtype), 123, 2.5)
    assert torch.equal(a, b) and a.dtype == dtype
    reference = fill_normal(torch.empty(count, dtype=torch.float64), 123, 2.5)
    tol = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 0}[dtype]
    np.testing.assert_allclose(a.double().numpy(), reference.numpy(), rtol=tol, atol=tol)
    assert not torch.equal(a, fill_normal(torch.empty(count, dtype=dtype), 124, 2.5)) or count == 0


def test_box_muller_refuses_mismatched_sizes():
    with pytest.raises(ValueError, match="3q words"):
        box_muller(np.zeros(4, np.uint64), np.empty(4, np.float32))
