"""The engine's secure-sum path (``RoundPrivatizer.privatize_sum``) against the central path on the
same clipped updates, same seed, repeatable noise: equal up to the quantization error and the
inflated noise (bounded here); with honest clients bit-equal to decoding first and then adding the
noise in float64 (the release before the HIGH-1 fix); σ from ζ_eff = ζ·inflation; adaptive clipping's
count release reading the bits exactly as the central path counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedmf.errors import ConfigError, RoundOrderError
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.count_noise import count_noise
from fedmf.round.draws import key_of
from fedmf.round.privatize import RoundPrivatizer, flat_size
from fedmf.secagg.encode import encode_update, quantization_for
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.quantize import Quantization, check_no_wrap, decode_sum
from tests import _federated_task as task
from tests.secagg._drive import tensors

LAYOUT = {"w": (3, 4), "b": (4,)}
DIM = flat_size(LAYOUT)
SEED = b"s" * 32
USERS = [f"u{i:02d}" for i in range(12)]
SCALE, BITS = 2.0 ** 12, 32


def _updates(rng, scale=1.0):
    return {u: rng.normal(size=DIM) * scale for u in USERS}


def _tensors(flat: np.ndarray) -> dict[str, torch.Tensor]:
    return tensors(flat, LAYOUT)


def _flat(tensors) -> np.ndarray:
    return np.concatenate([tensors[name].double().reshape(-1).numpy() for name in LAYOUT])


def _secure_sum(plan, q, flats, zeta, threshold, seed=0):
    rng = np.random.default_rng(seed)
    words = [encode_update(q, flats[u], clip_norm=zeta, zero_threshold=threshold, rng=rng) for u in USERS]
    check_no_wrap(len(USERS), q.clip_norm, q.scale, q.bits)
    return mod_sum(words, q.length, q.bits)


def _noise(plan, rounds):
    """Each round's correlated noise as a privatizer of ``SEED`` draws it (repeatable), flat, float64."""
    p = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    out = []
    for _ in range(rounds):
        buffer = torch.empty(DIM, dtype=torch.float32)
        p.noise.next(out=buffer)
        out.append(buffer.double().numpy())
    return out


def _pair(plan):
    central = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    secure = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    return central, secure


def test_fixed_clipping_equals_the_central_release_up_to_the_quantization_error():
    plan = task.plan(rounds=8)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    central, secure = _pair(plan)
    noise = _noise(plan, 4)
    rng = np.random.default_rng(1)
    for t in range(4):
        flats = _updates(rng, scale=0.6 if t % 2 else 0.1)  # some clipped, some not
        # central: float32 tensors; the secure path encodes the same float32 values
        tensors = {u: _tensors(f) for u, f in flats.items()}
        flats32 = {u: _flat(x) for u, x in tensors.items()}
        mean_c, rep_c = central.privatize(t, tensors, selected=USERS)
        words = _secure_sum(plan, q, flats32, plan.clip_norm, plan.zero_threshold, seed=t)
        mean_s, rep_s = secure.privatize_sum(t, words, USERS, quantization=q, selected=USERS)
        # each coordinate of each update is rounded by < 1 grid unit: |Δsum| < n/s, released ÷ m;
        # the noise is × inflation: (inflation − 1)·|N|/m; plus float32 rounding (a few ulps of n·ζ)
        extra = (q.inflation - 1.0) * float(np.abs(noise[t]).max()) / plan.expected_users
        bound = len(USERS) / SCALE / plan.expected_users + extra + 1e-5
        diff = max(float((mean_c[k] - mean_s[k]).abs().max()) for k in LAYOUT)
        assert 0 < diff <= bound, (t, diff, bound)
        assert rep_s.noise_std == rep_c.noise_std * q.inflation
        assert [u.user for u in rep_s.contributed] == USERS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("adaptive", [False, True])
def test_honest_rounds_equal_decoding_then_noising_bit_for_bit(dtype, adaptive):
    """With honest clients (|centre(W) + s·N| < 2^(b−1)) the release equals the one before the HIGH-1
    fix, computed exactly in float64: (centre(W)/s + N·inflation) in the work dtype, scaled back as the
    policy scales (÷ m, × ζₜ/m), the count decoded + its noise. s = 2^12: ÷s is exact, so the modular
    addition's float64 result is the reference's bit for bit."""
    rule = AdaptiveClipping.create(0.5, expected_users=10) if adaptive else None
    plan = task.plan(rounds=4, adaptive_clipping=rule)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    secure = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True, dtype=dtype)
    reference = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True, dtype=dtype)  # its noise only
    rng = np.random.default_rng(2)
    for t in range(3):
        zeta = secure.clip_norm
        flats = {u: rng.normal(size=DIM) * 0.4 for u in USERS}  # some clipped
        words = _secure_sum(plan, q, flats, zeta, plan.zero_threshold_at(zeta), seed=t)
        decoded = decode_sum(q, words)
        buffer = torch.empty(DIM, dtype=reference.noise.dtype)
        reference.noise.next(out=buffer)  # the flat draw lands in ``buffer``
        noise = buffer.double().numpy()
        released = torch.from_numpy(decoded.vector + noise * q.inflation).to(secure.noise.dtype)
        expected = (released.mul_(zeta / plan.expected_users) if adaptive
                    else released.div_(plan.expected_users)).to(dtype)
        mean_s, rep_s = secure.privatize_sum(t, words, USERS, quantization=q, selected=USERS)
        assert torch.equal(torch.cat([mean_s[k].reshape(-1) for k in LAYOUT]), expected), t
        if adaptive:
            counted = decoded.unclipped + count_noise(key_of(SEED), t, b"", rule.count_noise_std)
            assert rep_s.noisy_unclipped == min(max(counted, 0.0), len(USERS))


def test_sigma_comes_from_the_inflated_clip_norm():
    plan = task.plan(rounds=4)
    q = quantization_for(plan, DIM, scale=4.0, bits=BITS, beta=math.exp(-0.5))  # coarse: visible inflation
    assert q.inflation > 1.05
    central, secure = _pair(plan)
    flats = _updates(np.random.default_rng(3), scale=0.05)
    tensors = {u: _tensors(f) for u, f in flats.items()}
    mean_c, rep_c = central.privatize(0, tensors, selected=USERS)
    words = _secure_sum(plan, q, {u: _flat(x) for u, x in tensors.items()}, plan.clip_norm, None)
    decoded = decode_sum(q, words)
    mean_s, rep_s = secure.privatize_sum(0, words, USERS, quantization=q, selected=USERS)
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
    noise = _noise(plan, 5)
    rng = np.random.default_rng(4)
    for t in range(5):
        zeta = central.clip_norm
        assert secure.clip_norm == zeta
        flats = _updates(rng, scale=0.3)
        flats[USERS[0]][0] = 1e6  # zeroed on the client as on the server, and counted as clipped
        tensors = {u: _tensors(f) for u, f in flats.items()}
        mean_c, rep_c = central.privatize(t, tensors, selected=USERS)
        words = _secure_sum(plan, q, {u: _flat(x) for u, x in tensors.items()}, zeta,
                            plan.zero_threshold_at(zeta), seed=t)
        counted = sum(1 for u in rep_c.contributed if not (u.clipped or u.zeroed))
        assert decode_sum(q, words).unclipped == counted
        mean_s, rep_s = secure.privatize_sum(t, words, USERS, quantization=q, selected=USERS)
        # the same count noise added to the bits' residue, centred (exact here), clamped to [0, 12]
        assert rep_s.noisy_unclipped == min(max(rep_c.noisy_unclipped, 0.0), len(USERS))
        assert rep_s.clip_norm == rep_c.clip_norm == zeta
        extra = (q.inflation - 1.0) * float(np.abs(noise[t]).max()) * zeta / plan.expected_users
        bound = len(USERS) / SCALE * zeta / plan.expected_users + extra + 1e-5
        diff = max(float((mean_c[k] - mean_s[k]).abs().max()) for k in LAYOUT)
        assert diff <= bound, (t, diff, bound)


def test_a_secure_sum_is_checked_and_never_mixed_with_updates():
    plan = task.plan(rounds=4)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    zero = np.zeros(q.length, dtype=np.uint64)
    p = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    with pytest.raises(ConfigError, match="not selected"):
        p.privatize_sum(0, zero, ["x"], quantization=q, selected=USERS)
    for bad in (np.zeros(q.length + 1, dtype=np.uint64), np.zeros(q.length), np.full(q.length, 1 << BITS, np.uint64)):
        with pytest.raises(ConfigError, match="uint64 residues"):
            p.privatize_sum(0, bad, USERS, quantization=q, selected=USERS)
    with pytest.raises(ConfigError, match="Quantization"):
        p.privatize_sum(0, zero, USERS, quantization=None, selected=USERS)
    bit = quantization_for(task.plan(rounds=4, adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10)),
                           DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    with pytest.raises(ConfigError, match="unclipped count"):
        p.privatize_sum(0, np.zeros(bit.length, dtype=np.uint64), USERS, quantization=bit, selected=USERS)
    with pytest.raises(ConfigError, match="clips to"):
        other = Quantization(clip_norm=2.0, scale=SCALE, bits=BITS, dim=DIM)
        p.privatize_sum(0, zero, USERS, quantization=other, selected=USERS)
    p.begin(0, USERS)
    p.add_sum(zero, USERS, quantization=q)
    with pytest.raises(RoundOrderError):
        p.add(USERS[0], _tensors(np.zeros(DIM)))
    p.abort()
    p.privatize_sum(0, zero, USERS[:3], quantization=q, selected=USERS)
    assert p.next_round == 1


def test_a_secure_sum_reports_clipping_and_zeroing_as_unknown():
    """The clients clip and zero their own updates: the server records neither (None, not false or 0),
    while the central path counts both."""
    plan = task.plan(rounds=4)
    secure = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    _, report = secure.privatize_sum(0, np.zeros(q.length, dtype=np.uint64), USERS[:3], quantization=q,
                                     selected=USERS)
    assert [(u.clipped, u.zeroed) for u in report.users] == [(None, None)] * 3
    assert report.counts() == {"contributed": 3, "rejected": 0, "clipped": None, "zeroed": None}
    central = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    big = _tensors(np.full(DIM, 10.0 * plan.clip_norm))
    _, report = central.privatize(0, {u: big for u in USERS[:3]}, selected=USERS)
    assert report.counts() == {"contributed": 3, "rejected": 0, "clipped": 3, "zeroed": 0}
