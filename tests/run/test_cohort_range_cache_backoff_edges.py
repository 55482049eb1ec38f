"""Independent review of issue 33's privacy-adjacent changes (docs/reviews/REVIEW-i33-cohort-adaptive-cache.md):
the minimum cohort, adaptive clipping's range, the on-disk calibration cache, the TRAIN backoff's schedule."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from fedmf import FixedEpoch, MinSep, Workload
from fedmf.accounting import disk_cache, gaussian
from fedmf.errors import PlanMismatch
from fedmf.ledger import Ledger
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.run.federated import train
from fedmf.schedule import BMinSepPoisson, CyclicPoisson, FixedEpochOrder, MinSepSelection, PoissonSampling
from tests import _federated_task as task

USERS = [f"u{i:02d}" for i in range(8)]
ROUNDS = 6


# ---- 1. the minimum cohort -----------------------------------------------------------------------------
def _allowed(history: dict, t: int, b: int, k: int | None, users) -> int:
    """MinSep(b, k) eligibility, re-implemented from the schema's definition."""
    return sum(1 for u in users
               if not history.get(u) or (t - history[u][-1] >= b and (k is None or len(history[u]) < k)))


def test_eligible_decides_nothing_and_counts_what_the_round_can_select():
    rng = random.Random(7)
    for _ in range(60):
        n, b, k, m = rng.randint(1, 10), rng.randint(1, 4), rng.choice([None, 1, 2]), rng.randint(1, 4)
        key = bytes(rng.randrange(256) for _ in range(32))
        users = [f"u{i}" for i in range(n)]
        asked, plain, history = MinSepSelection(b, k, m, key), MinSepSelection(b, k, m, key), {}
        for t in range(8):
            available = [u for u in users if rng.random() < 0.7]
            for _ in range(2):  # probes with other sets and rounds change nothing
                asked.eligible(rng.choice([t, t + 3]), [u for u in users if rng.random() < 0.5] + ["ghost"])
            eligible = asked.eligible(t, available)
            assert eligible == _allowed(history, t, b, k, available)
            got, want = asked.select(t, available), plain.select(t, available)
            assert got == want and asked.state_dict() == plain.state_dict()
            assert len(got.selected) == min(m, eligible)  # eligible >= m: a full round of m
            for u in got.selected:
                history.setdefault(u, []).append(t)
        b, epochs = rng.randint(1, 3), rng.randint(1, 3)
        asked, plain = FixedEpochOrder(b, epochs, users, key), FixedEpochOrder(b, epochs, users, key)
        for t in range(b * epochs):
            available = [u for u in users if rng.random() < 0.6]
            asked.eligible(rng.randrange(b * epochs), users)
            eligible = asked.eligible(t, available)
            got, want = asked.select(t, available), plain.select(t, available)
            assert got == want and asked.state_dict() == plain.state_dict()
            assert len(got.reachable) == eligible
        assert asked.eligible(b * epochs, users) is None


def _plan(schema, *, adaptive: bool) -> RunPlan:
    mech = build("bsr", ROUNDS, schema, Workload(momentum=0.0), num_bands=schema.min_sep)
    rule = AdaptiveClipping.create(0.5, expected_users=3, count_noise_std=1.0) if adaptive else None
    m = 3 if isinstance(schema, MinSep) else len(USERS) / schema.min_sep
    return RunPlan.create(mech, schema, clip_norm=0.05, delta=1e-5, expected_users=m, noise_multiplier=0.7,
                          adaptive_clipping=rule)


def _update(params, user, t):
    g = torch.Generator().manual_seed(int(user[1:]) * 100 + t)
    return {name: 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for name, p in params.items()}


def _participants(url, directory, run_id, t) -> set[str]:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from fedmf.ledger.models import Participation

    secret = (directory / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(url, secret=secret) as book:
        run = book.run(run_id)
        with Session(book.engine) as session:
            keys = {bytes(k) for k in session.scalars(select(Participation.client_key).where(
                Participation.run_id == run_id, Participation.round_index == t))}
        return {u for u in USERS if run.key(u) in keys}


def _rows(url, directory, run_id):
    secret = (directory / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(url, secret=secret) as book:
        run = book.run(run_id)
        out = []
        for t in range(ROUNDS):
            r = run.round(t)
            out.append((r.status, r.selected, r.contributed, r.dropped, r.noise_std, r.epsilon_planned))
        return out


@pytest.mark.parametrize("schema", [MinSep(2, None), FixedEpoch(2, 3)], ids=["min-sep", "fixed-epoch"])
def test_a_cohort_stop_then_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path, schema):
    """Round 3 is refused (min-sep: 2 of the 3 needed users connected; FixedEpoch(k=2, b=3): nobody of the slot);
    resumed with everyone back, the run's models, ζ trajectory and ledger equal those of a run that never
    stopped: the refused round consumed no scheduler state, no noise, no ledger row, no count noise."""
    plan = _plan(schema, adaptive=isinstance(schema, MinSep))
    fixed = isinstance(schema, FixedEpoch)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    task.write_secrets(a_dir, b"review-i33")
    task.write_secrets(b_dir, b"review-i33")
    model_a = task.Tiny()
    a = train(model_a, USERS, plan, _update, checkpoint_dir=a_dir, repeatable_noise=True, witness=tmp_path / "wa")
    # round 3's users in the uninterrupted run (fixed-epoch: its whole slot)
    slot = _participants(a.ledger, a_dir, a.run_id, 3)
    assert len(slot) in ((2, 3) if fixed else (3,))  # fixed-epoch: 8 users in 3 slots

    def few(t):
        if t != 3:
            return USERS
        return [u for u in USERS if u not in slot] if fixed else USERS[:2]

    model_b = task.Tiny()
    stopped = train(model_b, USERS, plan, _update, checkpoint_dir=b_dir, repeatable_noise=True, available=few,
                    witness=tmp_path / "wb")
    assert stopped.rounds_done == 3 and stopped.stopped.startswith("cohort: round 3 (3/6 done) not played")
    assert [r[0] for r in _rows(stopped.ledger, b_dir, stopped.run_id)] == ["committed"] * 3 + ["planned"] * 3
    model_b = task.Tiny()
    b = train(model_b, USERS, plan, _update, checkpoint_dir=b_dir, repeatable_noise=True, witness=tmp_path / "wb")
    assert (a.stopped, a.rounds_done, b.rounds_done) == ("horizon", ROUNDS, ROUNDS)
    assert _rows(a.ledger, a_dir, a.run_id) == _rows(b.ledger, b_dir, b.run_id)
    assert [r.metrics for r in a.history[3:]] == [r.metrics for r in b.history]  # ζₜ and b̃ₜ too
    for (name, pa), (_, pb) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(pa, pb), name


# ---- 2. adaptive clipping's range ------------------------------------------------------------------------
def test_the_clamped_rule_is_a_function_of_released_values_only():
    rng = random.Random(3)
    for _ in range(2000):
        R = rng.choice([1.0, 2.0, 10.0, 1e6])
        rule = AdaptiveClipping.create(rng.uniform(0.05, 0.95), expected_users=10,
                                       learning_rate=rng.uniform(0.01, 3), count_noise_std=1.0, clip_norm_range=R)
        z0 = 10 ** rng.uniform(-3, 3)
        zeta = min(max(z0 * 10 ** rng.uniform(-7, 7), z0 / R), z0 * R)
        noisy = rng.choice([rng.uniform(-1e6, 1e6), rng.gauss(5, 3), 0.0])
        m = rng.uniform(0.5, 200)
        step = min(max(-rule.learning_rate * (noisy / m - rule.target_quantile), -30.0), 30.0)
        want = min(max(zeta * math.exp(step), z0 / R), z0 * R)
        got = rule.next_clip_norm(zeta, noisy, m, initial_clip_norm=z0)
        assert got == want and z0 / R <= got <= z0 * R and math.isfinite(got)


def test_the_range_is_bound_by_the_fingerprint_and_leaves_the_accounting_unchanged():
    schema = MinSep(2, None)
    mech = build("bsr", ROUNDS, schema, Workload(momentum=0.0), num_bands=2)
    plans = {R: RunPlan.create(mech, schema, clip_norm=0.1, delta=1e-5, expected_users=3, target_epsilon=2.0,
                               adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=3, count_noise_std=20.0,
                                                                                 clip_norm_range=R))
             for R in (2.0, 10.0, 1e6)}
    assert len({p.fingerprint for p in plans.values()}) == 3
    z = {p.noise_multiplier for p in plans.values()}
    eps = {p.epsilon() for p in plans.values()}
    assert len(z) == 1 and len(eps) == 1
    with pytest.raises(PlanMismatch):
        plans[2.0].check_fingerprint(plans[10.0].fingerprint, "review")


# ---- 3. the on-disk calibration cache ---------------------------------------------------------------------
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDMF_CACHE_DIR", str(tmp_path / "cache"))
    gaussian._calibrate_cached.cache_clear()


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_no_cache_entry_lowers_the_noise(monkeypatch, tmp_path, accountant):
    eps, delta = 1.3, 1e-6
    _fresh(monkeypatch, tmp_path)
    true = gaussian.calibrate(eps, delta, accountant)
    key = {"epsilon": eps, "delta": delta, "accountant": accountant}
    full = disk_cache._full_key("gaussian-calibrate", key)
    path = disk_cache._path(tmp_path / "cache", full)
    assert path.exists() and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"
    hostile = [true * (1 - 1e-9), true * (1 - 1e-3), true / 2, 0.0, -true, float("nan"), float("inf"), "1e-3",
               None, [true], True, 1e-320, true * (1 + 1e-3), 1e300]
    for value in hostile:
        path.write_text(json.dumps({"key": full, "value": value}))
        gaussian._calibrate_cached.cache_clear()
        got = gaussian.calibrate(eps, delta, accountant)
        assert gaussian.meets(got, eps, delta, accountant), value
        assert got >= true * (1 - 1e-12), (value, got, true)
        assert got <= true * (1 + 1.01e-6), (value, got, true)  # never more than MINIMAL_REL above
    # an entry stored for other inputs (δ, ε, accountant, dp_accounting version) is not used for these
    for other in ({**full, "delta": 1e-3}, {**full, "epsilon": 5.0}, {**full, "dp_accounting": "0.0.0"}):
        path.write_text(json.dumps({"key": other, "value": true / 3}))
        gaussian._calibrate_cached.cache_clear()
        assert gaussian.calibrate(eps, delta, accountant) >= true * (1 - 1e-12)
    path.unlink()
    os.symlink(tmp_path / "nowhere", path)  # a dangling link: ignored, no crash
    gaussian._calibrate_cached.cache_clear()
    assert gaussian.calibrate(eps, delta, accountant) == pytest.approx(true, rel=1e-9)


def test_a_planted_entry_never_hangs_the_calibration(monkeypatch, tmp_path):
    """Review finding L-2 (fixed): an entry replaced by a link to /dev/zero, a FIFO or a huge file was
    read whole (``read_text``: an endless read, a blocked open); now it is no entry, at once."""
    import signal

    eps, delta = 0.9, 1e-7
    _fresh(monkeypatch, tmp_path)
    true = gaussian.calibrate(eps, delta)
    path = disk_cache._path(tmp_path / "cache", disk_cache._full_key(
        "gaussian-calibrate", {"epsilon": eps, "delta": delta, "accountant": "pld"}))

    def planted_link(p):
        os.symlink("/dev/zero", p)

    def planted_fifo(p):
        os.mkfifo(p)

    def planted_huge(p):
        p.write_text(json.dumps({"key": "x" * (disk_cache.MAX_ENTRY_BYTES + 1), "value": true / 2}))

    class Hung(BaseException):  # not an OSError: load() must not swallow it
        pass

    def hung(*_):
        raise Hung("the cache read hung on a planted entry")

    previous = signal.signal(signal.SIGALRM, hung)
    try:
        for plant in (planted_fifo, planted_huge, planted_link):  # the link last: unfixed, it reads /dev/zero
            path.unlink()
            plant(path)
            gaussian._calibrate_cached.cache_clear()
            signal.alarm(10)
            assert disk_cache.load("gaussian-calibrate", {"epsilon": eps, "delta": delta, "accountant": "pld"}) is None
            assert gaussian.calibrate(eps, delta) == true
            signal.alarm(0)
            assert path.is_file() and not path.is_symlink()  # the search's store replaced the planted entry
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_closed_form_check_agrees_with_dp_accounting_at_the_accepted_edge():
    """The smallest z the pld check accepts (bisected on the closed form) is the calibration up to float
    rounding: at most 1e-12 below the searched z, its δ on dp_accounting's own curve at most 1e-12 above δ
    (review finding I-1: the closed form and dp_accounting round the same formula differently, so an edited
    entry can undercut the search by ~1e-13 relative — e.g. ε 8, δ 1e-9 — never by more)."""
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    for eps, delta in [(0.5, 1e-5), (1.3, 1e-6), (8.0, 1e-9), (0.05, 1e-3), (20.0, 1e-12)]:
        lo, hi = 1e-3, 1e3
        for _ in range(300):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if gaussian.delta_for_epsilon(mid, eps) <= delta else (mid, hi)
        assert gaussian._verified(hi, eps, delta, "pld") and not gaussian._verified(lo, eps, delta, "pld")
        assert hi >= gaussian.calibrate(eps, delta, "pld") * (1 - 1e-12)
        assert GaussianPrivacyLoss(hi, sensitivity=1.0).get_delta_for_epsilon(eps) <= delta * (1 + 1e-12)


# ---- 4. the TRAIN backoff and the amplified samplers -------------------------------------------------------
@pytest.mark.parametrize("make", [lambda key: PoissonSampling(0.4, key), lambda key: CyclicPoisson(2, 0.6, key),
                                  lambda key: BMinSepPoisson(2, 0.6, key)], ids=["poisson", "cyclic-poisson", "bminsep"])
def test_an_amplified_sampler_samples_a_backing_off_user_as_a_dropout(make):
    """Availability changes only who is reachable: the amplified samplers draw from the whole population,
    and a drawn user who is not available (backing off) is a dropout, recorded as selected."""
    key = bytes(range(32))
    population = [f"u{i}" for i in range(30)]
    full, some = make(key), make(key)
    full.add_users(population)
    some.add_users(population)
    drawn = 0
    for t in range(10):
        a = full.select(t, population)
        b = some.select(t, population[::2])  # every other user backing off
        assert a.selected == b.selected and full.state_dict() == some.state_dict()
        assert set(b.unreachable) == {u for u in a.selected if u not in population[::2]}
        drawn += len(a.selected)
    assert drawn > 0


def test_a_non_finite_stop_leaves_the_ledger_exact_and_a_resume_releases_nothing(tmp_path):
    """A model that is not finite after round 0 (here an initial model with a NaN weight) stops the run:
    round 0 is committed and accounted as planned, no later round exists in the ledger, and a resume plays
    nothing."""
    plan = _plan(MinSep(2, None), adaptive=False)
    directory = tmp_path / "nan"
    task.write_secrets(directory, b"review-i33-nan")
    model = task.Tiny()
    with torch.no_grad():
        model.linear.bias[0] = float("nan")
    first = train(model, USERS, plan, _update, checkpoint_dir=directory, repeatable_noise=True)
    assert first.rounds_done == 1 and "not finite" in first.stopped, first.stopped
    rows = _rows(first.ledger, directory, first.run_id)
    assert [r[0] for r in rows] == ["committed"] + ["planned"] * (ROUNDS - 1)
    assert rows[0][5] == plan.epsilon_after(0) and rows[0][1] == 3
    again = train(task.Tiny(), USERS, plan, _update, checkpoint_dir=directory, repeatable_noise=True)
    assert again.rounds_done == 1 and "not finite" in again.stopped and again.history == []
    assert _rows(again.ledger, directory, again.run_id) == rows
    assert _participants(first.ledger, directory, first.run_id, 1) == set()


def test_a_server_lr_the_model_dtype_cannot_hold_is_refused_in_one_line(tmp_path):
    from fedmf.errors import ConfigError

    directory = tmp_path / "lr"
    task.write_secrets(directory, b"review-i33-lr")
    with pytest.raises(ConfigError, match="server learning rate .* does not fit the model's torch.float32"):
        train(task.Tiny(), USERS, _plan(MinSep(2, None), adaptive=False), _update, checkpoint_dir=directory,
              repeatable_noise=True, server_lr=1e45)
    # refused before anything was bound to that rate: the same directory takes a sane one
    again = train(task.Tiny(), USERS, _plan(MinSep(2, None), adaptive=False), _update, checkpoint_dir=directory,
                  repeatable_noise=True, server_lr=1.0)
    assert again.rounds_done == ROUNDS
