"""Adaptive clipping's count release composed with the MF mechanism (fedmf.accounting.count_release),
ρ-zCDP beside ε, and δ down to 1e-12, each against an independent computation: the analytic Gaussian
(Balle & Wang 2018, Thm 8) in mpmath at μ = √(1/z² + k/σ_b²), and dp_accounting composing the
separate Gaussian events (PLD and RDP); cyclic Poisson: dp_accounting PLD of per-step events built here."""

from __future__ import annotations

import math

import dp_accounting
import mpmath
import numpy as np
import pytest

from fedmf import MinSep
from fedmf.accounting import calibrate, cyclic_poisson, epsilon, epsilon_by_round
from fedmf.accounting.posthoc import account_observed
from fedmf.accounting.run_privacy import run_privacy
from fedmf.errors import ConfigError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping

SCHEMA = MinSep(8, 4)  # k = 4 participations in n = 64 rounds
CYCLIC = MinSep(16, 4)


@pytest.fixture(scope="module")
def bsr():
    return build("bsr", 64, SCHEMA, num_bands=8)


def analytic_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of μ-GDP, from δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ) (Balle & Wang 2018, Thm 8), in
    50-digit arithmetic with its own bisection: independent of fedmf.accounting.gaussian."""
    mpmath.mp.dps = 50
    mu = mpmath.mpf(mu)

    def delta_of(eps):
        return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)

    lo, hi = mpmath.mpf(0), mpmath.mpf(1)
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return float(hi)


def rdp_of(events, delta: float) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.ComposedDpEvent(list(events)))
    return float(acc.get_epsilon(delta))


def check_cyclic(ours: float, step, steps: int, delta: float) -> None:
    """``ours`` against dp_accounting on the step event built by the test: its self-composition (the
    accountant's path: to 1e-9 at δ = 1e-6; at δ ≤ 1e-10 a one-ulp change of the multiplier moves the
    PLD's ε by up to ~1e-5 relative, measured), the step-by-step composition (another FFT path: at
    δ ≤ 1e-10 the two differ by up to ~2e-4 relative, measured) and the RDP upper bound."""
    rel = 1e-9 if delta >= 1e-6 else 1e-4
    assert ours == pytest.approx(pld_of([dp_accounting.SelfComposedDpEvent(step, steps)], delta), rel=rel)
    assert ours == pytest.approx(pld_of([step] * steps, delta), rel=1e-3)
    assert ours < rdp_of([step] * steps, delta)


def pld_of(events, delta: float, discretization: float = 1e-4) -> float:
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=discretization)
    for event in events:
        acc.compose(event)
    return float(acc.get_epsilon(delta))


# ---- un-amplified: 1/z_eff² = 1/z² + k/σ_b² --------------------------------------------------------
@pytest.mark.parametrize("z,sigma_b,delta", [(1.0, 5.0, 1e-6), (0.8, 2.0, 1e-10), (2.5, 10.0, 1e-12)])
def test_unamplified_count_composition_is_the_analytic_gaussian(bsr, z, sigma_b, delta):
    result = epsilon(bsr, z, delta, SCHEMA, count_noise_std=sigma_b)
    mu = math.sqrt(1 / z**2 + 4 / sigma_b**2)
    assert result.epsilon == pytest.approx(analytic_epsilon(mu, delta), rel=1e-9)
    assert result.details["count_participations"] == 4
    assert result.details["effective_noise_multiplier"] == pytest.approx(1 / mu, rel=1e-14)
    # the split of μ² between the MF mechanism and the count
    split = result.details["privacy_split"]
    assert split["count"] == pytest.approx((4 / sigma_b**2) / mu**2, rel=1e-12)
    assert split["mf"] + split["count"] == pytest.approx(1.0, rel=1e-15)
    # ρ-zCDP: 1/(2z²) for the MF Gaussian plus k·1/(2σ_b²) for the counts (zCDP composition adds)
    assert result.rho == pytest.approx(0.5 / z**2 + 4 * 0.5 / sigma_b**2, rel=1e-12)


def test_unamplified_composition_matches_dp_accounting_of_the_separate_events(bsr):
    z, sigma_b, delta = 1.2, 4.0, 1e-8
    events = [dp_accounting.GaussianDpEvent(z)] + [dp_accounting.GaussianDpEvent(sigma_b)] * 4
    ours = epsilon(bsr, z, delta, SCHEMA, count_noise_std=sigma_b).epsilon
    assert ours == pytest.approx(pld_of(events, delta), rel=2e-3)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.ComposedDpEvent(events))
    ours_rdp = epsilon(bsr, z, delta, SCHEMA, count_noise_std=sigma_b, accountant="rdp").epsilon
    assert ours_rdp == pytest.approx(float(rdp.get_epsilon(delta)), rel=1e-9)  # RDP of Gaussians adds exactly
    assert ours < ours_rdp


def test_calibration_inverts_epsilon_with_the_count(bsr):
    for target, sigma_b, delta in ((2.0, 5.0, 1e-6), (1.0, 20.0, 1e-12)):
        result = calibrate(bsr, target, delta, SCHEMA, count_noise_std=sigma_b)
        spent = epsilon(bsr, result.noise_multiplier, delta, SCHEMA, count_noise_std=sigma_b).epsilon
        assert spent <= target and spent == pytest.approx(target, rel=1e-9)
        # more noise than without the count, since the count spends part of the budget
        assert result.noise_multiplier > calibrate(bsr, target, delta, SCHEMA).noise_multiplier


def test_huge_count_noise_recovers_the_non_adaptive_epsilon(bsr):
    plain = epsilon(bsr, 1.3, 1e-6, SCHEMA)
    for sigma_b in (1e12, 1e300):
        assert epsilon(bsr, 1.3, 1e-6, SCHEMA, count_noise_std=sigma_b).epsilon == pytest.approx(plain.epsilon,
                                                                                                rel=1e-12)
    assert epsilon(bsr, 1.3, 1e-6, SCHEMA, count_noise_std=1e300).epsilon == plain.epsilon
    assert calibrate(bsr, 3.0, 1e-6, SCHEMA, count_noise_std=1e300).noise_multiplier == \
        calibrate(bsr, 3.0, 1e-6, SCHEMA).noise_multiplier


def test_per_round_curve_composes_the_counts_so_far(bsr):
    z, sigma_b, delta = 1.0, 3.0, 1e-6
    curve = epsilon_by_round(bsr, z, delta, SCHEMA, count_noise_std=sigma_b)
    plain = epsilon_by_round(bsr, z, delta, SCHEMA)
    assert np.all(np.diff(curve.epsilons) >= 0) and np.all(curve.epsilons > plain.epsilons)
    assert curve.epsilons[-1] == epsilon(bsr, z, delta, SCHEMA, count_noise_std=sigma_b).epsilon
    # round 1: one participation, one column of C, one count
    col0 = float(np.linalg.norm(bsr.strategy_matrix()[:1, 0]))
    std = z * bsr.sensitivity(SCHEMA).value
    mu1 = math.sqrt(col0**2 / std**2 + 1 / sigma_b**2)
    assert curve.epsilons[0] == pytest.approx(analytic_epsilon(mu1, delta), rel=1e-9)
    assert curve.rhos[0] == pytest.approx(mu1**2 / 2, rel=1e-12)
    assert curve.rhos[-1] == pytest.approx(0.5 / z**2 + 2 / sigma_b**2, rel=1e-12)


# ---- cyclic Poisson: per step 1/z_step² = col²/σ_u² + 1/σ_b² ------------------------------------------
@pytest.mark.parametrize("delta", [pytest.param(1e-6, marks=pytest.mark.heavy),
                                   pytest.param(1e-10, marks=pytest.mark.heavy), 1e-12])
def test_cyclic_poisson_composes_the_count_per_step(bsr, delta):
    z, sigma_b, q = 1.0, 5.0, 0.25
    result = epsilon(bsr, z, delta, CYCLIC, sampling=f"cyclic-poisson:{q}", count_noise_std=sigma_b)
    c = bsr.strategy_matrix()
    col = float(np.sqrt((c**2).sum(axis=0)).max())
    std = z * bsr.sensitivity(CYCLIC).value
    z_step = 1 / math.sqrt(col**2 / std**2 + 1 / sigma_b**2)
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z_step))
    check_cyclic(result.epsilon, step, 4, delta)
    assert result.rho is None and "amplified" in result.details["rho_note"]
    assert result.epsilon > epsilon(bsr, z, delta, CYCLIC, sampling=f"cyclic-poisson:{q}").epsilon


def test_cyclic_poisson_calibration_with_the_count(bsr):
    sampling = "cyclic-poisson:0.25"
    target, sigma_b, delta = 2.0, 5.0, 1e-12
    result = calibrate(bsr, target, delta, CYCLIC, sampling=sampling, count_noise_std=sigma_b)
    spent = epsilon(bsr, result.noise_multiplier, delta, CYCLIC, sampling=sampling, count_noise_std=sigma_b).epsilon
    assert spent <= target and spent == pytest.approx(target, rel=1e-3)
    assert result.rho is None


# ---- δ down to 1e-12 without the count -------------------------------------------------------------
@pytest.mark.parametrize("delta", [pytest.param(1e-10, marks=pytest.mark.heavy), 1e-12])
def test_small_delta_unamplified_and_cyclic(bsr, delta):
    assert epsilon(bsr, 1.1, delta, SCHEMA).epsilon == pytest.approx(analytic_epsilon(1 / 1.1, delta), rel=1e-9)
    z = calibrate(bsr, 4.0, delta, SCHEMA).noise_multiplier
    assert analytic_epsilon(1 / z, delta) == pytest.approx(4.0, rel=1e-9)
    cyc = epsilon(bsr, 1.0, delta, CYCLIC, sampling="cyclic-poisson:0.1")
    col = float(np.sqrt((bsr.strategy_matrix() ** 2).sum(axis=0)).max())
    step = dp_accounting.PoissonSampledDpEvent(
        0.1, dp_accounting.GaussianDpEvent(bsr.sensitivity(CYCLIC).value / col))
    check_cyclic(cyc.epsilon, step, 4, delta)
    # calibration at this δ inverts it
    cal = calibrate(bsr, cyc.epsilon, delta, CYCLIC, sampling="cyclic-poisson:0.1")
    assert cal.noise_multiplier == pytest.approx(1.0, rel=1e-4)


def test_bminsep_refuses_a_delta_it_cannot_certify(bsr):
    for delta in (1e-8, 1e-10, 1e-12):  # 1e-8 needs 1.5e10 samples per verification (evr.minimum_samples)
        with pytest.raises(ConfigError, match="cyclic-poisson") as info:
            epsilon(bsr, 1.0, delta, SCHEMA, sampling="bminsep:0.1")
        assert "\n" not in str(info.value) and f"delta={delta:g}" in str(info.value)
        with pytest.raises(ConfigError, match="cyclic-poisson"):
            calibrate(bsr, 2.0, delta, SCHEMA, sampling="bminsep:0.1")
        with pytest.raises(ConfigError, match="cyclic-poisson"):  # up front: when the plan is made
            RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=delta, expected_users=10, noise_multiplier=1.0,
                           sampling="bminsep:0.1")
    # a delta it can certify is planned as before
    RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=1e-6, expected_users=10, noise_multiplier=1.0,
                   sampling="bminsep:0.1")


# ---- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling,schema", [("bminsep:0.1", SCHEMA), ("poisson:0.1", MinSep(1, 64))])
def test_samplers_without_count_composition_are_refused(sampling, schema):
    mechanism = build("bsr", 64, SCHEMA, num_bands=8) if sampling.startswith("bminsep") else build("dp-sgd", 64,
                                                                                                   schema)
    with pytest.raises(ConfigError, match="none .*cyclic-poisson") as info:
        epsilon(mechanism, 1.0, 1e-6, schema, sampling=sampling, count_noise_std=5.0)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="none .*cyclic-poisson"):
        RunPlan.create(mechanism, schema, clip_norm=1.0, delta=1e-6, expected_users=100, noise_multiplier=1.0,
                       sampling=sampling, adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=100))


def test_count_that_spends_the_whole_budget_is_refused(bsr):
    for sampling, schema in (("none", SCHEMA), ("cyclic-poisson:0.25", CYCLIC)):
        with pytest.raises(ConfigError) as info:
            calibrate(bsr, 0.5, 1e-6, schema, sampling=sampling, count_noise_std=0.5)
        assert str(info.value).startswith("adaptive-clipping-count-noise: ") and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="count_noise_std"):
        epsilon(bsr, 1.0, 1e-6, SCHEMA, count_noise_std=-1.0)


# ---- the plan, post hoc and the audit -----------------------------------------------------------------
def test_plan_with_adaptive_clipping_accounts_the_count(bsr):
    adaptive = AdaptiveClipping.create(0.5, expected_users=100)  # σ_b = 5
    plan = RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=1e-6, expected_users=100, target_epsilon=3.0,
                          adaptive_clipping=adaptive)
    plain = RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=1e-6, expected_users=100, target_epsilon=3.0)
    assert plan.epsilon() <= 3.0 and plan.epsilon() == pytest.approx(3.0, rel=1e-9)
    mu = math.sqrt(1 / plan.noise_multiplier**2 + 4 / 25)
    assert plan.epsilon() == pytest.approx(analytic_epsilon(mu, 1e-6), rel=1e-9)
    assert plan.noise_multiplier > plain.noise_multiplier
    assert plan.rho() == pytest.approx(mu**2 / 2, rel=1e-12) == plain.rho()
    assert plain.rho() == pytest.approx(0.5 / plain.noise_multiplier**2, rel=1e-12)
    rhos = [plan.rho_after(t) for t in range(plan.rounds)]
    assert rhos == sorted(rhos) and rhos[-1] == plan.rho()
    summary = plan.summary()
    assert summary["privacy_split"]["count"] == pytest.approx((4 / 25) / mu**2, rel=1e-12)
    assert "privacy_split" not in plain.summary() and plain.summary()["rho"] == plain.rho()
    # rebuilt from its dict: same z, same ε
    again = RunPlan.from_dict(plan.to_dict(), bsr)
    assert again.noise_multiplier == plan.noise_multiplier and again.epsilon() == plan.epsilon()
    # amplified: no ρ, a note instead
    cyclic = RunPlan.create(bsr, CYCLIC, clip_norm=1.0, delta=1e-6, expected_users=100, noise_multiplier=1.0,
                            sampling="cyclic-poisson:0.25", adaptive_clipping=adaptive)
    assert cyclic.rho() is None and cyclic.rho_after(3) is None and "rho_note" in cyclic.summary()


def test_posthoc_adds_each_users_actual_participations(bsr):
    z, sigma_b, delta = 1.0, 3.0, 1e-6
    observed = {"one": [0], "four": [0, 8, 16, 24]}
    report = account_observed(bsr, z, delta, observed, SCHEMA, count_noise_std=sigma_b)
    plain = account_observed(bsr, z, delta, observed, SCHEMA)
    std = z * bsr.sensitivity(SCHEMA).value
    for user, k in (("one", 1), ("four", 4)):
        s = next(u.sensitivity for u in report.users if u.user == user)
        mu = math.sqrt(s**2 / std**2 + k / sigma_b**2)
        eps = next(u.epsilon for u in report.users if u.user == user)
        assert eps == pytest.approx(analytic_epsilon(mu, delta), rel=1e-9)
        assert eps > next(u.epsilon for u in plain.users if u.user == user)
    assert report.planned_epsilon == epsilon(bsr, z, delta, SCHEMA, count_noise_std=sigma_b).epsilon
    # the audit's accounting: ρ per user and planned
    users = np.array([0, 1, 1, 1, 1])
    rounds = np.array([0, 0, 8, 16, 24])
    priv = run_privacy(bsr, SCHEMA, z, delta, users, rounds, 2, count_noise_std=sigma_b)
    assert priv.rho_user[0] == pytest.approx(0.5 * (priv.user_sensitivity[0] ** 2 / std**2 + 1 / sigma_b**2),
                                             rel=1e-12)
    assert priv.rho_plan == pytest.approx(0.5 / z**2 + 2 / sigma_b**2, rel=1e-12)
    assert priv.epsilon_plan == pytest.approx(report.planned_epsilon, rel=1e-12)
    assert priv.epsilon_user.max() == pytest.approx(max(u.epsilon for u in report.users), rel=1e-12)


def test_simulation_result_rho_is_the_planned_rho_spent(bsr):
    from fedmf.run.simulate import rho_spent

    plan = RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=1e-6, expected_users=100, noise_multiplier=1.0,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=40))  # σ_b = 2
    assert rho_spent(plan, 0) == 0.0
    assert rho_spent(plan, 64) == pytest.approx(0.5 + 4 / 8, rel=1e-12)
    assert 0.0 < rho_spent(plan, 10) < rho_spent(plan, 64)
    cyclic = RunPlan.create(bsr, CYCLIC, clip_norm=1.0, delta=1e-6, expected_users=100, noise_multiplier=1.0,
                            sampling="cyclic-poisson:0.25")
    assert rho_spent(cyclic, 10) is None


@pytest.mark.parametrize("delta", [1e-10, 1e-12])
def test_cyclic_pld_at_small_delta_bounds_the_exact_gaussian_composition(delta):
    # q = 1: count Gaussians compose into one Gaussian with multiplier z/√count (exact, mpmath); the PLD
    # path of cyclic_poisson must stay on the safe side of it and close
    for z, count in ((2.0, 4), (3.0, 64)):
        ours = cyclic_poisson.epsilon(z, 1.0, count, delta)
        exact = analytic_epsilon(math.sqrt(count) / z, delta)
        assert exact <= ours <= exact * (1 + 1e-5)
