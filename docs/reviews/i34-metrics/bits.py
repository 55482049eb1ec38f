import json

from fedmf import MinSep
from fedmf.accounting import calibrate, epsilon, epsilon_by_round
from fedmf.accounting.gdp import run_mu_squared
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping

out = {}
S = MinSep(8, 4); mech = build("bsr", 64, S, num_bands=8)
S2 = MinSep(16, 4); mech2 = build("bsr", 64, S2, num_bands=16)
for sb in (None, 5.0, 7.5):
    for samp, m, s in (("none", mech, S), ("cyclic-poisson:0.3", mech2, S2)):
        r = epsilon(m, 0.9, 1e-6, s, sampling=samp, count_noise_std=sb)
        c = calibrate(m, 6.0, 1e-6, s, sampling=samp, count_noise_std=sb)
        br = epsilon_by_round(m, 0.9, 1e-6, s, sampling=samp, count_noise_std=sb)
        ac = None if sb is None else AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=sb)
        p = RunPlan.create(m, s, clip_norm=1.0, delta=1e-6, expected_users=10, target_epsilon=6.0, sampling=samp, adaptive_clipping=ac)
        out[f"{sb}-{samp}"] = [r.epsilon.hex(), c.noise_multiplier.hex(), [float(x).hex() for x in br.epsilons], p.noise_multiplier.hex(), run_mu_squared(p).hex(), p.fingerprint, json.dumps(p.summary(), sort_keys=True, default=str), json.dumps(r.details, sort_keys=True, default=str)]
print(json.dumps(out, sort_keys=True))
