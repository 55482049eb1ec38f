"""Quantization for the secure sum: every encoded update keeps the stated norm bound (exactly,
in integers), the stated inflation covers it, the no-wrap check is tight, decoding is centred."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmf.errors import ConfigError, FedmfError
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.quantize import (
    Quantization,
    check_no_wrap,
    decode_sum,
    kls_bound_sq,
    max_safe_cohort,
    metric_cap,
    noisy_centred,
    quantize,
)
from fedmf.secagg.sensitivity import effective_clip_norm


def _at_the_bound(dim: int, norm: float, seed: int, sparse: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=dim)
    if sparse:  # mass on a few coordinates: the worst case for ℓ∞
        x[np.argsort(np.abs(x))[: max(dim - sparse, 0)]] = 0.0
        if not np.any(x):
            x[0] = 1.0
    return x * (norm / np.linalg.norm(x))


@settings(max_examples=300, deadline=None)
@given(dim=st.integers(1, 300), log_clip=st.floats(-3, 3), log_units=st.floats(-1, 6),
       over=st.sampled_from([1.0, 1.0 + 1e-12, 1.5, 40.0]), beta=st.sampled_from([math.exp(-0.5), 0.01, 0.999]),
       seed=st.integers(0, 2**32 - 1), sparse=st.sampled_from([0, 1, 3]), tries=st.sampled_from([1, 1000]))
def test_every_encoded_update_keeps_the_norm_bound(dim, log_clip, log_units, over, beta, seed, sparse, tries):
    clip = 10.0**log_clip
    scale = 10.0**log_units / clip  # c = ζ·s from 0.1 to 10^6 grid units
    q = Quantization(clip_norm=clip, scale=scale, bits=62, dim=dim, beta=beta, max_tries=tries)
    words = quantize(q, _at_the_bound(dim, clip * over, seed, sparse), np.random.default_rng(seed))
    assert words.dtype == np.uint64 and words.shape == (dim,)
    signed = [w - (1 << 62) if w >= 1 << 61 else w for w in map(int, words)]
    assert sum(v * v for v in signed) <= q.bound_sq  # Python ints: exact
    assert max(abs(v) for v in signed) <= q.coordinate_bound
    zeta_eff = effective_clip_norm(clip, q.inflation)
    assert (Fraction(zeta_eff) * Fraction(scale)) ** 2 >= q.bound_sq  # ζ_eff covers √B / s, exactly
    assert zeta_eff >= clip


def test_the_bound_is_kairouz_liu_steinke_theorem_1():
    c, d, beta = 100.0, 1000, math.exp(-0.5)
    conditional = c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2)
    assert kls_bound_sq(c, d, beta) == math.floor(min(conditional, (c + math.sqrt(d)) ** 2))
    assert kls_bound_sq(0.1, 1, 0.01) == math.floor((0.1 + 1.0) ** 2)  # the trivial bound wins
    q = Quantization(clip_norm=1.0, scale=100.0, bits=32, dim=d)
    assert q.bound_sq == kls_bound_sq(100.0, d, q.beta) and q.inflation >= math.sqrt(q.bound_sq) / 100.0
    fine = Quantization(clip_norm=1.0, scale=1e6, bits=62, dim=d)
    assert 1.0 < fine.inflation < 1.0001 < q.inflation


def test_rounding_is_unbiased_and_uses_the_callers_generator():
    q = Quantization(clip_norm=1.0, scale=10.0, bits=16, dim=4)
    x = np.array([0.123, -0.456, 0.05, 0.0])
    draws = np.array([decode_sum(q, quantize(q, x, np.random.default_rng(i))).vector for i in range(3000)])
    assert np.allclose(draws.mean(axis=0), x, atol=0.01)
    same = [quantize(q, x, np.random.default_rng(5)) for _ in range(2)]
    assert np.array_equal(*same)


def test_the_bit_travels_as_the_last_word():
    q = Quantization(clip_norm=1.0, scale=10.0, bits=16, dim=3, with_bit=True)
    rng = np.random.default_rng(0)
    on, off = quantize(q, np.zeros(3), rng, True), quantize(q, np.ones(3), rng, False)
    assert on.shape == (4,) and on[-1] == 1 and off[-1] == 0
    total = decode_sum(q, mod_sum([on, off, on], 4, 16))
    assert total.unclipped == 2
    with pytest.raises(SecAggError, match="bit"):
        quantize(q, np.zeros(3), rng)


def test_decoding_is_centred():
    q = Quantization(clip_norm=1.0, scale=4.0, bits=8, dim=3)
    words = np.array([0, 255, 128], dtype=np.uint64)  # 0, −1, −128
    assert decode_sum(q, words).vector.tolist() == [0.0, -0.25, -32.0]
    for bad in (words.astype(np.int64), words[:2], np.array([0, 1, 256], dtype=np.uint64), [0, 1, 2]):
        with pytest.raises(SecAggError):
            decode_sum(q, bad)


@pytest.mark.parametrize("bad", [np.zeros(4), np.zeros((3, 1)), [0.0, 0.0, 0.0], np.array([0.0, np.nan, 0.0]),
                                 np.array(["a", "b", "c"]), None])
def test_bad_updates_are_refused_in_one_line(bad):
    q = Quantization(clip_norm=1.0, scale=10.0, bits=16, dim=3)
    with pytest.raises(SecAggError) as caught:
        quantize(q, bad, np.random.default_rng(0))
    assert "\n" not in str(caught.value)


def test_bad_quantizations_are_refused():
    for kwargs in ({"clip_norm": 0.0}, {"scale": -1.0}, {"bits": 3}, {"bits": 63}, {"dim": 0}, {"beta": 1.0},
                   {"with_bit": 1}, {"scale": 2.0**60}):
        base = {"clip_norm": 1.0, "scale": 10.0, "bits": 16, "dim": 3} | kwargs
        with pytest.raises(FedmfError):
            Quantization(**base)
    with pytest.raises(SecAggError):
        quantize(Quantization(1.0, 10.0, 16, 3), np.zeros(3), np.random.RandomState(0))


@pytest.mark.parametrize(("clip", "scale", "bits"), [(1.0, 10.0, 8), (0.25, 40.0, 10), (2.0, 3.0, 6)])
def test_no_wrap_accepts_the_largest_safe_cohort_and_refuses_the_next(clip, scale, bits):
    largest = max_safe_cohort(clip, scale, bits)
    assert largest == ((1 << (bits - 1)) - 1) // math.ceil(clip * scale) and largest >= 2
    assert check_no_wrap(largest, clip, scale, bits) == largest
    with pytest.raises(SecAggError, match=f"at most {largest} fit"):
        check_no_wrap(largest + 1, clip, scale, bits)
    dim = 4
    q = Quantization(clip_norm=clip, scale=scale, bits=bits, dim=dim)
    rng = np.random.default_rng(1)
    for sign in (1.0, -1.0):  # ζ·s is an integer here: ±ζ·e₁ encodes exactly to ±⌈ζ·s⌉
        extreme = quantize(q, sign * clip * np.eye(dim)[0], rng)
        level = (largest + 1) * math.ceil(clip * scale)  # ≥ 2^(b−1): past the positive half
        for m, wraps in ((largest, False), (largest + 1, sign > 0 or level > 1 << (bits - 1))):
            got = decode_sum(q, mod_sum([extreme] * m, dim, bits)).vector[0]
            assert (got != sign * clip * m) == wraps
    for trial in range(200):  # random extreme updates at the clip bound, the largest safe cohort
        xs = [_at_the_bound(dim, clip, trial * 1000 + i, 1 + i % 2) for i in range(largest)]
        encoded = [quantize(q, x, rng) for x in xs]
        ints = sum(decode_sum(q, w).vector * scale for w in encoded)
        assert np.array_equal(decode_sum(q, mod_sum(encoded, dim, bits)).vector * scale, ints)


def test_no_wrap_refuses_bad_values():
    for args in ((0, 1.0, 10.0, 8), (True, 1.0, 10.0, 8), (5, 1.0, 10.0, 80), (5, 0.0, 10.0, 8)):
        with pytest.raises(ConfigError):
            check_no_wrap(*args)
    with pytest.raises(SecAggError, match="at most 0 fit"):
        check_no_wrap(1, 1.0, 1000.0, 8)


def test_effective_clip_norm():
    assert effective_clip_norm(2.0, 1.5) == 3.0
    assert effective_clip_norm(0.7, 1.0) == 0.7
    for args in ((2.0, 0.99), (0.0, 1.2), (-1.0, 1.2), (1.0, float("nan"))):
        with pytest.raises(ConfigError):
            effective_clip_norm(*args)


def test_the_fallback_rounds_toward_zero_within_the_bound():
    dim = 2000  # every scaled coordinate at ±0.5: a rounding misses the bound about half the time
    q = Quantization(clip_norm=1.0, scale=math.sqrt(dim / 4), bits=32, dim=dim, beta=0.999, max_tries=1)
    x = np.where(np.arange(dim) % 2, 0.5, -0.5) / q.scale
    fallbacks = 0
    for seed in range(20):
        got = decode_sum(q, quantize(q, x, np.random.default_rng(seed))).vector * q.scale
        assert np.dot(got, got) <= q.bound_sq
        fallbacks += not np.any(got)  # trunc(±0.5) = 0
    assert 0 < fallbacks < 20


# ---- the noisy release: noise added to the residue, then centred (REVIEW-i36-privacy-path HIGH-1) ----


def _exact_centred(bits: int, word: int, y: float) -> Fraction:
    """centre((W + y) mod 2^b) in exact rationals."""
    r = (Fraction(word) + Fraction(y)) % (1 << bits)
    return r - (1 << bits) if r >= 1 << (bits - 1) else r


@pytest.mark.parametrize("bits", [8, 32, 53, 62])
@pytest.mark.parametrize("scale", [2.0 ** 12, 3.0, 1.0])
def test_noise_is_added_to_the_residue_exactly_before_centring(bits, scale):
    """(W + s·N) mod 2^b is computed exactly (integer part in int64, fraction apart) and centred on the
    right side of 2^(b−1) for every b ≤ 62, where float64 alone cannot hold W + s·N (b > 53): the
    result is the exact rational's float64 value to ≤ 2 ulps (fl(C), + fraction, ÷ s)."""
    modulus, half = 1 << bits, 1 << (bits - 1)
    rng = np.random.default_rng(bits)
    words = [0, 1, half - 2, half - 1, half, half + 1, modulus - 1] + [int(w) for w in rng.integers(0, modulus, 30,
                                                                                                    dtype=np.uint64)]
    steps = [0.0, 0.5, -0.5, 0.75, -0.25, 1.5, -1.5, 1e-20, -1e-20, 2.0 ** -40, half + 0.5, -(half + 0.5),
             3.0 * modulus + 0.25, -7.0 * modulus - 0.75, 1e30, -1e30]
    steps += list(rng.normal(size=20) * 10.0 ** rng.integers(-3, 20, 20))
    w = np.array([x for x in words for _ in steps], dtype=np.uint64)
    y = np.array([float(np.float64(t / scale) * scale) for _ in words for t in steps])  # representable s·N
    got = noisy_centred(bits, scale, w, y / scale)
    for word, step, value in zip(w.tolist(), y.tolist(), got.tolist(), strict=True):
        exact = _exact_centred(bits, word, step)
        assert -half <= exact < half
        assert abs(Fraction(value) * Fraction(scale) - exact) <= 2 * math.ulp(float(exact)) + 2 * math.ulp(1.0), \
            (word, step, value, float(exact))
        assert (value < 0) == (exact < 0) or float(exact) == 0.0  # the centring's side is exact


def test_at_b_62_the_boundary_is_decided_exactly_where_float64_would_round_it_away():
    bits, half = 62, 1 << 61
    w = np.array([half - 1, half - 1, (1 << 62) - 1, 0], dtype=np.uint64)
    got = noisy_centred(bits, 1.0, w, np.array([0.5, 1.5, 0.75, -0.25]))
    # half − 1 + 0.5 < 2^61 stays positive (float64 would round W + y to 2^61 and wrap it)
    assert got[0] == float(half) and got[0] > 0
    assert float(np.float64(half - 1) + 0.5) == float(half)  # what float64 alone gives: the boundary itself
    assert got[1] == -float(half) + 0.5  # half − 1 + 1.5 = 2^61 + 0.5 ≥ 2^61: wraps
    assert got[2] == -0.25 and got[3] == -0.25  # just below 2^62 and just below 0: both −0.25
    with pytest.raises(SecAggError):
        noisy_centred(bits, 1.0, np.array([1 << 62], dtype=np.uint64), np.zeros(1))
    with pytest.raises(SecAggError):
        noisy_centred(bits, 1.0, w, np.array([0.0, np.nan, 0.0, 0.0]))


def test_honest_sums_are_released_as_decoding_then_noising_within_the_margin():
    q = Quantization(clip_norm=1.0, scale=2.0 ** 10, bits=24, dim=6)
    rng = np.random.default_rng(5)
    for _ in range(50):
        words = [quantize(q, rng.normal(size=6) * 0.3, rng) for _ in range(20)]
        total = mod_sum(words, q.length, q.bits)
        noise = rng.normal(size=6) * 50.0
        expected = decode_sum(q, total).vector + noise  # |centre(W) + s·N| < 2^23: no wrap
        assert np.array_equal(noisy_centred(q.bits, q.scale, total, noise), expected)


def test_no_wrap_keeps_a_12_sigma_margin_for_each_words_noise():
    clip, scale, bits = 1.0, 2.0 ** 10, 24
    room = (1 << (bits - 1)) - 1
    sigma, sigma_b, sigma_m = 7.5, 3.0, 0.2
    cap = metric_cap(2.0, scale)
    largest = max_safe_cohort(clip, scale, bits, 2.0, noise_std=sigma, count_noise_std=sigma_b,
                              metric_noise_std=sigma_m)
    assert largest == min((room - math.ceil(12 * sigma * scale)) // 1024, room - 36,
                          (room - math.ceil(12 * sigma_m * scale)) // cap)
    assert largest < max_safe_cohort(clip, scale, bits, 2.0)
    kw = {"noise_std": sigma, "count_noise_std": sigma_b, "metric_noise_std": sigma_m}
    assert check_no_wrap(largest, clip, scale, bits, 2.0, **kw) == largest
    with pytest.raises(SecAggError, match=f"12σ noise margin: at most {largest} fit"):
        check_no_wrap(largest + 1, clip, scale, bits, 2.0, **kw)
    with pytest.raises(SecAggError, match="at most 0 fit"):  # the noise alone would wrap
        check_no_wrap(1, clip, scale, bits, noise_std=room / scale / 11)
    with pytest.raises(SecAggError, match="noise std"):
        check_no_wrap(1, clip, scale, bits, noise_std=float("nan"))
