"""The engine's secure-sum path (``RoundPrivatizer.privatize_sum``) against the central path on the
same clipped updates, same seed, repeatable noise: equal up to the quantization error (bounded
here), bit-equal when the updates lie on the grid; σ from ζ_eff = ζ·inflation; adaptive clipping's
count release reading the decoded count exactly as the central path counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedmf.errors import ConfigError, RoundOrderError
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.privatize import RoundPrivatizer, flat_size
from fedmf.secagg.encode import encode_update, quantization_for
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.quantize import check_no_wrap, decode_sum
from tests import _federated_task as task

LAYOUT = {"w": (3, 4), "b": (4,)}
DIM = flat_size(LAYOUT)
SEED = b"s" * 32
USERS = [f"u{i:02d}" for i in range(12)]
SCALE, BITS = 2.0 ** 12, 32


def _updates(rng, scale=1.0):
    return {u: rng.normal(size=DIM) * scale for u in USERS}


def _tensors(flat: np.ndarray) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in LAYOUT.items():
        size = math.prod(shape)
        out[name] = torch.tensor(flat[offset:offset + size].reshape(shape), dtype=torch.float32)
        offset += size
    return out


def _flat(tensors) -> np.ndarray:
    return np.concatenate([tensors[name].double().reshape(-1).numpy() for name in LAYOUT])


def _secure_sum(plan, q, flats, zeta, threshold, seed=0):
    rng = np.random.default_rng(seed)
    words = [encode_update(q, flats[u], clip_norm=zeta, zero_threshold=threshold, rng=rng) for u in USERS]
    check_no_wrap(len(USERS), q.clip_norm, q.scale, q.bits)
    return decode_sum(q, mod_sum(words, q.length, q.bits))


def _pair(plan):
    central = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    secure = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    return central, secure


def test_fixed_clipping_equals_the_central_release_up_to_the_quantization_error():
    plan = task.plan(rounds=8)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    central, secure = _pair(plan)
    rng = np.random.default_rng(1)
    for t in range(4):
        flats = _updates(rng, scale=0.6 if t % 2 else 0.1)  # some clipped, some not
        # central: float32 tensors; the secure path encodes the same float32 values
        tensors = {u: _tensors(f) for u, f in flats.items()}
        flats32 = {u: _flat(x) for u, x in tensors.items()}
        mean_c, rep_c = central.privatize(t, tensors, selected=USERS)
        decoded = _secure_sum(plan, q, flats32, plan.clip_norm, plan.zero_threshold, seed=t)
        mean_s, rep_s = secure.privatize_sum(t, decoded.vector, USERS, inflation=1.0, selected=USERS)
        # each coordinate of each update is rounded by < 1 grid unit: |Δsum| < n/s, released ÷ m;
        # plus float32 rounding of the sums (a few ulps of values of order n·ζ)
        bound = len(USERS) / SCALE / plan.expected_users + 1e-5
        diff = max(float((mean_c[k] - mean_s[k]).abs().max()) for k in LAYOUT)
        assert 0 < diff <= bound, (t, diff, bound)
        assert rep_s.noise_std == rep_c.noise_std
        assert [u.user for u in rep_s.contributed] == USERS


def test_updates_on_the_grid_give_the_central_release_bit_for_bit():
    plan = task.plan(rounds=4)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    central, secure = _pair(plan)
    rng = np.random.default_rng(2)
    for t in range(3):
        # k/2^12 with |k| ≤ 2^8: exact in float32, norm well below ζ = 1 (nothing clipped)
        flats = {u: rng.integers(-2**6, 2**6, DIM) / SCALE for u in USERS}
        tensors = {u: _tensors(f) for u, f in flats.items()}
        mean_c, _ = central.privatize(t, tensors, selected=USERS)
        decoded = _secure_sum(plan, q, flats, plan.clip_norm, plan.zero_threshold)
        assert np.array_equal(decoded.vector, sum(flats.values()))
        mean_s, _ = secure.privatize_sum(t, decoded.vector, USERS, inflation=1.0, selected=USERS)
        for k in LAYOUT:
            assert torch.equal(mean_c[k], mean_s[k]), (t, k)


def test_sigma_comes_from_the_inflated_clip_norm():
    plan = task.plan(rounds=4)
    q = quantization_for(plan, DIM, scale=4.0, bits=BITS, beta=math.exp(-0.5))  # coarse: visible inflation
    assert q.inflation > 1.05
    central, secure = _pair(plan)
    flats = _updates(np.random.default_rng(3), scale=0.05)
    tensors = {u: _tensors(f) for u, f in flats.items()}
    mean_c, rep_c = central.privatize(0, tensors, selected=USERS)
    decoded = _secure_sum(plan, q, {u: _flat(x) for u, x in tensors.items()}, plan.clip_norm, None)
    mean_s, rep_s = secure.privatize_sum(0, decoded.vector, USERS, inflation=q.inflation, selected=USERS)
    assert rep_s.noise_std == pytest.approx(rep_c.noise_std * q.inflation, rel=1e-15)
    m = plan.expected_users
    clipped_sum = sum(_flat(x) for x in tensors.values())  # nothing clipped at norm ≈ 0.05·√16
    noise_c = _flat(mean_c) * m - clipped_sum
    noise_s = _flat(mean_s) * m - decoded.vector
    np.testing.assert_allclose(noise_s, q.inflation * noise_c, rtol=0, atol=1e-4)


def test_adaptive_clipping_releases_the_same_count_and_next_clip_norm():
    rule = AdaptiveClipping.create(0.5, expected_users=10)
    plan = task.plan(rounds=6, adaptive_clipping=rule)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    assert q.with_bit and q.clip_norm == 1.0
    central, secure = _pair(plan)
    rng = np.random.default_rng(4)
    for t in range(5):
        zeta = central.clip_norm
        assert secure.clip_norm == zeta
        flats = _updates(rng, scale=0.3)
        flats[USERS[0]][0] = 1e6  # zeroed on the client as on the server, and counted as clipped
        tensors = {u: _tensors(f) for u, f in flats.items()}
        mean_c, rep_c = central.privatize(t, tensors, selected=USERS)
        decoded = _secure_sum(plan, q, {u: _flat(x) for u, x in tensors.items()}, zeta,
                              plan.zero_threshold_at(zeta), seed=t)
        counted = sum(1 for u in rep_c.contributed if not (u.clipped or u.zeroed))
        assert decoded.unclipped == counted
        mean_s, rep_s = secure.privatize_sum(t, decoded.vector, USERS, inflation=1.0,
                                             unclipped=decoded.unclipped, selected=USERS)
        assert rep_s.noisy_unclipped == rep_c.noisy_unclipped
        assert rep_s.clip_norm == rep_c.clip_norm == zeta
        bound = len(USERS) / SCALE * zeta / plan.expected_users + 1e-5
        diff = max(float((mean_c[k] - mean_s[k]).abs().max()) for k in LAYOUT)
        assert diff <= bound, (t, diff, bound)


def test_a_secure_sum_is_checked_and_never_mixed_with_updates():
    plan = task.plan(rounds=4)
    p = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    with pytest.raises(ConfigError, match="not selected"):
        p.privatize_sum(0, np.zeros(DIM), ["x"], inflation=1.0, selected=USERS)
    with pytest.raises(ConfigError, match="finite float64"):
        p.privatize_sum(0, np.zeros(DIM + 1), USERS, inflation=1.0, selected=USERS)
    with pytest.raises(ConfigError, match="unclipped count"):
        p.privatize_sum(0, np.zeros(DIM), USERS, inflation=1.0, unclipped=3, selected=USERS)
    p.begin(0, USERS)
    p.add_sum(np.zeros(DIM), USERS, inflation=1.0)
    with pytest.raises(RoundOrderError):
        p.add(USERS[0], _tensors(np.zeros(DIM)))
    p.abort()
    p.privatize_sum(0, np.zeros(DIM), USERS[:3], inflation=1.0, selected=USERS)
    assert p.next_round == 1


def test_a_secure_sum_reports_clipping_and_zeroing_as_unknown():
    """The clients clip and zero their own updates: the server records neither (None, not false or 0),
    while the central path counts both."""
    plan = task.plan(rounds=4)
    secure = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    _, report = secure.privatize_sum(0, np.zeros(DIM), USERS[:3], inflation=1.0, selected=USERS)
    assert [(u.clipped, u.zeroed) for u in report.users] == [(None, None)] * 3
    assert report.counts() == {"contributed": 3, "rejected": 0, "clipped": None, "zeroed": None}
    central = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    big = _tensors(np.full(DIM, 10.0 * plan.clip_norm))
    _, report = central.privatize(0, {u: big for u in USERS[:3]}, selected=USERS)
    assert report.counts() == {"contributed": 3, "rejected": 0, "clipped": 3, "zeroed": 0}
