import math

from scipy.optimize import brentq
from scipy.stats import norm

from fedmf import MinSep
from fedmf.accounting.gdp import run_mu_squared
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease


def gdp_eps(mu, delta):
    f = lambda e: norm.cdf(-e/mu + mu/2) - math.exp(e)*norm.cdf(-e/mu - mu/2) - delta
    return brentq(f, 0, 500)

S = MinSep(8, 4); K = 4
mech = build("bsr", 64, S, num_bands=8)
rows = []
for z, L, sm, sb, delta in [(1.0, 3.0, 20.0, None, 1e-6), (0.7, 1.0, 2.0, 5.0, 1e-9), (3.0, 10.0, 10.0, None, 1e-5), (1.5, 0.5, 0.3, 1.0, 1e-7)]:
    cm = ClientMetricRelease.create(L, sm, expected_users=10)
    ac = None if sb is None else AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=sb)
    p = RunPlan.create(mech, S, clip_norm=1.0, delta=delta, expected_users=10, noise_multiplier=z, client_metrics=cm, adaptive_clipping=ac)
    mu2 = 1/z**2 + K*(L**2/sm**2 + (0 if sb is None else 1/sb**2))
    mine = gdp_eps(math.sqrt(mu2), delta)
    print("none", z, L, sm, sb, delta, "plan", p.epsilon(), "mine", mine, "rel", abs(p.epsilon()-mine)/mine, "mu2 budget", run_mu_squared(p), mu2)
    # calibration inverts
    q = RunPlan.create(mech, S, clip_norm=1.0, delta=delta, expected_users=10, target_epsilon=p.epsilon(), client_metrics=cm, adaptive_clipping=ac)
    print("   calibrated z", q.noise_multiplier, "vs", z)
