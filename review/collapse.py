"""Honest clients, ζ₀ below 1/100 of the updates' ℓ∞: every update is zeroed, counted as 'unclipped'
(privatize.py _finish_adaptive), so b̃ ≈ 1 and ζ shrinks forever instead of growing to the γ-quantile."""
import math

import numpy as np
import torch

from fedmf import MinSep, Workload
from fedmf.adaptive_clipping import AdaptiveClipping
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.privatize import RoundPrivatizer

D, M, ROUNDS = 100, 20, 60
for zeta0 in (1e-3, 1e-2, 0.1):
    schema = MinSep(1, ROUNDS)
    plan = RunPlan.create(build("dp-sgd", ROUNDS, schema, Workload()), schema, clip_norm=zeta0, delta=1e-5,
                          expected_users=M, noise_multiplier=1.0,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=M, count_noise_std=1.0))
    priv = RoundPrivatizer(plan, {"w": (D,)}, dtype=torch.float32, seed=b"collapse-seed-0123456789")
    rng = np.random.default_rng(0)
    zetas = []
    for t in range(ROUNDS):
        zetas.append(priv.clip_norm)
        ups = {}
        for i in range(M):  # norms log-normal around 1, ℓ∞ ≈ 0.3
            v = rng.standard_normal(D)
            ups[f"u{i}"] = {"w": torch.tensor(v / np.linalg.norm(v) * math.exp(0.3 * rng.standard_normal()),
                                              dtype=torch.float32)}
        _, rep = priv.privatize(t, ups)
    print(f"ζ0={zeta0:g}: ζ after {ROUNDS} rounds = {priv.clip_norm:.3g} (median norm ≈ 1); "
          f"last round zeroed {rep.counts()['zeroed']}/{M}")
