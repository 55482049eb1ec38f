"""Independent check of the adaptive-clipping accounting (review of issue 25).

For each schema: build a plan with adaptive clipping, compute k (max participations) by brute force
from the schema's definition, μ² = 1/z² + k/σ_b², ε from μ via the GDP→(ε,δ) curve
(δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)) with my own bisection on scipy.stats.norm, and
ρ = μ²/2; compare with plan.epsilon() and plan.rho(). Then calibrate to a target ε and check the
composed ε meets the target and the MF part alone is strictly smaller.
"""
import math
import sys

from scipy.stats import norm

from fedmf import MinSep, Workload
from fedmf.participation import FixedEpoch
from fedmf.adaptive_clipping import AdaptiveClipping
from fedmf.mechanisms import build
from fedmf.plan import RunPlan


def delta_of(mu, eps):
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def eps_of(mu, delta):
    lo, hi = 0.0, 1.0
    while delta_of(mu, hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if delta_of(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def brute_k(schema, n):
    """Most rounds one user can take part in, by greedy earliest packing (optimal for min-sep)."""
    if isinstance(schema, FixedEpoch):
        return max(len([t for t in range(j, n, schema.min_sep)][: schema.max_participations])
                   for j in range(schema.min_sep))
    t, c = 0, 0
    while t < n and (schema.max_participations is None or c < schema.max_participations):
        c += 1
        t += schema.min_sep
    return c


def main():
    bad = 0
    cases = [
        ("bsr", 24, MinSep(4, 3), dict(num_bands=4)),
        ("bsr", 24, MinSep(4, None), dict(num_bands=4)),
        ("bsr", 24, MinSep(5, 10), dict(num_bands=4)),   # k capped by ceil(n/b)=5
        ("dp-sgd", 20, MinSep(1, 20), {}),
        ("bsr", 24, FixedEpoch(3, 8), dict(num_bands=4)),
    ]
    delta = 1e-6
    for kind, n, schema, kw in cases:
        mech = build(kind, n, schema, Workload(), **kw)
        for sigma_b in (0.5, 2.0, 20.0):
            plan = RunPlan.create(mech, schema, clip_norm=1.0, delta=delta, expected_users=10, noise_multiplier=3.0,
                                  adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10,
                                                                            count_noise_std=sigma_b))
            k = brute_k(schema, n)
            mu2 = 1 / 3.0**2 + k / sigma_b**2
            eps = eps_of(math.sqrt(mu2), delta)
            ok = abs(plan.epsilon() - eps) <= 1e-7 * max(1, eps) and abs(plan.rho() - mu2 / 2) <= 1e-12
            bad += not ok
            print(f"{kind:6s} n={n} {schema} σ_b={sigma_b:5}: k={k} ε mine={eps:.9f} plan={plan.epsilon():.9f} "
                  f"ρ mine={mu2/2:.9f} plan={plan.rho():.9f} {'OK' if ok else 'MISMATCH'}")
            # the per-round curve ends at the planned value and never exceeds it
            curve = plan.epsilon_by_round()
            assert curve[-1] == plan.epsilon() and (curve <= plan.epsilon() + 1e-12).all()
        # calibration with the count composed in
        for target in (2.0, 8.0):
            sigma_b = 10.0
            plan = RunPlan.create(mech, schema, clip_norm=1.0, delta=delta, expected_users=10, target_epsilon=target,
                                  adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10,
                                                                            count_noise_std=sigma_b))
            k = brute_k(schema, n)
            mu = math.sqrt(1 / plan.noise_multiplier**2 + k / sigma_b**2)
            e = eps_of(mu, delta)
            mf_only = eps_of(1 / plan.noise_multiplier, delta)
            ok = e <= target * (1 + 1e-9) and e >= target * (1 - 1e-6) and mf_only < target
            bad += not ok
            print(f"   calibrate ε={target}: z={plan.noise_multiplier:.6f} composed ε mine={e:.9f} "
                  f"(MF alone {mf_only:.4f}) {'OK' if ok else 'MISMATCH'}")
    print("mismatches:", bad)
    return bad


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
