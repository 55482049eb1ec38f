"""Independent review of issue 34 item 2 (the private client-metric release): docs/reviews/REVIEW-i34-metrics.md.

Reference values marked "c9b3c4a" were computed by the code before the change (commit c9b3c4a, run from a
checkout of it with /tmp scripts recorded in the review): the count-only and no-release paths must keep them
bit for bit. The ε checks use the GDP closed form inverted by scipy's brentq, independent of the project's
accountants and of the author's test helpers.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from fedmf import MinSep
from fedmf.accounting import calibrate, epsilon
from fedmf.accounting.gdp import run_mu_squared
from fedmf.config import RunConfig
from fedmf.errors import ConfigError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.count_noise import metric_noise
from fedmf.round.draws import key_of
from fedmf.round.privatize import RoundPrivatizer

SCHEMA = MinSep(8, 4)  # k = 4 participations in 64 rounds
K = 4


@pytest.fixture(scope="module")
def bsr():
    return build("bsr", 64, SCHEMA, num_bands=8)


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε of μ-GDP at δ: δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth, Su 2022, Cor. 2.13), inverted."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0.0, 500.0,
                  xtol=1e-14, rtol=1e-14)


# ---- fixed by the review: a release too exact for float64 was a traceback, not a one-line error ---------
@pytest.mark.parametrize("noise,clip", [(5e-324, 10.0), (1e-200, 10.0), (1.0, 1e300)])
def test_a_metric_noise_too_small_for_its_clip_is_a_one_line_config_error(noise, clip):
    # before the fix: ZeroDivisionError (σ/L underflows to 0) or OverflowError ((L/σ)² in count_release)
    config = RunConfig.from_mapping({"task": "tiny", "rounds": 8, "min-sep": 2, "clients-per-round": 3,
                                     "noise-multiplier": 1.0, "client-metrics": "private",
                                     "client-metrics-noise": noise, "client-metrics-clip": clip})
    with pytest.raises(ConfigError, match="client-metrics-noise"):
        config.build_plan()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # dp_accounting's exp overflows at ε ~ 1e280
def test_a_count_noise_too_small_is_a_one_line_config_error(bsr):
    with pytest.raises(ConfigError, match="adaptive-clipping-count-noise"):  # before: OverflowError
        epsilon(bsr, 1.0, 1e-6, SCHEMA, count_noise_std=1e-200)
    # the bound leaves every release that float64 accounts: Δ/σ = 1e140 still gives a (huge) finite ε
    assert math.isfinite(epsilon(bsr, 1.0, 1e-6, SCHEMA, count_noise_std=1e-140).epsilon)


# ---- the count-only and no-release paths are those of c9b3c4a bit for bit --------------------------------
def test_the_count_only_accounting_is_c9b3c4a_bit_for_bit(bsr):
    cyclic = MinSep(16, 4)
    banded = build("bsr", 64, cyclic, num_bands=16)
    assert epsilon(bsr, 0.9, 1e-6, SCHEMA, count_noise_std=5.0).epsilon.hex() == "0x1.7a50a0391e01ep+2"
    assert calibrate(bsr, 6.0, 1e-6, SCHEMA, count_noise_std=5.0).noise_multiplier.hex() == "0x1.c61f3f605ebdap-1"
    assert epsilon(banded, 0.9, 1e-6, cyclic, sampling="cyclic-poisson:0.3",
                   count_noise_std=5.0).epsilon.hex() == "0x1.388c769ee2ba7p+1"


#: c9b3c4a's privatizer on the updates below, seed 1234, repeatable noise, float64: SHA-256 of the means
#: (and ζₜ, b̃ₜ) of 6 rounds, without and with adaptive clipping
C9B3C4A_DIGESTS = {False: "34a2939ae5199efe38fa9524d80c940284726caec31c3d6a8254e67ef36c6588",
                   True: "8a5a87672e8c507dba1e83632fde6afb3dd0c08987000875dba9fcc9ed955ce4"}


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_model_and_count_noise_without_the_release_are_c9b3c4a_bit_for_bit(adaptive):
    schema = MinSep(2, 3)
    mechanism = build("bsr", 6, schema, num_bands=2)
    clipping = AdaptiveClipping.create(0.5, expected_users=3, count_noise_std=1.0) if adaptive else None
    plan = RunPlan.create(mechanism, schema, clip_norm=1.0, delta=1e-6, expected_users=3, noise_multiplier=1.0,
                          adaptive_clipping=clipping)
    privatizer = RoundPrivatizer(plan, {"w": (3, 2), "b": (2,)}, seed=1234, repeatable_noise=True,
                                 dtype=torch.float64)
    digest = hashlib.sha256()
    for t in range(6):
        g = torch.Generator().manual_seed(t)
        updates = {u: {"w": torch.randn(3, 2, generator=g, dtype=torch.float64),
                       "b": torch.randn(2, generator=g, dtype=torch.float64)} for u in range(3)}
        mean, report = privatizer.privatize(t, updates)
        for name in sorted(mean):
            digest.update(mean[name].numpy().tobytes())
        digest.update(repr((report.clip_norm, report.noisy_unclipped)).encode())
    assert digest.hexdigest() == C9B3C4A_DIGESTS[adaptive]


# ---- the release: ε against the GDP closed form, the budget's μ², the clipped sum ----------------------
@pytest.mark.parametrize("z,clip,sigma_m,sigma_b,delta", [(0.7, 1.0, 2.0, 5.0, 1e-9), (3.0, 10.0, 10.0, None, 1e-5)])
def test_the_plan_is_mu_gdp_with_mu2_the_sum_of_the_releases(bsr, z, clip, sigma_m, sigma_b, delta):
    release = ClientMetricRelease.create(clip, sigma_m, expected_users=10)
    count = None if sigma_b is None else AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=sigma_b)
    plan = RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=delta, expected_users=10, noise_multiplier=z,
                          client_metrics=release, adaptive_clipping=count)
    mu2 = 1 / z**2 + K * (clip**2 / sigma_m**2 + (0.0 if sigma_b is None else 1 / sigma_b**2))
    assert plan.epsilon() == pytest.approx(gdp_epsilon(math.sqrt(mu2), delta), rel=1e-10)
    assert run_mu_squared(plan) == pytest.approx(mu2, rel=1e-14)


def test_each_contributed_value_moves_the_release_by_at_most_l_over_m():
    schema = MinSep(1, 8)
    plan = RunPlan.create(build("bsr", 8, schema, num_bands=1), schema, clip_norm=1.0, delta=1e-6, expected_users=4,
                          noise_multiplier=1.0, client_metrics=ClientMetricRelease.create(2.0, 0.5, expected_users=4))
    privatizer = RoundPrivatizer(plan, {"w": (2,)}, seed=99, repeatable_noise=True, dtype=torch.float64)
    ones = {"w": torch.ones(2, dtype=torch.float64)}
    values = {"nan": math.nan, "neg": -5.0, "huge": 1e300, "inf": math.inf, "ok": 1.5, "bool": True,
              "list": [1.0], "absent": 2.0}
    # "absent" reported a value but sent no update: it adds nothing; m = 4 planned, 6 summed
    _, report = privatizer.privatize(0, {u: ones for u in values if u != "absent"}, values=values)
    clipped = 0.0 + 0.0 + 2.0 + 0.0 + 1.5 + 1.0 + 0.0  # in-process a bool is read as 1 (still within [0, L])
    assert report.noisy_client_metric == (clipped + metric_noise(key_of(99), 0, b"", 0.5)) / 4
