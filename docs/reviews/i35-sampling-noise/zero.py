"""A b-min-sep plan at z = 0.5186 (tiny preset, 6 rounds, bsr): its planned epsilon and round-0 guard in fresh plans (argv[1] of them)."""
import os
import sys

T = os.environ["PYTHONPATH"]
import fedmf.mechanisms as M
from fedmf.errors import FedmfError
from fedmf.participation import MinSep
from fedmf.plan import RunPlan

m, _ = M.plan("bsr", 6, MinSep(4, 2))
print("bands", m.strategy_bands)
for i in range(int(sys.argv[1])):
    p = RunPlan.create(m, MinSep(4, 2), clip_norm=0.5, delta=1e-5, expected_users=8, noise_multiplier=0.5186,
                       target_epsilon=8.0, sampling="bminsep:0.5")
    a = p._accounting
    try:
        p.guard(0); g = "ok"
    except FedmfError as e:
        g = f"{type(e).__name__}: {e}"
    print(round(a.epsilon, 4), a.accountant, a.details.get("seed") is not None, a.details.get("epsilon_unamplified"), g, flush=True)
