import hashlib
import json

import torch

from fedmf import MinSep
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.privatize import RoundPrivatizer

S = MinSep(2, 3); mech = build("bsr", 6, S, num_bands=2)
layout = {"w": (3, 2), "b": (2,)}
out = {}
for adaptive in (False, True):
    ac = AdaptiveClipping.create(0.5, expected_users=3, count_noise_std=1.0) if adaptive else None
    plan = RunPlan.create(mech, S, clip_norm=1.0, delta=1e-6, expected_users=3, noise_multiplier=1.0, adaptive_clipping=ac)
    p = RoundPrivatizer(plan, layout, seed=1234, repeatable_noise=True, dtype=torch.float64)
    h = hashlib.sha256()
    for t in range(6):
        g = torch.Generator().manual_seed(t)
        ups = {u: {"w": torch.randn(3, 2, generator=g, dtype=torch.float64), "b": torch.randn(2, generator=g, dtype=torch.float64)} for u in range(3)}
        mean, rep = p.privatize(t, ups)
        for k in sorted(mean): h.update(mean[k].numpy().tobytes())
        h.update(repr((rep.clip_norm, rep.noisy_unclipped)).encode())
    out[str(adaptive)] = h.hexdigest()
print(json.dumps(out))
