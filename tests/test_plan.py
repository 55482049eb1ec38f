"""RunPlan: validation at the edge, σ = z·ζ·sens, calibration, fingerprint, the guard."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from fedmf import FixedEpoch, MinSep
from fedmf.errors import ConfigError, HorizonReached, PlanMismatch, PrivacyBudgetExceeded
from fedmf.mechanisms import build
from fedmf.plan import RunPlan

N, B, K = 32, 8, 4


def _plan(**kw):
    mech = kw.pop("mechanism", None) or build("dp-sgd", N, MinSep(B, K))
    schema = kw.pop("schema", MinSep(B, K))
    args = dict(clip_norm=0.5, delta=1e-5, expected_users=10, noise_multiplier=1.3)
    args.update(kw)
    return RunPlan.create(mech, schema, **args)


def test_noise_std_is_z_clip_sens():
    plan = _plan()
    # DP-SGD (C = I) under MinSep(b, k): sens = sqrt(k) (k disjoint unit columns)
    assert plan.sensitivity.value == pytest.approx(math.sqrt(K), rel=1e-12)
    assert plan.noise_std == pytest.approx(1.3 * 0.5 * math.sqrt(K), rel=1e-12)
    bsr = build("bsr", N, MinSep(B, K), num_bands=4)
    plan = _plan(mechanism=bsr)
    assert plan.noise_std == pytest.approx(1.3 * 0.5 * bsr.sensitivity(MinSep(B, K)).value, rel=1e-12)


def test_default_zero_threshold_is_100_clip_norms_and_none_disables():
    assert _plan().zero_threshold == pytest.approx(50.0)
    assert _plan(zero_threshold=None).zero_threshold is None
    assert _plan(zero_threshold=3.0).zero_threshold == 3.0


def test_calibration_reaches_the_target_by_an_independent_accountant():
    plan = _plan(noise_multiplier=None, target_epsilon=2.0)
    z = plan.noise_multiplier
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(z))
    eps = accountant.get_epsilon(1e-5)
    assert eps <= 2.0 * (1 + 1e-6)
    assert eps == pytest.approx(2.0, rel=1e-2)
    assert plan.epsilon() == pytest.approx(eps, rel=1e-3)
    # the calibrated z is recorded: rebuilding from the dict does not change it
    again = RunPlan.from_dict(plan.to_dict(), plan.mechanism)
    assert again.noise_multiplier == z and again.fingerprint == plan.fingerprint


def test_fingerprint_is_stable_and_changes_with_every_field():
    plan = _plan()
    assert RunPlan.from_dict(plan.to_dict(), plan.mechanism).fingerprint == plan.fingerprint
    variants = [_plan(clip_norm=0.6), _plan(delta=1e-6), _plan(expected_users=11), _plan(noise_multiplier=1.4),
                _plan(zero_threshold=None), _plan(accountant="rdp"), _plan(target_epsilon=100.0),
                _plan(mechanism=build("bisr", N, MinSep(B, K), num_bands=2)),
                _plan(schema=MinSep(B, K - 1)),
                _plan(mechanism=build("bsr", N, MinSep(B, K), num_bands=4), sampling="cyclic-poisson:0.5")]
    prints = {v.fingerprint for v in variants} | {plan.fingerprint}
    assert len(prints) == len(variants) + 1


def test_from_dict_refuses_another_mechanism():
    plan = _plan()
    with pytest.raises(PlanMismatch):
        RunPlan.from_dict(plan.to_dict(), build("bisr", N, MinSep(B, K), num_bands=2))
    with pytest.raises(PlanMismatch):
        plan.check_fingerprint("sha256:" + "0" * 64, "a checkpoint")
    plan.check_fingerprint(plan.fingerprint, "a checkpoint")


def test_epsilon_by_round_is_monotone_and_ends_at_the_total():
    plan = _plan(mechanism=build("bsr", N, MinSep(B, K), num_bands=4))
    curve = plan.epsilon_by_round()
    assert curve.shape == (N,)
    assert np.all(np.diff(curve) >= 0)
    assert curve[-1] == pytest.approx(plan.epsilon(), rel=1e-12)


def test_guard_stops_at_the_horizon_and_at_the_first_round_over_budget():
    plan = _plan(mechanism=build("bsr", N, MinSep(B, K), num_bands=4))
    curve = plan.epsilon_by_round()
    jumps = [t for t in range(10, N) if curve[t] > curve[t - 1] * (1 + 1e-6)]
    assert jumps, "the test needs a curve that grows after round 10"
    target = float(curve[jumps[0] - 1] + curve[jumps[0]]) / 2
    guarded = _plan(mechanism=plan.mechanism, target_epsilon=target)
    first_over = int(np.argmax(curve > target))
    assert first_over == jumps[0]
    for t in range(first_over):
        guarded.guard(t)
    with pytest.raises(PrivacyBudgetExceeded):
        guarded.guard(first_over)
    with pytest.raises(PrivacyBudgetExceeded):
        guarded.guard(0, observed_epsilon=target * 1.01)
    with pytest.raises(HorizonReached):
        plan.guard(N)


@pytest.mark.parametrize("kw", [
    {"clip_norm": 0}, {"clip_norm": float("nan")}, {"delta": 1.0}, {"delta": 0}, {"expected_users": -1},
    {"expected_users": True}, {"noise_multiplier": None}, {"zero_threshold": "huge"}, {"zero_threshold": -1.0},
    {"accountant": "moments"}, {"sampling": "bminsep"}, {"sampling": "poisson:0.1"},
    {"schema": FixedEpoch(4, 8), "sampling": "bminsep:0.1"},
])
def test_bad_values_are_one_line_config_errors(kw):
    with pytest.raises(ConfigError) as info:
        _plan(**kw)
    assert "\n" not in str(info.value)
