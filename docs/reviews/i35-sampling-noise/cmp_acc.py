# ruff: noqa: B023  (each lambda is called at once by rec(), inside its loop iteration)
"""Side-by-side accounting, plans, schedulers and the parser; PYTHONPATH selects the tree (4c6cbb1 or later). Prints one JSON dict."""
import json
import os
import sys

import fedmf.mechanisms as M
from fedmf.accounting import accountant as A
from fedmf.errors import FedmfError
from fedmf.participation import FixedEpoch, MinSep

OLD = os.path.exists(os.path.join(os.environ["PYTHONPATH"], "fedmf/accounting/sampling.py"))
if OLD:
    from fedmf.accounting.sampling import parse_sampling
    from fedmf.adaptive_clipping import AdaptiveClipping
    from fedmf.client_metrics import ClientMetricRelease
else:
    from fedmf.round.adaptive_clipping import AdaptiveClipping
    from fedmf.round.client_metrics import ClientMetricRelease
    from fedmf.sampling import parse_sampling
from fedmf.accounting.releases import ExtraReleases
from fedmf.plan import RunPlan
from fedmf.schedule import make_scheduler

out = {}
def rec(key, fn):
    try:
        v = fn()
    except FedmfError as e:
        v = ("ERR", type(e).__name__, str(e))
    except Exception as e:
        v = ("EXC", type(e).__name__, str(e))
    out[key] = v

def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if "second" not in k}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x

def acc(a):
    d = dict(a.to_dict()); d.pop("seconds", None)
    det = dict(d.get("details", {})); det.pop("monte_carlo_seconds", None)
    if "evr" in det:
        det["evr"] = {k: v for k, v in det["evr"].items() if "second" not in k}
    d["details"] = det
    return strip(json.loads(json.dumps(d, default=repr)))

R = 8
MC = A.MonteCarloOptions(samples=4000, seed=7, pilot_samples=1000)
DELTA = 1e-2
schemas = {"minsep2": MinSep(2, 4), "minsep4": MinSep(4, 2), "minsep1": MinSep(1, 8), "fixed": FixedEpoch(2, 4)}
mechs = {}
for kind, nb in (("bsr", 2), ("tree", None), ("dp-sgd", None), ("banded-toeplitz", 2)):
    for sname, sch in schemas.items():
        try:
            mechs[(kind, sname)] = M.plan(kind, R, sch, num_bands=nb)[0] if nb else M.plan(kind, R, sch)[0]
        except FedmfError as e:
            out[f"mech/{kind}/{sname}"] = ("ERR", str(e))
samplings = ["none", "bminsep:0.5", "bminsep:0.5:warm", "cyclic-poisson:0.5", "poisson:0.5"]
extras = {"none": {}, "count": {"count_noise_std": 3.0},
          "rel": {"releases": ExtraReleases.of(ExtraReleases.count(3.0).releases[0],
                                               ClientMetricRelease.create(1.0, 2.0, expected_users=5).release())},
          "metric": {"releases": ExtraReleases.of(ClientMetricRelease.create(1.0, 2.0, expected_users=5).release())}}
for (kind, sname), mech in mechs.items():
    sch = schemas[sname]
    for s in samplings:
        for acct in ("pld", "rdp"):
            for ename, ex in extras.items():
                k = f"{kind}/{sname}/{s}/{acct}/{ename}"
                rec("eps/" + k, lambda: acc(A.epsilon(mech, 1.3, DELTA, sch, sampling=s, accountant=acct, monte_carlo=MC, **ex)))
                rec("epsPR/" + k, lambda: acc(A.epsilon(mech, 1.3, DELTA, sch, sampling=s, accountant=acct, monte_carlo=MC, per_round=True, **ex)))
                rec("cal/" + k, lambda: acc(A.calibrate(mech, 3.0, DELTA, sch, sampling=s, accountant=acct, monte_carlo=MC, **ex)))
                rec("byr/" + k, lambda: [list(map(float, A.epsilon_by_round(mech, 1.3, DELTA, sch, sampling=s, accountant=acct, **ex).epsilons))])
        for dl in (1e-2, 1e-9, 1e-12):
            for clip in ("fixed", "adaptive", "metrics"):
                kw = {}
                if clip == "adaptive":
                    kw["adaptive_clipping"] = AdaptiveClipping.create(0.5, expected_users=5, count_noise_std=3.0)
                if clip == "metrics":
                    kw["client_metrics"] = ClientMetricRelease.create(1.0, 2.0, expected_users=5)
                def mk():
                    p = RunPlan.create(mech, sch, clip_norm=1.0, delta=dl, expected_users=5, noise_multiplier=1.3,
                                       sampling=s, **kw)
                    r = {"fp": p.fingerprint, "guard": p.sampling.observed_guard, "str": str(p.sampling)}
                    if dl == 1e-2 and s not in ("bminsep:0.5", "bminsep:0.5:warm"):
                        r["byr"] = list(map(float, p.epsilon_by_round()))
                    return r
                rec(f"plan/{kind}/{sname}/{s}/{dl}/{clip}", mk)
# schedulers
users = [f"u{i}" for i in range(30)]
for sname, sch in schemas.items():
    for s in samplings:
        for upr in (None, 3):
            for pop in (None, users):
                def sel():
                    sc = make_scheduler(sch, s, key=b"k" * 32, users_per_round=upr, population=pop, rounds=R)
                    res = [type(sc).__name__, sc.describe() if hasattr(sc, "describe") else None]
                    for t in range(R):
                        x = sc.select(t, users)
                        res.append([str(u) for u in x.selected])
                    return json.loads(json.dumps(res, default=repr))
                rec(f"sched/{sname}/{s}/{upr}/{pop is not None}", sel)
# parser
for t in ["none", "bminsep:0.5", "bminsep:0.5:cold", "bminsep:0.5:warm", "cyclic-poisson:0.1", "poisson:1",
          "none:0.5", "poisson:0.5:warm", "cyclic-poisson:0.5:cold", "bminsep", "bminsep:x", "bminsep:1.5", "foo:1",
          " none ", "bminsep:0.5:hot", "poisson:0"]:
    rec("parse/" + t, lambda: [str(parse_sampling(t)), type(parse_sampling(t)).__name__, parse_sampling(t).observed_guard])
mods = [m.__file__ for n, m in list(sys.modules.items()) if n.startswith('fedmf') and getattr(m, '__file__', None)]
bad = [f for f in mods if not f.startswith(os.environ['PYTHONPATH'])]
assert not bad, bad
json.dump(out, sys.stdout, default=repr, sort_keys=True)
