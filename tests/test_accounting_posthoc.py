"""Post-hoc accounting (fedmf.accounting.posthoc): each user's own sensitivity and
epsilon; users who broke the plan are flagged and accounted with their larger sensitivity."""

from __future__ import annotations

import numpy as np
import pytest

from fedmf import FixedEpoch, MinSep, Observed
from fedmf.accounting import account_observed as posthoc
from fedmf.accounting import epsilon, gaussian
from fedmf.mechanisms import build

N = 32


def own_sensitivity(mechanism, rounds):
    cols = mechanism.strategy_matrix()[:, list(rounds)]
    return float(np.linalg.norm(cols.sum(axis=1)))  # C >= 0: the all-ones direction is worst


@pytest.fixture
def setup():
    planned = MinSep(8, 4)
    mechanism = build("bsr", N, planned, num_bands=12)  # 12 bands > b: overlapping columns
    pattern = {
        "regular": [0, 8, 16, 24],
        "sparse": [3, 20],
        "late": [31],
        "idle": [],
        "too-close": [0, 4, 8, 12],  # 4 < b rounds apart
        "too-many": [0, 6, 12, 18, 24, 30],  # more than k, too close
    }
    return mechanism, planned, pattern


def test_each_user_gets_their_own_epsilon(setup):
    mechanism, planned, pattern = setup
    report = posthoc(mechanism, 1.0, 1e-6, pattern, planned)
    sens = mechanism.sensitivity(planned).value
    assert report.planned_epsilon == epsilon(mechanism, 1.0, 1e-6, planned).epsilon
    by_user = {u.user: u for u in report.users}
    for user, rounds in pattern.items():
        account = by_user[user]
        if not rounds:
            assert account.epsilon == 0.0 and account.sensitivity == 0.0
            continue
        s = own_sensitivity(mechanism, rounds)
        assert account.sensitivity == pytest.approx(s, rel=1e-12)
        assert account.epsilon == pytest.approx(gaussian.epsilon(sens / s, 1e-6), rel=1e-9)
    assert by_user["regular"].epsilon == pytest.approx(report.planned_epsilon, rel=1e-9)
    assert by_user["sparse"].epsilon < report.planned_epsilon


def test_violators_are_flagged_and_never_get_the_planned_sensitivity(setup):
    mechanism, planned, pattern = setup
    report = posthoc(mechanism, 1.0, 1e-6, pattern, planned)
    flagged = {u.user: u for u in report.violators}
    assert set(flagged) == {"too-close", "too-many"}
    assert "apart" in flagged["too-close"].violation and "participations" in flagged["too-many"].violation
    for account in flagged.values():
        assert account.sensitivity > report.planned_sensitivity
        assert account.epsilon > report.planned_epsilon
    worst = report.worst
    assert worst.user == "too-many" and report.epsilon == worst.epsilon
    d = report.to_dict()
    assert d["worst_user"]["user"] == "too-many" and d["distribution"]["above_planned"] == 2
    assert d["distribution"]["users"] == len(pattern) and d["distribution"]["max"] == worst.epsilon
    assert len(d["violators"]) == 2 and "users" not in d and len(report.to_dict(per_user=True)["users"]) == 6


def test_conforming_users_never_exceed_the_plan():
    planned = MinSep(4, 3)
    mechanism = build("bisr", 24, planned, num_bands=3)
    rng = np.random.default_rng(0)
    pattern = {}
    for u in range(200):
        rounds, t = [], int(rng.integers(0, 8))
        while t < 24 and len(rounds) < 3:
            rounds.append(t)
            t += int(rng.integers(4, 10))
        pattern[f"u{u}"] = rounds
    report = posthoc(mechanism, 0.9, 1e-6, Observed.from_mapping(pattern), planned)
    assert not report.violators
    assert report.epsilon <= report.planned_epsilon
    eps = report.epsilons()
    assert eps.size == 200 and report.distribution()["median"] <= report.distribution()["max"]


def test_fixed_epoch_slots():
    planned = FixedEpoch(4, 8)
    mechanism = build("bsr", N, MinSep(8, 4), num_bands=8)
    report = posthoc(mechanism, 1.0, 1e-6, {"ok": [2, 10, 26], "moved": [2, 11]}, planned)
    assert [u.user for u in report.violators] == ["moved"]
    assert "slot" in report.violators[0].violation


def test_noise_sensitivity_override_and_validation(setup):
    mechanism, planned, pattern = setup
    sens = mechanism.sensitivity(planned).value
    same = posthoc(mechanism, 1.0, 1e-6, pattern, planned, noise_sensitivity=sens)
    half = posthoc(mechanism, 1.0, 1e-6, pattern, planned, noise_sensitivity=sens / 2)
    assert half.epsilon > same.epsilon  # less noise than planned: more epsilon for everyone
    with pytest.raises(ValueError, match="outside"):
        posthoc(mechanism, 1.0, 1e-6, {"x": [N]}, planned)
    with pytest.raises(ValueError, match="delta"):
        posthoc(mechanism, 1.0, 2.0, pattern, planned)
