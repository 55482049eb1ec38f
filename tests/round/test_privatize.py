"""RoundPrivatizer: validation, ℓ∞ zeroing, ℓ2 clipping, the sum, noise once, the planned divisor."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch

from fedmf import MinSep
from fedmf.errors import HorizonReached, PlanMismatch, RoundOrderError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.noise import NoiseGenerator
from fedmf.round.privatize import RoundPrivatizer, check_update

N, B, K = 12, 3, 4
LAYOUT = {"w": (3, 4), "b": (4,)}
SEED = b"test-seed-0123456789abcdef"


def _plan(**kw):
    mech = kw.pop("mechanism", None) or build("bsr", N, MinSep(B, K), num_bands=3)
    args = dict(clip_norm=1.0, delta=1e-5, expected_users=5, noise_multiplier=0.7, zero_threshold=10.0)
    args.update(kw)
    return RunPlan.create(mech, MinSep(B, K), **args)


def _update(scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
            for name, shape in LAYOUT.items()}


def _flat(update):
    return torch.cat([update[k].reshape(-1).double() for k in LAYOUT])


@pytest.mark.parametrize("update, fragment", [
    ([1, 2], "not a mapping"),
    ({"w": torch.zeros(3, 4)}, "missing b"),
    ({**_update(), "extra": torch.zeros(1)}, "unexpected extra"),
    ({"w": torch.zeros(4, 3), "b": torch.zeros(4)}, "shape"),
    ({"w": torch.zeros(3, 4, dtype=torch.int64), "b": torch.zeros(4)}, "not floating"),
    ({"w": torch.full((3, 4), float("nan")), "b": torch.zeros(4)}, "non-finite"),
    ({"w": torch.zeros(3, 4), "b": torch.tensor([0, 0, float("inf"), 0])}, "non-finite"),
    ({"w": [[0.0] * 4] * 3, "b": torch.zeros(4)}, "not a tensor"),
])
def test_check_update_gives_the_reason(update, fragment):
    reason = check_update(update, LAYOUT)
    assert reason is not None and fragment in reason and "\n" not in reason
    assert check_update(_update(), LAYOUT) is None
    assert check_update(_update(dtype=torch.float64), LAYOUT) is None  # any floating dtype is accepted


def test_clipping_zeroing_sum_and_the_planned_divisor():
    plan = _plan()
    privatizer = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True)
    small, large, huge = _update(0.05, 1), _update(3.0, 2), _update(0.01, 3)
    huge["b"][1] = 11.0  # ℓ∞ > zero_threshold = 10 → replaced by zero
    mean, report = privatizer.privatize(0, {"u1": small, "u2": large, "u3": huge})
    by_user = {r.user: r for r in report.users}
    assert not by_user["u1"].clipped and by_user["u1"].norm == pytest.approx(float(_flat(small).norm()), rel=1e-12)
    assert by_user["u2"].clipped and by_user["u2"].norm > 1.0
    assert by_user["u3"].zeroed and not by_user["u3"].clipped
    assert report.counts() == {"contributed": 3, "rejected": 0, "clipped": 1, "zeroed": 1}
    # independent path: clip in float64, add the same generator's noise, divide by the PLANNED 5 (not 3)
    noise = NoiseGenerator(plan.mechanism, LAYOUT, plan.noise_std, dtype=torch.float32, device="cpu", seed=SEED).next()
    clipped = _flat(large) * (1.0 / float(_flat(large).norm()))
    expected = (_flat(small) + clipped + torch.cat([noise[k].reshape(-1).double() for k in LAYOUT])) / 5
    got = torch.cat([mean[k].reshape(-1).double() for k in LAYOUT])
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_clipped_norm_never_exceeds_the_clip_norm():
    plan = _plan(noise_multiplier=1e-9)
    for seed in range(50):
        privatizer = RoundPrivatizer(_plan(clip_norm=0.37, zero_threshold=None), LAYOUT, device="cpu", seed=SEED)
        update = _update(1 + seed, seed)
        privatizer.begin(0)
        privatizer.add("u", update)
        assert float(torch.linalg.vector_norm(privatizer._sum, dtype=torch.float64)) <= 0.37
        assert float(torch.linalg.vector_norm(privatizer._sum, dtype=torch.float64)) == pytest.approx(0.37, rel=1e-5)
        privatizer.abort()
    assert plan.noise_std > 0


def test_zero_updates_give_exactly_the_noise_over_the_expected_users():
    plan = _plan()
    privatizer = RoundPrivatizer(plan, LAYOUT, device="cpu", dtype=torch.float64, seed=SEED, repeatable_noise=True)
    reference = NoiseGenerator(plan.mechanism, LAYOUT, plan.noise_std, dtype=torch.float64, device="cpu", seed=SEED)
    zeros = {k: torch.zeros(s, dtype=torch.float64) for k, s in LAYOUT.items()}
    for t in range(N):
        mean, _ = privatizer.privatize(t, {"a": zeros, "b": zeros})
        noise = reference.next()
        for k in LAYOUT:  # noise enters once, in round t, divided by the planned users
            assert torch.equal(mean[k], torch.add(torch.zeros_like(noise[k]), noise[k]).div_(5))
    with pytest.raises(HorizonReached):
        privatizer.begin(N)


def test_rejected_updates_leave_the_aggregate_unchanged_and_order_does_not_matter():
    plan = _plan()
    good = {"u1": _update(0.2, 1), "u2": _update(2.0, 2), "u3": _update(0.3, 3)}
    bad = {"nan": {"w": torch.full((3, 4), float("nan")), "b": torch.zeros(4)},
           "shape": {"w": torch.zeros(2, 2), "b": torch.zeros(4)},
           "intruder": _update(0.1, 9)}
    clean, _ = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True).privatize(0, good)
    mixed = dict(reversed(list({**bad, **good}.items())))
    noisy, report = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True).privatize(
        0, mixed, selected=["u1", "u2", "u3", "nan", "shape"])
    for k in LAYOUT:
        assert torch.equal(clean[k], noisy[k])
    reasons = {r.user: r.reason for r in report.rejected}
    assert set(reasons) == {"nan", "shape", "intruder"}
    assert "non-finite" in reasons["nan"] and "shape" in reasons["shape"] and "not selected" in reasons["intruder"]


def test_a_second_update_from_the_same_user_is_refused():
    privatizer = RoundPrivatizer(_plan(), LAYOUT, device="cpu", seed=SEED)
    privatizer.begin(0)
    assert privatizer.add("u", _update()).status == "contributed"
    second = privatizer.add("u", _update(seed=5))
    assert second.status == "rejected" and "second update" in second.reason


def test_rounds_are_served_in_order_only():
    privatizer = RoundPrivatizer(_plan(), LAYOUT, device="cpu", seed=SEED)
    with pytest.raises(RoundOrderError):
        privatizer.begin(1)
    privatizer.privatize(0, {"u": _update()})
    with pytest.raises(RoundOrderError):
        privatizer.begin(0)
    privatizer.begin(1)
    with pytest.raises(RoundOrderError):
        privatizer.begin(1)
    with pytest.raises(RoundOrderError):
        privatizer.state_dict()


def test_state_dict_continues_bit_identically_and_holds_no_seed():
    plan = _plan()
    updates = [{"u": _update(1.0, t)} for t in range(N)]
    straight = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True)
    expected = [straight.privatize(t, updates[t])[0] for t in range(N)]
    first = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True)
    for t in range(5):
        first.privatize(t, updates[t])
    state = first.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert SEED not in buffer.getvalue() and SEED not in pickle.dumps(state)
    second = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True)
    second.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    for t in range(5, N):
        got, _ = second.privatize(t, updates[t])
        for k in LAYOUT:
            assert torch.equal(got[k], expected[t][k])
    with pytest.raises(PlanMismatch):
        RoundPrivatizer(plan, LAYOUT, device="cpu", seed=b"another-seed-0123456789").load_state_dict(state)
    with pytest.raises(PlanMismatch):
        RoundPrivatizer(_plan(clip_norm=2.0), LAYOUT, device="cpu", seed=SEED).load_state_dict(state)


def test_noise_std_in_the_report_is_absolute():
    plan = _plan(clip_norm=2.5)
    _, report = RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED).privatize(0, {})
    assert report.noise_std == pytest.approx(0.7 * 2.5 * plan.sensitivity.value, rel=1e-12)
    assert math.isclose(report.expected_users, 5)


def test_values_that_overflow_the_model_dtype_are_rejected_not_summed():
    privatizer = RoundPrivatizer(_plan(), LAYOUT, device="cpu", seed=SEED)
    huge = {k: torch.full(s, 1e39, dtype=torch.float64) for k, s in LAYOUT.items()}  # finite in float64 only
    privatizer.begin(0)
    result = privatizer.add("u", huge)
    assert result.status == "rejected" and "overflow" in result.reason
    assert float(privatizer._sum.abs().max()) == 0.0


def test_norms_that_overflow_float64_are_clipped_correctly():
    plan = _plan(zero_threshold=None)
    privatizer = RoundPrivatizer(plan, LAYOUT, device="cpu", dtype=torch.float64, seed=SEED)
    big = {k: torch.full(s, 1e200, dtype=torch.float64) for k, s in LAYOUT.items()}
    privatizer.begin(0)
    result = privatizer.add("u", big)
    assert result.status == "contributed" and result.clipped and math.isfinite(result.norm)
    assert result.norm == pytest.approx(1e200 * math.sqrt(16), rel=1e-12)
    total = float(torch.linalg.vector_norm(privatizer._sum))
    assert total <= 1.0 and total == pytest.approx(1.0, rel=1e-9)
    mean, _ = privatizer.finish()
    assert all(bool(torch.isfinite(v).all()) for v in mean.values())


def test_a_state_from_another_device_type_is_refused():
    privatizer = RoundPrivatizer(_plan(), LAYOUT, device="cpu", seed=SEED)
    state = privatizer.state_dict()
    assert state["device_type"] == "cpu"
    state["device_type"] = "cuda"
    with pytest.raises(PlanMismatch, match="device"):
        RoundPrivatizer(_plan(), LAYOUT, device="cpu", seed=SEED).load_state_dict(state)


def test_half_precision_models_are_summed_and_clipped_in_float32():
    privatizer = RoundPrivatizer(_plan(zero_threshold=None), LAYOUT, device="cpu", dtype=torch.bfloat16, seed=SEED)
    privatizer.begin(0)
    privatizer.add("u", _update(5.0, 1, dtype=torch.bfloat16))
    assert privatizer._sum.dtype == torch.float32
    assert float(torch.linalg.vector_norm(privatizer._sum)) == pytest.approx(1.0, rel=1e-5)
    mean, _ = privatizer.finish()
    assert all(v.dtype == torch.bfloat16 for v in mean.values())


def test_blocked_norm_is_a_rigorous_upper_bound_for_clipping():
    layout = {"a": (3 * 256 + 7,), "b": (5, 256)}
    mech = build("bsr", N, MinSep(B, K), num_bands=3)
    plan = RunPlan.create(mech, MinSep(B, K), clip_norm=0.5, delta=1e-5, expected_users=1, noise_multiplier=1.0,
                          zero_threshold=None)
    g = torch.Generator().manual_seed(7)
    for trial in range(100):
        privatizer = RoundPrivatizer(plan, layout, device="cpu", seed=SEED)
        scale = torch.exp(torch.randn(1, generator=g) * 4).item()
        update = {k: torch.randn(s, generator=g) * scale * (1 + 1000 * (torch.rand(s, generator=g) > 0.99))
                  for k, s in layout.items()}
        privatizer.begin(0)
        result = privatizer.add("u", update)
        exact = float(torch.cat([v.reshape(-1).double() for v in update.values()]).norm())
        assert result.norm == pytest.approx(exact, rel=1e-5)
        contributed = float(privatizer._sum.double().norm())
        assert contributed <= 0.5, (trial, contributed)
        assert contributed == pytest.approx(min(exact, 0.5), rel=1e-4)
        privatizer.abort()


@pytest.mark.parametrize("dtype, value, clip", [(torch.float32, 1e-23, 1e-21), (torch.float32, 1e-40, 1e-39),
                                                (torch.float64, 1e-170, 1e-168), (torch.float64, 1e160, 1e150)])
def test_norms_of_underflowing_and_overflowing_squares_still_bound_the_clip(dtype, value, clip):
    layout = {"w": (40000,)}
    mech = build("bsr", N, MinSep(B, K), num_bands=3)
    plan = RunPlan.create(mech, MinSep(B, K), clip_norm=clip, delta=1e-5, expected_users=1, noise_multiplier=1.0,
                          zero_threshold=None)
    privatizer = RoundPrivatizer(plan, layout, device="cpu", dtype=dtype, seed=SEED)
    g = torch.Generator().manual_seed(3)
    update = {"w": (torch.rand(40000, generator=g, dtype=torch.float64) + 0.5).to(dtype) * value}
    privatizer.begin(0)
    assert privatizer.add("u", update).status == "contributed"
    exact = float(torch.linalg.vector_norm(privatizer._sum.double() / value)) * value  # scaled: no under/overflow
    assert exact <= clip * (1 + 1e-12)
    privatizer.abort()
