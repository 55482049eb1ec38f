"""The accountant does not see R: z, ε and ρ of adaptive plans, printed as JSON. Run in /work/main (c9b3c4a,
no R) and in the worktree (R = 2, 10, 1e6) and compare: `python acc.py > old.json` etc."""
import inspect
import json
import sys

from fedmf import FixedEpoch, MinSep, Workload
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping

has_range = "clip_norm_range" in inspect.signature(AdaptiveClipping.create).parameters
out = {}
for R in ([2.0, 10.0, 1e6] if has_range else [None]):
    rows = []
    for schema, sampling, m in [(MinSep(2, None), None, 3), (MinSep(1, 8), "cyclic-poisson:0.5", 4), (FixedEpoch(2, 4), None, 5)]:
        mech = build("bsr", 8, schema, Workload(momentum=0.0), num_bands=schema.min_sep)
        for kw in [dict(target_epsilon=2.0), dict(noise_multiplier=1.1)]:
            extra = {} if R is None else {"clip_norm_range": R}
            rule = AdaptiveClipping.create(0.5, expected_users=m, count_noise_std=20.0, **extra)
            plan = RunPlan.create(mech, schema, clip_norm=0.1, delta=1e-6, expected_users=m, sampling=sampling,
                                  adaptive_clipping=rule, **kw)
            s = plan.summary()
            rows.append({"z": plan.noise_multiplier, "eps": plan.epsilon(),
                         "curve": [plan.epsilon_after(t) for t in range(8)],
                         "split": s.get("privacy_split"), "noise_std": plan.noise_std})
    out[str(R)] = rows
json.dump(out, sys.stdout, sort_keys=True)
