"""Adaptive clipping against hostile and unlucky clients, and its accounting checked independently
(the privacy review of issue 25: docs/reviews/REVIEW-i25.md).

Tests headed "regression: review i25 bug N" reproduce a bug the review found and failed on the
reviewed code; they pass since the fix. The others check, against an independent computation, what
the review found correct (the review's scripts, folded in here).
"""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest
import torch
from scipy.stats import norm

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.participation import FixedEpoch
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.federated import train
from fedmf.run.round_log import ROUND_LOG
from tests import _federated_task as task

SEED = b"review-i25-seed-0123456789abcdef"


def _plan(rounds: int, m: int, *, clip_norm: float, eta: float = 0.2, sigma_b: float = 1.0,
          clip_norm_range: float = 1e6) -> RunPlan:
    # clip_norm_range: the range these tests were written for (the default became 10 in issue 33)
    schema = MinSep(1, rounds)
    return RunPlan.create(build("dp-sgd", rounds, schema, Workload()), schema, clip_norm=clip_norm, delta=1e-5,
                          expected_users=m, noise_multiplier=1.0,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=m, learning_rate=eta,
                                                                    count_noise_std=sigma_b,
                                                                    clip_norm_range=clip_norm_range))


# ---- independent accounting check (passes) ----------------------------------------------------------

def _gdp_delta(mu: float, eps: float) -> float:
    """Dong, Roth, Su (2022), the μ-GDP curve: δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def _gdp_epsilon(mu: float, delta: float) -> float:
    lo, hi = 0.0, 1.0
    while _gdp_delta(mu, hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _gdp_delta(mu, mid) > delta else (lo, mid)
    return hi


def _max_participations(schema, n: int) -> int:
    """k by brute force from the schema's definition (earliest packing / the fixed slots)."""
    if isinstance(schema, FixedEpoch):
        return max(min(len(range(j, n, schema.min_sep)), schema.max_participations) for j in range(schema.min_sep))
    t = count = 0
    while t < n and (schema.max_participations is None or count < schema.max_participations):
        count, t = count + 1, t + schema.min_sep
    return count


@pytest.mark.parametrize("schema", [MinSep(4, None), MinSep(5, 2), FixedEpoch(3, 8), FixedEpoch(1, 5)])
def test_the_schema_counts_the_participations_of_every_prefix(schema):
    """The count's k after t rounds (the per-round curve, the budgets) is the schema's own count, the
    brute-force maximum over the first t rounds (review i25 finding 9: FixedEpoch's prefix)."""
    n = 24 if isinstance(schema, MinSep) else schema.max_participations * schema.min_sep
    assert [schema.participations(t) for t in range(1, n + 1)] == [_max_participations(schema, t)
                                                                   for t in range(1, n + 1)]

@pytest.mark.parametrize("schema", [MinSep(4, None), MinSep(5, 10), FixedEpoch(3, 8)])
def test_composed_epsilon_and_rho_match_an_independent_gdp_computation(schema):
    n, z, sigma_b, delta = 24, 3.0, 2.0, 1e-6
    mech = build("bsr", n, schema, Workload(), num_bands=4)
    plan = RunPlan.create(mech, schema, clip_norm=1.0, delta=delta, expected_users=10, noise_multiplier=z,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=sigma_b))
    mu_sq = 1 / z**2 + _max_participations(schema, n) / sigma_b**2
    assert plan.epsilon() == pytest.approx(_gdp_epsilon(math.sqrt(mu_sq), delta), rel=1e-8)
    assert plan.rho() == pytest.approx(mu_sq / 2, rel=1e-12)



@pytest.mark.parametrize("schema", [MinSep(4, None), FixedEpoch(3, 8)])
@pytest.mark.parametrize("target", [2.0, 8.0])
def test_calibration_with_the_count_meets_the_target_by_an_independent_gdp_computation(schema, target):
    """Calibrated to a target ε with the count composed in: the composed ε (own GDP curve) is the target,
    and the MF mechanism alone spends strictly less."""
    n, sigma_b, delta = 24, 10.0, 1e-6
    mech = build("bsr", n, schema, Workload(), num_bands=4)
    plan = RunPlan.create(mech, schema, clip_norm=1.0, delta=delta, expected_users=10, target_epsilon=target,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=sigma_b))
    mu = math.sqrt(1 / plan.noise_multiplier**2 + _max_participations(schema, n) / sigma_b**2)
    assert target * (1 - 1e-6) <= _gdp_epsilon(mu, delta) <= target * (1 + 1e-9)
    assert _gdp_epsilon(1 / plan.noise_multiplier, delta) < target

# ---- BUG 1: the raw count is released beside the noisy one ------------------------------------------

# regression: review i25 bug 1 (fixed)
def test_released_round_records_do_not_reveal_the_raw_unclipped_count(tmp_path):
    """Without ledger diagnostics no released record (history, metrics, rounds.jsonl) carries the exact
    clipped / zeroed counts, which would undo the count's noise; with them (outside the guarantee,
    opted into) the history carries the ledger's own count."""
    import json

    plan = task.plan(adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10, learning_rate=0.5))
    for diagnostics in (False, True):
        run = tmp_path / f"run{int(diagnostics)}"
        task.write_secrets(run)
        result = train(task.Tiny(), task.users(), plan, task.local_update, checkpoint_dir=run, rounds=6,
                       ledger_diagnostics=diagnostics)
        logged = [json.loads(line)["record"] for line in (run / ROUND_LOG).read_text().splitlines()]
        records = [{"clipped": r.clipped, "zeroed": r.zeroed, "metrics": r.metrics} for r in result.history] + logged
        assert len(records) == 12
        if not diagnostics:
            assert all(r["clipped"] is None and r["zeroed"] is None for r in records)
            assert not any(k in r["metrics"] for r in records for k in ("clipped", "zeroed", "unclipped"))
        else:
            with sqlite3.connect(run / "ledger.db") as conn:
                raw = dict(conn.execute("SELECT round_index, SUM(clipped) FROM update_norms GROUP BY round_index"))
            assert [r.clipped for r in result.history] == [raw[t] for t in range(6)]


# ---- BUG 2: zeroed updates count as "unclipped" ------------------------------------------------------

# regression: review i25 bug 2 (fixed)
def test_a_zeroed_update_is_not_counted_as_fitting_under_zeta():
    plan = _plan(2, 10, clip_norm=1.0, sigma_b=1e-9)  # negligible count noise: the count is exact
    privatizer = RoundPrivatizer(plan, {"w": (4,)}, dtype=torch.float64, seed=SEED)
    huge = {"w": torch.tensor([1e6, 0.0, 0.0, 0.0], dtype=torch.float64)}  # ℓ∞ = 1e6 > 100·ζ: zeroed
    _, report = privatizer.privatize(0, {"u0": huge})
    assert report.counts()["zeroed"] == 1
    assert report.noisy_unclipped == pytest.approx(0.0, abs=1e-6)


# regression: review i25 bug 2 (fixed)
def test_honest_clients_pull_a_too_small_initial_zeta_up_to_the_median():
    rounds, m, d = 100, 20, 100
    plan = _plan(rounds, m, clip_norm=1e-3)
    privatizer = RoundPrivatizer(plan, {"w": (d,)}, dtype=torch.float32, seed=SEED)
    rng = np.random.default_rng(0)
    for t in range(rounds):
        updates = {}
        for i in range(m):  # norms log-normal with median 1 (ℓ∞ ≈ 0.3)
            v = rng.standard_normal(d)
            updates[f"u{i:02d}"] = {"w": torch.tensor(v / np.linalg.norm(v) * math.exp(0.3 * rng.standard_normal()),
                                                      dtype=torch.float32)}
        privatizer.privatize(t, updates)
    # ζ grows by at most exp(η·γ) = e^0.1 a round: 1e-3 → ≈ 1 takes ≈ 70 rounds (ζ₀ = 0.01 reaches 1.03 in 60)
    assert 0.5 < privatizer.clip_norm < 2.0


# ---- BUG 3: ζ has no floor or ceiling ----------------------------------------------------------------

def _huge(d: int) -> dict[str, torch.Tensor]:
    v = torch.zeros(d)
    v[0] = 1e30
    return {"w": v}


# regression: review i25 bug 3 (fixed)
def test_hostile_clients_cannot_drive_zeta_to_zero_and_break_resume():
    rounds, m = 40, 10
    plan = _plan(rounds, m, clip_norm=1e-300, eta=5.0)  # a tiny ζ₀ only shortens the walk down
    privatizer = RoundPrivatizer(plan, {"w": (8,)}, dtype=torch.float32, seed=SEED)
    for t in range(rounds):
        privatizer.privatize(t, {f"u{i}": _huge(8) for i in range(m)})
        assert privatizer.clip_norm > 0.0
    fresh = RoundPrivatizer(plan, {"w": (8,)}, dtype=torch.float32, seed=SEED)
    fresh.load_state_dict(privatizer.state_dict())


# regression: review i25 bug 3 (fixed)
def test_hostile_clients_cannot_drive_zeta_past_the_model_dtype():
    rounds, m, d = 40, 10, 1000
    plan = _plan(rounds, m, clip_norm=1e30, eta=5.0)  # a large ζ₀ only shortens the walk up
    privatizer = RoundPrivatizer(plan, {"w": (d,)}, dtype=torch.float32, seed=SEED)
    for t in range(rounds):
        value = min(2 * privatizer.clip_norm / math.sqrt(d), 3e38)  # ‖·‖₂ = 2ζ, ℓ∞ ≪ 100ζ: clipped, not zeroed
        mean, _ = privatizer.privatize(t, {f"u{i}": {"w": torch.full((d,), value)} for i in range(m)})
        assert bool(torch.isfinite(mean["w"]).all()), (t, privatizer.clip_norm)


# ---- BUG 4 (pre-existing, found by the attack): a client's update crashes the server ---------------

# regression: review i25 bug 4 (fixed)
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_finite_float64_update_whose_square_overflows_is_zeroed_or_rejected_not_a_crash(adaptive):
    schema = MinSep(1, 2)
    plan = RunPlan.create(build("dp-sgd", 2, schema, Workload()), schema, clip_norm=1.0, delta=1e-5,
                          expected_users=1, noise_multiplier=1.0,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=1) if adaptive else None)
    layout = {"weight": (256,), "bias": (1,)}  # Linear(256, 1): 257 values, a tail of one
    privatizer = RoundPrivatizer(plan, layout, dtype=torch.float64, seed=SEED)
    update = {"weight": torch.zeros(256, dtype=torch.float64), "bias": torch.tensor([1e300], dtype=torch.float64)}
    mean, report = privatizer.privatize(0, {"u0": update})
    assert report.users[0].zeroed or report.users[0].status == "rejected"
    assert all(bool(torch.isfinite(v).all()) for v in mean.values())


# ---- sensitivity of the normalized sum at extreme ζ (review i25 finding 6) ---------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_each_normalized_contribution_has_norm_at_most_one_at_any_zeta(dtype):
    """One participation adds norm ≤ 1 to the normalized sum whatever ζ (1e-300 … 1e300), the model's
    dtype and size, dense or one spike, at the boundary and far from it; no finite update crashes."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for zeta in (1e-300, 1e-40, 1e-8, 1.0, 1e30, 1e38, 1e300):
        schema = MinSep(1, 2)
        plan = RunPlan.create(build("dp-sgd", 2, schema, Workload()), schema, clip_norm=zeta, delta=1e-5,
                              expected_users=1, noise_multiplier=1.0,
                              adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=1))
        for d in (3, 257, 5000):
            privatizer = RoundPrivatizer(plan, {"w": (d,)}, dtype=dtype, seed=SEED)
            for scale in (0.0, 1e-45, 1e-38, zeta * (1 - 1e-7), zeta, zeta * (1 + 1e-7), 1e20, 3e38):
                for spike in (False, True):
                    if spike:
                        v = torch.zeros(d, dtype=torch.float64)
                        v[d // 2] = scale
                    else:
                        v = torch.from_numpy(rng.standard_normal(d))
                        v = v / v.norm() * scale
                    v = v.to(dtype)
                    if not bool(torch.isfinite(v).all()):
                        continue
                    privatizer.begin(0)
                    privatizer.add("u", {"w": v})
                    norm_ = float(torch.linalg.vector_norm(privatizer._sum.double()))
                    assert math.isfinite(norm_) and norm_ <= 1.0, (zeta, d, scale, spike, norm_)
                    worst = max(worst, norm_)
                    privatizer.abort()
    assert worst > 0.99  # the sweep reaches the boundary (a sum left at zero must not pass vacuously)
