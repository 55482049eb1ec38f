import dp_accounting

from fedmf import MinSep
from fedmf.accounting import calibrate, epsilon
from fedmf.accounting.releases import ExtraReleases, GaussianRelease
from fedmf.mechanisms import build

S = MinSep(16, 4)
mech = build("bsr", 64, S, num_bands=16)
def pld(zs, q, n, delta):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(zs)), n))
    return acc.get_epsilon(delta)
for z, L, sm, sb, delta, q in [(1.0, 3.0, 20.0, None, 1e-6, 0.3), (0.8, 1.0, 3.0, 4.0, 1e-8, 0.5), (2.0, 10.0, 15.0, None, 1e-5, 0.1)]:
    base = epsilon(mech, z, delta, S, sampling=f"cyclic-poisson:{q}")
    zmf = base.details["step_noise_multiplier"]; steps = base.details["steps"]
    rel = ExtraReleases.of(None if sb is None else GaussianRelease("count", 1.0, sb), GaussianRelease("client-metrics", L, sm))
    r = epsilon(mech, z, delta, S, sampling=f"cyclic-poisson:{q}", releases=rel)
    zs = (1/zmf**2 + L**2/sm**2 + (0 if sb is None else 1/sb**2)) ** -0.5
    mine = pld(zs, q, steps, delta)
    c = calibrate(mech, r.epsilon, delta, S, sampling=f"cyclic-poisson:{q}", releases=rel)
    print(z, L, sm, sb, delta, q, "code", r.epsilon, "mine", mine, "rel", abs(r.epsilon-mine)/mine, "step", r.details.get("step_noise_multiplier"), zs, "calib z", c.noise_multiplier)
