"""The participation scheduler: the stream format (checked against hashlib directly), determinism,
resume, MinSep enforcement by brute force, and sampling rates against their formulas. Every test
uses a fixed key, so the statistical checks are deterministic (they cannot fail by chance)."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import pickle
import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from fedmf.errors import CheckpointError, ConfigError, HorizonReached, PlanMismatch, RoundOrderError
from fedmf.participation import FixedEpoch, MinSep
from fedmf.schedule import (
    BMinSepPoisson,
    CyclicPoisson,
    FixedEpochOrder,
    MinSepSelection,
    PoissonSampling,
    Selection,
    make_scheduler,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def keyed_word(purpose: bytes, t: int, user, key: bytes = KEY) -> int:
    """The documented stream, computed independently of fedmf.schedule."""
    msg = purpose + b"\0" + t.to_bytes(8, "big", signed=True) + str(user).encode()
    return int.from_bytes(hashlib.blake2b(msg, key=key, person=b"fedmf-sched-v1", digest_size=8).digest(), "big")


def heads(t: int, user, p: float) -> bool:
    return (keyed_word(b"coin", t, user) >> 11) * 2.0**-53 < p


def availability(users, rounds: int, fraction: float, seed: int) -> list[list]:
    rng = random.Random(seed)
    return [[u for u in users if rng.random() < fraction] for _ in range(rounds)]


def run(scheduler, available: list[list], start: int = 0) -> list[Selection]:
    return [scheduler.select(t, available[t]) for t in range(start, len(available))]


def rounds_by_user(selections: list[Selection]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for sel in selections:
        for u in sel.selected:
            out[str(u)].append(sel.round)
    return out


def cold_rates(p: float, b: int, rounds: int) -> list[float]:
    """u_t = p·(1 − Σ_{j=t−b+1}^{t−1} u_j): selection probability of a cold-started user (notes §3.2)."""
    u: list[float] = []
    for t in range(rounds):
        u.append(p * (1.0 - sum(u[max(0, t - b + 1): t])))
    return u


SCHEMES = {
    "min-sep": lambda key=KEY: MinSepSelection(3, 4, 5, key),
    "bminsep-cold": lambda key=KEY: BMinSepPoisson(3, 0.3, key, max_participations=6),
    "bminsep-warm": lambda key=KEY: BMinSepPoisson(4, 0.25, key, warm_start=True),
    "cyclic": lambda key=KEY: CyclicPoisson(3, 0.5, key),
    "poisson": lambda key=KEY: PoissonSampling(0.2, key, max_participations=5),
    "fixed-epoch": lambda key=KEY: FixedEpochOrder(4, 10, range(30), key),
}


def _scenario(rounds: int = 40) -> list[list]:
    """Users 0..29 at random; users 30..39 (strings too) first appear at round 12."""
    early = availability(range(30), rounds, 0.7, seed=1)
    late = availability([*range(30, 35), *(f"u{i}" for i in range(5))], rounds, 0.6, seed=2)
    return [early[t] + (late[t] if t >= 12 else []) for t in range(rounds)]


# ---------------------------------------------------------------------------------------
# the stream, bit for bit
# ---------------------------------------------------------------------------------------
def test_min_sep_picks_the_smallest_keyed_hashes():
    s = MinSepSelection(1, None, 3, KEY)
    users = [5, "a", 17, "b", 2, 40, 41]
    for t in range(4):
        expected = sorted(sorted(users, key=lambda u: keyed_word(b"pick", t, u))[:3], key=str)
        assert list(s.select(t, users).selected) == expected


def test_coins_groups_and_slots_follow_the_documented_stream():
    users = list(range(50))
    poisson = PoissonSampling(0.3, KEY)
    bms = BMinSepPoisson(2, 0.4, KEY)
    for sched in (poisson, bms):
        sched.add_users(users)
    for t in range(3):
        sel = poisson.select(t, users)
        assert sel.selected == tuple(sorted((u for u in users if heads(t, u, 0.3)), key=str))
    # b-min-sep round 0 (cold): every user flips; round 1: only those not selected in round 0
    first = {u for u in users if heads(0, u, 0.4)}
    assert set(bms.select(0, users).selected) == first
    assert set(bms.select(1, users).selected) == {u for u in users if u not in first and heads(1, u, 0.4)}

    cyc = CyclicPoisson(3, 1.0, KEY)
    cyc.add_users(users)
    for t in range(3):
        assert set(cyc.select(t, users).selected) == {u for u in users if keyed_word(b"group", 0, u) % 3 == t}

    fixed = FixedEpochOrder(4, 2, users, KEY)
    ranked = sorted(sorted(users, key=str), key=lambda u: keyed_word(b"slot", 0, u))
    for t in range(8):
        assert set(fixed.select(t, users).selected) == {u for r, u in enumerate(ranked) if r % 4 == t % 4}


# ---------------------------------------------------------------------------------------
# determinism and resume
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMES))
def test_deterministic_and_independent_of_the_order_of_available(name):
    available = _scenario()
    a, b = SCHEMES[name](), SCHEMES[name]()
    rng = random.Random(3)
    shuffled = []
    for users in available:
        users = list(users) + users[:2]  # duplicates of one user collapse
        rng.shuffle(users)
        shuffled.append(users)
    first, second = run(a, available), run(b, shuffled)
    assert first == second
    assert sum(len(s.selected) for s in first) > 0
    assert run(SCHEMES[name](OTHER_KEY), available) != first  # the key decides


@pytest.mark.parametrize("name", list(SCHEMES))
def test_resume_through_json_reproduces_the_rest_of_the_run(name):
    available = _scenario()
    whole = SCHEMES[name]()
    reference = run(whole, available)
    part = SCHEMES[name]()
    run(part, available[:15])
    state = json.loads(json.dumps(part.state_dict()))
    resumed = SCHEMES[name]()
    resumed.load_state_dict(state)
    assert resumed.next_round == 15
    last = reference[14]
    assert all(resumed.is_selected(14, u) for u in last.selected)
    assert run(resumed, available, start=15) == reference[15:]
    assert resumed.state_dict() == whole.state_dict()


def test_state_is_plain_json_and_never_holds_the_key():
    def plain(x) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))

    for name, make in SCHEMES.items():
        s = make()
        if hasattr(s, "add_users"):
            s.add_users(range(30))
        run(s, _scenario(20))
        state = s.state_dict()
        assert plain(state), name
        text = json.dumps(state) + repr(s) + str(s.describe()) + str(s.__dict__)
        for form in (KEY.hex(), repr(KEY), KEY.decode("latin-1"), str(list(KEY))):
            assert form not in text, name


def test_a_scheduler_cannot_be_pickled_with_its_key():
    s = PoissonSampling(0.1, KEY)
    for copier in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="state_dict"):
            copier(s)


def test_bad_keys_are_refused_without_echoing_them():
    secret = "correct horse battery staple, 32b"
    for key, needle in ((secret, "str"), (b"short", "5 bytes"), (bytes(65), "65 bytes"), (None, "NoneType")):
        with pytest.raises(ConfigError, match=needle) as err:
            PoissonSampling(0.1, key)
        assert secret not in str(err.value)
    PoissonSampling(0.1, bytearray(16))
    PoissonSampling(0.1, bytes(64))


# ---------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------
def test_rounds_only_in_order():
    s = MinSepSelection(2, None, 2, KEY)
    for t in (1, -1, "0", 0.0, True):
        with pytest.raises(RoundOrderError):
            s.select(t, [1, 2, 3])
    sel = s.select(0, [1, 2, 3])
    with pytest.raises(RoundOrderError, match="round 1 next"):
        s.select(0, [1, 2, 3])
    assert s.next_round == 1
    assert all(s.is_selected(0, u) for u in sel.selected)
    assert not any(s.is_selected(0, u) for u in {1, 2, 3} - set(sel.selected))
    assert not s.is_selected(1, sel.selected[0]) and not s.is_selected(-1, sel.selected[0])
    assert s.is_selected(0, str(sel.selected[0]))  # identity is str(user)


def test_states_of_other_schemes_parameters_or_keys_are_refused():
    source = BMinSepPoisson(3, 0.3, KEY)
    source.add_users(range(20))
    run(source, _scenario(10))
    state = source.state_dict()
    for other in (CyclicPoisson(3, 0.3, KEY), BMinSepPoisson(3, 0.31, KEY), BMinSepPoisson(4, 0.3, KEY),
                  BMinSepPoisson(3, 0.3, KEY, warm_start=True), BMinSepPoisson(3, 0.3, KEY, max_participations=9),
                  BMinSepPoisson(3, 0.3, OTHER_KEY), PoissonSampling(0.3, KEY), MinSepSelection(3, None, 2, KEY)):
        with pytest.raises(PlanMismatch):
            other.load_state_dict(state)
    fixed = FixedEpochOrder(2, 3, range(10), KEY).state_dict()
    with pytest.raises(PlanMismatch):
        FixedEpochOrder(2, 3, [*range(9), "x"], KEY).load_state_dict(fixed)


def test_malformed_state_is_refused_and_leaves_the_scheduler_untouched():
    a, b = BMinSepPoisson(3, 0.3, KEY), BMinSepPoisson(3, 0.3, KEY)
    available = _scenario(20)
    run(a, available[:5])
    run(b, available[:5])
    good = a.state_dict()
    broken = [
        {**good, "count": good["count"][:-1]}, {**good, "last": ["0"] * len(good["users"])},
        {**good, "next_round": -1}, {**good, "format": 99}, "not a dict",
        {**good, "last": [good["next_round"]] * len(good["users"])}, {**good, "users": good["users"][:-1]},
    ]
    for state in broken:
        with pytest.raises(CheckpointError):
            b.load_state_dict(state)
    assert run(b, available, start=5) == run(a, available, start=5)


def test_two_users_with_one_id_are_refused():
    s = MinSepSelection(1, None, 2, KEY)
    with pytest.raises(ConfigError, match="'1'"):
        s.select(0, [1, "1"])
    for bad in ("abc", 5, None):
        with pytest.raises(ConfigError, match="collection"):
            s.select(0, bad)
    assert s.next_round == 0


@pytest.mark.parametrize("build", [
    lambda: MinSepSelection(0, None, 3, KEY), lambda: MinSepSelection(2, 0, 3, KEY),
    lambda: MinSepSelection(2, None, 0, KEY), lambda: MinSepSelection(2.0, None, 3, KEY),
    lambda: BMinSepPoisson(2, 0.0, KEY), lambda: BMinSepPoisson(2, 1.5, KEY),
    lambda: BMinSepPoisson(2, float("nan"), KEY), lambda: BMinSepPoisson(2, True, KEY),
    lambda: BMinSepPoisson(2, 0.1, KEY, warm_start="yes"), lambda: CyclicPoisson(0, 0.1, KEY),
    lambda: PoissonSampling("0.1", KEY), lambda: FixedEpochOrder(2, 3, [], KEY),
    lambda: FixedEpochOrder(2, 0, [1, 2], KEY),
])
def test_bad_parameters_are_config_errors(build):
    with pytest.raises(ConfigError):
        build()


# ---------------------------------------------------------------------------------------
# MinSep selection
# ---------------------------------------------------------------------------------------
def test_min_sep_never_violated_and_never_under_selects():
    b, k, m = 5, 6, 7
    users = list(range(40))
    available = availability(users, 300, 0.7, seed=4)
    s = MinSepSelection(b, k, m, KEY)
    history: dict[int, list[int]] = defaultdict(list)
    for t in range(300):
        sel = s.select(t, available[t])
        eligible = {u for u in available[t] if len(history[u]) < k and (not history[u] or t - history[u][-1] >= b)}
        assert set(sel.selected) <= eligible
        assert len(sel.selected) == min(m, len(eligible))
        assert sel.reachable == sel.selected and sel.unreachable == ()
        for u in sel.selected:
            history[u].append(t)
    schema = MinSep(b, k)
    assert all(schema.allows(r, 300) for r in history.values())
    assert max(len(r) for r in history.values()) == k  # the cap binds in this run


def test_min_sep_selection_is_a_uniform_subset():
    users, m, rounds = list(range(6)), 2, 3000
    s = MinSepSelection(1, None, m, KEY)
    counts = Counter(s.select(t, users).selected for t in range(rounds))
    subsets = list(itertools.combinations(users, m))
    expected = rounds / len(subsets)
    chi2 = sum((counts[c] - expected) ** 2 / expected for c in subsets)
    assert set(counts) == set(subsets)
    assert chi2 < 36.12  # chi-square, 14 degrees of freedom, upper 0.1% point


def test_min_sep_selection_is_uniform_among_eligible_users():
    """With b = 3 the eligible set changes every round; each eligible user is picked with
    probability m/|eligible| (brute-force eligibility, normalized frequency)."""
    b, m = 3, 4
    users = list(range(24))
    s = MinSepSelection(b, None, m, KEY)
    last: dict[int, int] = {}
    expected, observed = Counter(), Counter()
    for t in range(1500):
        eligible = [u for u in users if u not in last or t - last[u] >= b]
        sel = s.select(t, users)
        for u in eligible:
            expected[u] += m / len(eligible)
        for u in sel.selected:
            observed[u] += 1
            last[u] = t
    chi2 = sum((observed[u] - expected[u]) ** 2 / expected[u] for u in users)
    assert chi2 < 49.7  # 23 degrees of freedom, upper 0.1% point


# ---------------------------------------------------------------------------------------
# b-min-sep Poisson
# ---------------------------------------------------------------------------------------
def test_bminsep_warm_start_samples_at_the_stationary_rate_every_round():
    n_users, b, p = 4000, 4, 0.2
    p0 = p / (1 + (b - 1) * p)
    s = BMinSepPoisson(b, p, KEY, warm_start=True)
    s.add_users(range(n_users))
    assert s.expected_users(n_users) == pytest.approx(p0 * n_users, rel=1e-15)
    sd = math.sqrt(p0 * (1 - p0) / n_users)
    rates = [len(s.select(t, []).selected) / n_users for t in range(60)]
    assert all(abs(r - p0) < 5 * sd for r in rates)  # round 0 included: no cold-start transient
    assert abs(np.mean(rates) - p0) < 5 * sd / math.sqrt(60) * 2


def test_bminsep_cold_start_follows_the_transient_and_p_given_eligible():
    n_users, b, p, rounds = 4000, 4, 0.3, 40
    s = BMinSepPoisson(b, p, KEY)
    users = list(range(n_users))
    selections = run(s, [users] * rounds)
    u = cold_rates(p, b, rounds)
    for t, sel in enumerate(selections):
        assert abs(len(sel.selected) / n_users - u[t]) < 5 * math.sqrt(u[t] * (1 - u[t]) / n_users)
    # brute force: eligible (no selection in the previous b-1 rounds) user-rounds are heads w.p. p
    by_user = rounds_by_user(selections)
    trials = heads_count = 0
    for user in map(str, users):
        mine = set(by_user.get(user, []))
        for t in range(rounds):
            if not any(t - j in mine for j in range(1, b)):
                trials += 1
                heads_count += t in mine
            else:
                assert t not in mine  # never twice within b rounds
    assert abs(heads_count / trials - p) < 5 * math.sqrt(p * (1 - p) / trials)


def test_bminsep_dropouts_are_sampled_and_still_block():
    users = list(range(300))
    everyone = BMinSepPoisson(3, 0.4, KEY, max_participations=5)
    half = BMinSepPoisson(3, 0.4, KEY, max_participations=5)
    everyone.add_users(users)
    half.add_users(users)
    reachable_now = availability(users, 50, 0.5, seed=5)
    full = run(everyone, [users] * 50)
    partial = run(half, reachable_now)
    ids = [[tuple(map(str, s.selected)) for s in sels] for sels in (full, partial)]
    assert ids[0] == ids[1]  # availability never changes who is sampled
    for sel, avail in zip(partial, reachable_now):
        assert set(sel.reachable) == set(sel.selected) & set(avail)
        assert set(sel.unreachable) == {str(u) for u in set(sel.selected) - set(avail)}
    assert sum(len(s.unreachable) for s in partial) > 0
    schema = MinSep(3, 5)
    assert all(schema.allows(r, 50) for r in rounds_by_user(partial).values())
    assert max(map(len, rounds_by_user(partial).values())) == 5  # the cap binds, counting dropouts


def test_bminsep_late_joiners_follow_the_law_of_a_run_from_round_zero():
    """Users first seen at round t0 sample as if present since round 0 (selections before t0 are
    dropouts): their rate at round t is the cold-start u_t, not p."""
    b, p, t0, n_late = 4, 0.3, 5, 6000
    s = BMinSepPoisson(b, p, KEY)
    s.add_users(range(100))
    late = [f"late{i}" for i in range(n_late)]
    run(s, [[]] * t0)
    u = cold_rates(p, b, t0 + 12)
    late_rounds: dict[str, list[int]] = defaultdict(list)
    for t in range(t0, t0 + 12):
        sel = s.select(t, late)
        picked = [x for x in sel.selected if str(x).startswith("late")]
        for x in picked:
            late_rounds[x].append(t)
        assert abs(len(picked) / n_late - u[t]) < 5 * math.sqrt(u[t] * (1 - u[t]) / n_late)
    assert all(MinSep(b).allows(r, t0 + 12) for r in late_rounds.values())
    assert abs(u[t0] - p) > 10 * math.sqrt(p * (1 - p) / n_late)  # the test tells u_t from p


@pytest.mark.parametrize("warm", [False, True])
def test_bminsep_join_state_has_the_law_of_the_chain(warm):
    """A user joining at t0 is barred for s more rounds with P(s = j) = u_{t0−b+j} (selected at
    t0−(b−j)), P(s = 0) = 1 − Σ; warm start: the stationary π at every t0 (Alg. 2)."""
    b, p, t0, n_users = 4, 0.3, 5, 20000
    s = BMinSepPoisson(b, p, KEY, warm_start=warm)
    run(s, [[]] * t0)
    s.add_users(range(n_users))
    barred = np.asarray(s.state_dict()["last"]) - t0 + b
    if warm:
        law = np.array([1.0] + [p] * (b - 1)) / (1 + (b - 1) * p)
    else:
        u = cold_rates(p, b, t0)
        law = np.array([0.0] + [u[t0 - b + j] for j in range(1, b)])
        law[0] = 1 - law.sum()
    observed = np.bincount(barred, minlength=b)
    chi2 = float(np.sum((observed - n_users * law) ** 2 / (n_users * law)))
    assert observed.size == b and chi2 < 16.27  # 3 degrees of freedom, upper 0.1% point


def test_bminsep_warm_late_joiners_and_add_users_agree():
    a, b = BMinSepPoisson(4, 0.2, KEY, warm_start=True), BMinSepPoisson(4, 0.2, KEY, warm_start=True)
    run(a, [[1, 2]] * 3)
    run(b, [[1, 2]] * 3)
    new = [f"n{i}" for i in range(50)]
    assert a.add_users(new) == 50 and a.add_users(new) == 0
    assert a.population == b.population + 50
    assert [a.select(t, [1, 2]).selected for t in range(3, 10)] == [b.select(t, [1, 2, *new]).selected
                                                                    for t in range(3, 10)]


# ---------------------------------------------------------------------------------------
# cyclic Poisson, Poisson, fixed epoch
# ---------------------------------------------------------------------------------------
def test_cyclic_poisson_samples_only_the_active_group_at_rate_p():
    n_users, b, p, rounds = 3000, 4, 0.3, 40
    users = list(range(n_users))
    s = CyclicPoisson(b, p, KEY)
    s.add_users(users)
    group = {u: keyed_word(b"group", 0, u) % b for u in users}
    assert all(s.group_of(u) == group[u] for u in users[:50])
    sizes = Counter(group.values())
    total = 0
    for t in range(rounds):
        sel = s.select(t, users)
        assert all(group[u] == t % b for u in sel.selected)
        size = sizes[t % b]
        assert abs(len(sel.selected) / size - p) < 5 * math.sqrt(p * (1 - p) / size)
        total += len(sel.selected)
    assert abs(total / (rounds * n_users / b) - p) < 5 * math.sqrt(p * (1 - p) / (rounds * n_users / b))
    assert s.expected_users(n_users) == p * n_users / b


def test_poisson_samples_every_user_every_round():
    n_users, p, rounds = 3000, 0.1, 30
    s = PoissonSampling(p, KEY)
    selections = run(s, [list(range(n_users))] * rounds)
    total = sum(len(sel.selected) for sel in selections)
    assert abs(total / (rounds * n_users) - p) < 5 * math.sqrt(p * (1 - p) / (rounds * n_users))
    by_user = rounds_by_user(selections)
    assert any(j - i == 1 for r in by_user.values() for i, j in zip(r, r[1:]))  # no min-sep
    assert s.expected_users(n_users) == p * n_users


def test_caps_are_never_exceeded():
    for s in (CyclicPoisson(2, 1.0, KEY, max_participations=3), PoissonSampling(0.9, KEY, max_participations=3)):
        by_user = rounds_by_user(run(s, [list(range(20))] * 30))
        assert max(map(len, by_user.values())) == 3


def test_fixed_epoch_order_each_user_once_per_epoch_in_its_slot():
    b, k, population = 4, 3, list(range(23))
    s = FixedEpochOrder(b, k, population, KEY)
    strangers = ["x", "y"]
    available = availability(population, k * b, 0.8, seed=6)
    selections = [s.select(t, available[t] + strangers) for t in range(k * b)]
    by_user = rounds_by_user(selections)
    assert set(by_user) == {str(u) for u in population}
    for user, rounds in by_user.items():
        assert [t // b for t in rounds] == list(range(k))  # once per epoch
        assert len({t % b for t in rounds}) == 1 and rounds[0] % b == s.slot_of(int(user))
    sizes = sorted(len(selections[j].selected) for j in range(b))
    assert sizes == [5, 6, 6, 6]
    for sel, avail in zip(selections, available):
        assert set(sel.reachable) == set(sel.selected) & set(avail)
        assert set(sel.unreachable) == {str(u) for u in sel.selected if u not in avail}
    assert s.slot_of("x") is None
    with pytest.raises(HorizonReached):
        s.select(k * b, population)
    assert s.expected_users(23) == 23 / 4


def test_min_sep_expected_users_is_the_planned_count():
    assert MinSepSelection(3, None, 7, KEY).expected_users(1000) == 7.0
    with pytest.raises(ConfigError):
        MinSepSelection(3, None, 7, KEY).expected_users(-1)


# ---------------------------------------------------------------------------------------
# make_scheduler
# ---------------------------------------------------------------------------------------
def test_make_scheduler_builds_what_the_accountant_assumes():
    s = make_scheduler(MinSep(4), "none", key=KEY, users_per_round=5, rounds=18)
    assert isinstance(s, MinSepSelection) and s.describe()["max_participations"] == 5  # ceil(18/4)
    s = make_scheduler(MinSep(4, 3), None, key=KEY, users_per_round=5)
    assert s.describe() == {"scheme": "min-sep", "min_sep": 4, "max_participations": 3, "users_per_round": 5}
    s = make_scheduler(MinSep(4, 3), "bminsep:0.1:warm", key=KEY, population=range(10))
    assert isinstance(s, BMinSepPoisson) and s.population == 10
    assert s.describe() == {"scheme": "bminsep", "min_sep": 4, "probability": 0.1, "max_participations": 3,
                            "warm_start": True}
    s = make_scheduler(MinSep(4), "bminsep:0.1", key=KEY)
    assert not s.warm_start and s.max_participations is None
    s = make_scheduler(FixedEpoch(3, 4), "cyclic-poisson:0.2", key=KEY, rounds=12)
    assert isinstance(s, CyclicPoisson) and (s.min_sep, s.probability, s.max_participations) == (4, 0.2, 3)
    s = make_scheduler(FixedEpoch(3, 4), "none", key=KEY, population=range(9))
    assert isinstance(s, FixedEpochOrder) and s.describe()["epochs"] == 3 and s.population == 9
    s = make_scheduler(MinSep(1), "poisson:0.3", key=KEY, rounds=10)
    assert isinstance(s, PoissonSampling) and s.max_participations == 10


@pytest.mark.parametrize("schema, sampling, kwargs, match", [
    (MinSep(4), "none", {}, "users_per_round"),
    (FixedEpoch(3, 4), "none", {}, "population"),
    (FixedEpoch(3, 4), "bminsep:0.1", {}, "fixed-epoch"),
    (FixedEpoch(3, 4), "poisson:0.1", {}, "fixed-epoch"),
    (MinSep(4), "poisson:0.1", {}, "MinSep\\(1, n\\)"),
    (MinSep(4), "bminsep:0.1", {"users_per_round": 5}, "users_per_round"),
    (FixedEpoch(3, 4), "none", {"population": [1], "users_per_round": 5}, "users_per_round"),
    (MinSep(4), "bminsep", {}, "sampling"),
    (MinSep(4), "bminsep:2", {}, "probability"),
    (FixedEpoch(3, 4), "none", {"population": [1], "rounds": 13}, "rounds"),
    (MinSep(40), "bminsep:0.1", {"rounds": 13}, "exceeds"),
    ("min-sep", "none", {"users_per_round": 5}, "MinSep or FixedEpoch"),
])
def test_make_scheduler_refuses_combinations_that_make_no_sense(schema, sampling, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_scheduler(schema, sampling, key=KEY, **kwargs)
