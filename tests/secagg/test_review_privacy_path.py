"""Independent privacy review of issue 36's secure-aggregation path (docs/reviews/REVIEW-i36-privacy-path.md).

The checks that hold are plain tests; each open finding is a strict xfail that fails today.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch

from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.count_noise import count_noise, metric_noise
from fedmf.round.privatize import RoundPrivatizer, flat_size
from fedmf.secagg.encode import encode_local_update, encode_update, quantization_for
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.quantize import Quantization, decode_sum, noisy_centred, quantize
from tests import _federated_task as task
from tests.secagg._drive import run_round, tensors

LAYOUT = {"w": (3, 4), "b": (4,)}
DIM = flat_size(LAYOUT)
SEED = b"r" * 32
SCALE, BITS = 2.0 ** 12, 32
HALF = 1 << (BITS - 1)
NODES = [1, 2, 3, 4, 5]  # node 1: the honest user under test; node 5: the hostile client
PARAMS = SecAggParams(degree=4, threshold=3, bits=BITS, scale=SCALE)


def _tensors(flat: np.ndarray) -> dict[str, torch.Tensor]:
    return tensors(flat, LAYOUT, torch.float64)


def _honest_words(q: Quantization, zeta: float, flats: dict[int, np.ndarray], metric=None) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {u: encode_update(q, f, clip_norm=zeta, zero_threshold=None, rng=rng,
                             metric=None if metric is None else metric[u]) for u, f in flats.items()}


def _hostile(q: Quantization, others: dict[int, np.ndarray], index: int) -> np.ndarray:
    """The hostile client's words: zero, except word ``index``, chosen so that the others' sum there
    is 2^(b−1) − 1, the largest value the centred decoding reads as positive."""
    partial = mod_sum(list(others.values()), q.length, q.bits)
    words = np.zeros(q.length, dtype=np.uint64)
    words[index] = np.uint64((HALF - 1 - int(partial[index])) % (1 << BITS))
    return words


def _released(plan, q, words: dict[int, np.ndarray], *, through_protocol: bool, shift=None, count_shift=0.0,
              metric_shift=0.0):
    """Round 0's release from ``words`` summed by SecAgg+ (the real state machines) or by mod_sum, its
    noise draws (repeatable: the same in both worlds) moved by ``shift`` (the vector's, in the noise
    generator's units, before the inflation), ``count_shift`` and ``metric_shift``."""
    if through_protocol:
        server = run_round(PARAMS, words)
        assert sorted(server.contributors) == NODES  # the hostile words are accepted
        total = server.result
    else:
        total = mod_sum(list(words.values()), q.length, q.bits)
    p = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)  # same noise in both worlds
    if shift is not None:
        draw = p.noise.next

        def shifted(out=None, *, salt=None):
            result = draw(out=out, salt=salt)  # a view of ``out`` (the privatizer's flat buffer)
            out.add_(torch.from_numpy(shift).to(p.noise.dtype))
            return result

        p.noise.next = shifted
    with mock.patch("fedmf.round.clipping.count_noise", lambda *a: count_noise(*a) + count_shift), \
            mock.patch("fedmf.round.privatize.metric_noise", lambda *a: metric_noise(*a) + metric_shift):
        mean, report = p.privatize_sum(0, total, NODES, quantization=q, selected=NODES)
    return np.concatenate([mean[k].double().reshape(-1).numpy() for k in LAYOUT]), report


def _worlds(plan, q, zeta, honest_flat, index, metric=None, through_protocol=False):
    """The releases with node 1's update ``honest_flat`` and with it zeroed (zero-out adjacency),
    the others' updates and the hostile client's words the same in both; the second world's noise
    moved by the difference of node 1's two contributions (its decoded words: vector ÷ inflation in
    the generator's units, bit, metric), which is returned too.

    This is the coupling that bounds the privacy loss: the release with node 1 under noise N equals the
    release without it under noise N + δ, for every N and whatever the hostile word, with ‖δ‖ at most
    the sensitivity the noise was calibrated for (ζ_eff, 1, L). Decoding before the noise (the
    mechanism before the HIGH-1 fix) breaks it: at the boundary the two releases differ by 2^b/s."""
    rng = np.random.default_rng(7)
    flats = {u: rng.normal(size=DIM) * 0.01 for u in NODES[1:-1]}
    others = _honest_words(q, zeta, flats, metric)
    hostile = _hostile(q, others, index)
    own = [_honest_words(q, zeta, {1: mine}, None if metric is None else {1: metric[1] if mine.any() else 0.0})
           for mine in (honest_flat, np.zeros(DIM))]
    mine, zeroed = (decode_sum(q, w[1]) for w in own)  # each one client's words, decoded exactly
    delta = (mine.vector - zeroed.vector, 0.0 if mine.unclipped is None else float(mine.unclipped - zeroed.unclipped),
             0.0 if mine.metric is None else mine.metric - zeroed.metric)
    with_me = _released(plan, q, {**own[0], **others, 5: hostile}, through_protocol=through_protocol)
    without_me = _released(plan, q, {**own[1], **others, 5: hostile}, through_protocol=through_protocol,
                           shift=delta[0] / q.inflation, count_shift=delta[1], metric_shift=delta[2])
    return with_me, without_me, delta


# ---- what holds ---------------------------------------------------------------------------------------

ADVERSARIAL = [np.full(DIM, -1e300), np.full(DIM, 5e-324), np.full(DIM, 2.2e-308),
               np.r_[np.full(DIM - 1, 0.0), 1e200], np.r_[1e154, np.full(DIM - 1, 1e154)],
               np.arange(DIM) * 1e30, np.full(DIM, 0.5)]


@pytest.mark.parametrize("scale", [1.0, 3.0, SCALE])
@pytest.mark.parametrize("adaptive", [False, True])
def test_every_decoded_update_is_within_zeta_times_inflation(scale, adaptive):
    """Brute force over adversarial finite inputs (huge, denormal, overflowing norms) and random
    ones in several dtypes: each encoded update decodes to ℓ2 ≤ ζ·inflation (adaptive: ≤ inflation on
    the normalized update), the bit is 0/1, the metric word decodes into [0, L]."""
    rule = AdaptiveClipping.create(0.5, expected_users=10) if adaptive else None
    release = ClientMetricRelease.create(2.5, 1.0, expected_users=10)
    plan = task.plan(rounds=4, adaptive_clipping=rule, client_metrics=release)
    q = quantization_for(plan, DIM, scale=scale, bits=BITS, beta=math.exp(-0.5))
    zeta = 0.37 if adaptive else plan.clip_norm
    bound = q.clip_norm * q.inflation
    rng = np.random.default_rng(1)
    inputs = ADVERSARIAL + [rng.normal(size=DIM) * 10.0 ** k for k in range(-8, 8)]
    metrics = [float("nan"), float("inf"), -1.0, 1e300, 2.5, 2.4999999999, 5e-324, "x", None]
    for i, x in enumerate(inputs):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            t = {k: v.to(dtype) for k, v in _tensors(x).items()}
            if not all(bool(torch.isfinite(v).all()) for v in t.values()):
                with pytest.raises(SecAggError):
                    encode_local_update(q, t, LAYOUT, clip_norm=zeta, zero_threshold=None, rng=rng)
                continue
            metric = metrics[i % len(metrics)]
            words = encode_local_update(q, t, LAYOUT, clip_norm=zeta, zero_threshold=None, rng=rng, metric=metric)
            decoded = decode_sum(q, words)
            assert float(np.linalg.norm(decoded.vector)) <= bound, (i, dtype)
            assert 0.0 <= decoded.metric <= release.clip
            if adaptive:
                assert decoded.unclipped in (0, 1)


def test_non_finite_updates_are_refused_by_the_client():
    q = Quantization(clip_norm=1.0, scale=SCALE, bits=BITS, dim=DIM)
    rng = np.random.default_rng(0)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros(DIM)
        x[3] = bad
        with pytest.raises(SecAggError):
            encode_update(q, x, clip_norm=1.0, zero_threshold=None, rng=rng)
        with pytest.raises(SecAggError):
            quantize(q, x, rng)


# ---- HIGH-1 and LOW-2, fixed (their strict xfails removed) -------------------------------------------

def test_one_hostile_client_cannot_make_an_honest_update_move_the_release_beyond_its_sensitivity():
    plan = task.plan(rounds=4)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    mine = np.zeros(DIM)
    mine[0] = 0.5 * plan.clip_norm  # a small, clipped honest update
    (with_me, _), (without_me, _), (delta, _, _) = _worlds(plan, q, plan.clip_norm, mine, 0, through_protocol=True)
    assert float(np.linalg.norm(delta)) <= plan.clip_norm * q.inflation  # the shift the noise covers
    # equal up to the float32 rounding of the shifted noise (ulp of σ·4, × s·inflation, ÷ s·m)
    np.testing.assert_allclose(with_me, without_me, rtol=0, atol=1e-6)


def test_one_hostile_client_cannot_make_an_honest_bit_move_the_count_by_more_than_one():
    rule = AdaptiveClipping.create(0.5, expected_users=10)
    plan = task.plan(rounds=4, adaptive_clipping=rule)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    mine = np.full(DIM, 1.0)  # ‖Δ‖ = 4 > ζₜ = 0.5: bit 0; zeroed out: the zero vector, bit 1
    (_, with_me), (_, without_me), (_, bit, _) = _worlds(plan, q, 0.5, mine, DIM, through_protocol=True)
    assert bit == -1.0  # |shift| = 1: the count's sensitivity
    assert with_me.noisy_unclipped == without_me.noisy_unclipped  # the same float64 value, wrap or not


def test_one_hostile_client_cannot_make_an_honest_metric_move_its_release_by_more_than_l():
    release = ClientMetricRelease.create(2.0, 1.0, expected_users=10)
    plan = task.plan(rounds=4, client_metrics=release)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    values = {u: 0.5 for u in NODES}
    (_, with_me), (_, without_me), (_, _, moved) = _worlds(plan, q, plan.clip_norm, np.full(DIM, 0.01), q.length - 1,
                                                           metric=values, through_protocol=True)
    assert 0.0 < moved <= release.clip
    assert with_me.noisy_client_metric == pytest.approx(without_me.noisy_client_metric, rel=0, abs=1e-12)


def test_decoding_before_the_noise_would_break_the_coupling_at_the_boundary():
    """The tests above can fail: the pre-fix release centre(W)/s + N, at the hostile boundary, differs
    between the coupled worlds by 2^b/s in the coordinate (the same shifts, the same noise)."""
    plan = task.plan(rounds=4)
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    rng = np.random.default_rng(7)
    others = _honest_words(q, plan.clip_norm, {u: rng.normal(size=DIM) * 0.01 for u in NODES[1:-1]})
    hostile = _hostile(q, others, 0)
    mine = np.zeros(DIM)
    mine[0] = 0.5
    own = _honest_words(q, plan.clip_norm, {1: mine})[1]
    noise = np.random.default_rng(1).normal(size=DIM)
    w_with = mod_sum([own, *others.values(), hostile], q.length, q.bits)
    w_without = mod_sum([*others.values(), hostile], q.length, q.bits)
    delta = decode_sum(q, own).vector
    before = decode_sum(q, w_with).vector + noise - (decode_sum(q, w_without).vector + noise + delta)
    assert abs(before[0]) == (1 << BITS) / SCALE  # decode, then noise: the wrap
    after = (noisy_centred(q.bits, q.scale, w_with, noise) - noisy_centred(q.bits, q.scale, w_without, noise + delta))
    assert float(np.abs(after).max()) <= 1e-9  # noise, then decode (the fix): no wrap between the worlds


@pytest.mark.parametrize("adaptive, value, zeta", [(False, 1e200, 1.0), (True, 1e200, 0.5), (True, 1e307, 0.05)])
def test_a_huge_finite_update_is_clipped_by_the_client_as_by_the_central_server(adaptive, value, zeta):
    rule = AdaptiveClipping.create(0.5, expected_users=10) if adaptive else None
    plan = task.plan(rounds=4, adaptive_clipping=rule, zero_threshold=None)  # ζ₀ = 1
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=math.exp(-0.5))
    huge = np.zeros(DIM)
    huge[:4] = value
    central = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True, dtype=torch.float64)
    _, report = central.privatize(0, {1: _tensors(huge)}, selected=[1])
    assert report.users[0].status == "contributed" and report.users[0].clipped  # the central server clips it
    words = encode_local_update(q, _tensors(huge), LAYOUT, clip_norm=zeta, zero_threshold=None,
                                rng=np.random.default_rng(0))  # zeroed (or refused) before the LOW-2 fix
    expected = q.clip_norm * (huge / value) / np.linalg.norm(huge / value)  # the clipped direction
    assert float(np.abs(decode_sum(q, words).vector - expected).max()) <= 2.0 / SCALE


# ---- accounting, the plan's record, noise per attempt (hold) -----------------------------------------

@pytest.mark.parametrize("adaptive", [False, True])
def test_secure_aggregation_leaves_the_accounting_and_scales_only_sigma(adaptive):
    rule = AdaptiveClipping.create(0.5, expected_users=10) if adaptive else None
    plan = task.plan(rounds=6, adaptive_clipping=rule)
    params = SecAggParams(degree=4, threshold=3, bits=BITS, scale=3.0)  # coarse: a visible inflation
    secure = plan.with_secure_aggregation(params, DIM)
    q = quantization_for(plan, DIM, scale=params.scale, bits=BITS, beta=params.beta)
    assert secure.secure_aggregation.inflation == q.inflation > 1.01
    assert secure.epsilon() == plan.epsilon() and secure.rho() == plan.rho()
    assert [secure.epsilon_after(t) for t in range(6)] == [plan.epsilon_after(t) for t in range(6)]
    assert secure.noise_multiplier == plan.noise_multiplier and secure.noise_std == plan.noise_std
    assert secure.effective_noise_std == plan.noise_std * q.inflation
    assert secure.fingerprint != plan.fingerprint
    other = plan.with_secure_aggregation(SecAggParams(degree=4, threshold=3, bits=BITS, scale=4.0), DIM)
    assert other.fingerprint != secure.fingerprint
    with pytest.raises(Exception, match="fingerprint|another|plan"):
        other.check_fingerprint(secure.fingerprint, "checkpoint")
    data = secure.to_dict()
    assert type(secure).from_dict(data, secure.mechanism).fingerprint == secure.fingerprint
    data["secure_aggregation"]["inflation"] = 1.0  # an edited inflation: refused on load
    with pytest.raises(Exception, match="inflation"):
        type(secure).from_dict(data, secure.mechanism)


def test_a_secure_sum_draws_its_noise_at_finish_only_and_afresh_on_each_attempt():
    plan = task.plan(rounds=4)
    params = SecAggParams(degree=4, threshold=3, bits=BITS, scale=SCALE)
    secure_plan = plan.with_secure_aggregation(params, DIM)
    inflation = secure_plan.secure_aggregation.inflation
    q = quantization_for(plan, DIM, scale=SCALE, bits=BITS, beta=params.beta)
    assert q.inflation == inflation
    total = np.random.default_rng(2).integers(0, 1 << BITS, q.length, dtype=np.uint64)
    p = RoundPrivatizer(secure_plan, LAYOUT, seed=SEED)
    before = p.state_dict()
    before = {**before, "noise": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                  for k, v in before["noise"].items()}}
    p.begin(0, NODES)
    p.add_sum(total, NODES, quantization=q)
    p.abort()  # an aborted attempt: no draw, the generator still serves round 0
    assert p.next_round == 0
    first, _ = p.privatize_sum(0, total, NODES, quantization=q, selected=NODES)
    redo = RoundPrivatizer(secure_plan, LAYOUT, seed=SEED)
    redo.load_state_dict(before)
    second, _ = redo.privatize_sum(0, total, NODES, quantization=q, selected=NODES)
    assert not torch.equal(first["w"], second["w"])  # salted: fresh noise on the redo
    with pytest.raises(Exception, match="inflation"):  # only the plan's inflation
        coarse = quantization_for(plan, DIM, scale=3.0, bits=BITS, beta=params.beta)
        p.privatize_sum(1, total, NODES, quantization=coarse, selected=NODES)
    with pytest.raises(Exception, match="secure"):  # no plain update into a secure plan
        p.privatize(1, {1: _tensors(np.zeros(DIM))}, selected=NODES)
