"""Sensitivity of the normalized sum at extreme ζ: each participation adds norm ≤ 1 (review of issue 25)."""
import math

import numpy as np
import torch

from fedmf import MinSep, Workload
from fedmf.adaptive_clipping import AdaptiveClipping
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.privatize import RoundPrivatizer

rng = np.random.default_rng(0)
worst = 0.0
crashes = []
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    info = torch.finfo(dtype if dtype != torch.bfloat16 else torch.float32)
    for zeta in (1e-300, 1e-40, 1e-20, 1e-8, 1.0, 1e8, 1e30, 1e38, 1e300):
        schema = MinSep(1, 2)
        plan = RunPlan.create(build("dp-sgd", 2, schema, Workload()), schema, clip_norm=zeta, delta=1e-5,
                              expected_users=1, noise_multiplier=1.0,
                              adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=1))
        for d in (3, 255, 257, 5000):
            p = RoundPrivatizer(plan, {"w": (d,)}, dtype=dtype, seed=b"x" * 32)
            for scale in (0.0, 1e-45, 1e-38, 1e-20, zeta * (1 - 1e-7), zeta, zeta * (1 + 1e-7), 1e20, 3e38):
                for kind in ("dense", "spike"):
                    if kind == "dense":
                        v = torch.from_numpy(rng.standard_normal(d))
                        v = v / v.norm() * scale
                    else:
                        v = torch.zeros(d, dtype=torch.float64)
                        v[d // 2] = scale
                    v = v.to(dtype)
                    if not bool(torch.isfinite(v).all()):
                        continue
                    p.begin(0)
                    try:
                        rep = p.add("u", {"w": v})
                    except Exception as e:  # noqa: BLE001 — a crash on a client's update
                        crashes.append((str(dtype), zeta, d, scale, kind, type(e).__name__))
                        p.abort()
                        continue
                    s = float(torch.linalg.vector_norm(p._sum.double()))
                    worst = max(worst, s)
                    assert s <= 1.0 and math.isfinite(s), (dtype, zeta, d, scale, kind, s, rep)
                    p.abort()
print("worst normalized contribution norm:", worst)
print("crashes:", len(crashes), sorted(set((c[0], c[2], c[3], c[4], c[5]) for c in crashes))[:12])
