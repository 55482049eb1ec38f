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


def test_arrays_and_the_user_by_user_path_agree(setup, monkeypatch):
    """account_contributions (arrays) is account_observed; a strategy too large to hold
    densely is accounted user by user (fedmf.sensitivity.observed) with the same values."""
    from fedmf.accounting import posthoc as module
    from fedmf.errors import FedmfError

    mechanism, planned, pattern = setup
    report = posthoc(mechanism, 1.0, 1e-6, pattern, planned)
    observed = Observed.from_mapping(pattern)
    labels = [u for u, _ in observed.rounds_by_user]
    users = np.repeat(np.arange(len(labels)), [len(r) for _, r in observed.rounds_by_user])
    rounds = np.concatenate([r for _, r in observed.rounds_by_user]).astype(int)
    arrays = module.account_contributions(mechanism, 1.0, 1e-6, planned, users, rounds, labels, by_round=True)
    assert arrays.users == report.users
    # after the last round the worst prefix is the worst user; before, never above it
    assert arrays.sensitivity_by_round[-1] == pytest.approx(max(u.sensitivity for u in report.users), rel=1e-12)
    assert np.all(np.diff(arrays.sensitivity_by_round) >= 0)
    assert arrays.epsilon_by_round[-1] == pytest.approx(report.epsilon, rel=1e-9)
    monkeypatch.setattr(module, "MAX_DENSE_ENTRIES", 10)
    by_user = posthoc(mechanism, 1.0, 1e-6, pattern, planned)
    for a, b in zip(by_user.users, report.users):
        assert (a.user, a.rounds, a.violation, a.sensitivity_exact) == (b.user, b.rounds, b.violation, True)
        assert a.sensitivity == pytest.approx(b.sensitivity, rel=1e-12)
        assert a.epsilon == pytest.approx(b.epsilon, rel=1e-9)
    with pytest.raises(FedmfError, match="too large"):
        module.account_contributions(mechanism, 1.0, 1e-6, planned, users, rounds, labels, by_round=True)


def test_bad_arrays_are_refused(setup):
    from fedmf.accounting.posthoc import account_contributions
    from fedmf.errors import ConfigError

    mechanism, planned, _ = setup
    args = (mechanism, 1.0, 1e-6, planned)
    with pytest.raises(ConfigError, match="'b' has a round outside"):
        account_contributions(*args, np.array([0, 1]), np.array([3, N]), ["a", "b"])
    with pytest.raises(ConfigError, match="'a': rounds must be increasing"):
        account_contributions(*args, np.array([0, 0]), np.array([5, 5]), ["a"])
    with pytest.raises(ConfigError, match="sorted"):
        account_contributions(*args, np.array([1, 0]), np.array([1, 2]), ["a", "b"])
    with pytest.raises(ConfigError, match="MinSep or FixedEpoch"):
        account_contributions(mechanism, 1.0, 1e-6, Observed(()), np.array([0]), np.array([1]), ["a"])


def test_signed_strategies_take_the_smaller_sound_value():
    """C with negative entries: each user's value is the smaller of the |C| bound and the
    Gram block's pattern sensitivity, never below the true (brute-force) value."""
    from fedmf.mechanisms.identity import DpSgd
    from fedmf.sensitivity import exhaustive_minsep, pattern_sensitivity

    rng = np.random.default_rng(11)
    c = np.tril(rng.normal(size=(10, 10))) + 3 * np.eye(10)

    class Signed(DpSgd):
        def strategy_matrix(self):
            return c.copy()

        def strategy_columns(self, rounds):
            return c[:, list(rounds)]

        @property
        def strategy_toeplitz(self):
            return None

        @property
        def strategy_bands(self):
            return None

        def column_norms_sq(self):
            return np.sum(c**2, axis=0)

    mech = Signed(10)
    pattern = {"a": [0, 4, 8], "b": [1, 6], "c": [2, 5, 9], "d": [7]}
    report = posthoc(mech, 2.0, 1e-6, pattern, MinSep(3, 3))
    for account in report.users:
        p = list(account.rounds)
        upper = np.linalg.norm(np.abs(c[:, p]).sum(axis=1))
        gram = pattern_sensitivity((c.T @ c)[np.ix_(p, p)])
        assert account.sensitivity == pytest.approx(min(upper, gram.value), rel=1e-12)
        assert account.sensitivity_exact == gram.exact
        assert account.sensitivity >= exhaustive_minsep(c[:, p], 1) - 1e-9
