# ruff: noqa: B023  (each lambda is called at once by rec(), inside its loop iteration)
"""Noise bit-identity + registry refusals; PYTHONPATH selects the tree."""
import hashlib
import io
import json
import os
import sys

import torch

T = os.environ["PYTHONPATH"]
OLD = os.path.exists(os.path.join(T, "fedmf/noise.py"))
import fedmf.mechanisms as M
from fedmf.errors import FedmfError
from fedmf.participation import FixedEpoch, MinSep
from fedmf.workloads import Workload

if OLD:
    from fedmf.noise import NoiseGenerator
else:
    from fedmf.round.noise import NoiseGenerator
out = {}
def rec(key, fn):
    try:
        v = fn()
    except FedmfError as e:
        v = ("ERR", type(e).__name__, str(e))
    except Exception as e:
        v = ("EXC", type(e).__name__, str(e))
    out[key] = v
    return v
R = 8
schemas = {"ms2": MinSep(2, 4), "ms4": MinSep(4, 2), "fe": FixedEpoch(2, 4)}
workloads = {"prefix": Workload(), "mom": Workload(momentum=0.9), "cool": Workload(momentum=0.5, cooldown=0.5)}
optsets = {"plain": {}, "nb1": {"num_bands": 1}, "nb2": {"num_bands": 2}, "nb5": {"num_bands": 5},
           "gamma": {"gamma": 0.3}, "nbuf0": {"num_buffers": 0}, "nbuf2": {"num_buffers": 2},
           "msr": {"min_sep_range": (2, 4)}, "msr_taper": {"min_sep_range": (2, 4), "taper": True},
           "msr_nb2": {"min_sep_range": (2, 4), "num_bands": 2}, "bad_err": {"error": "x"}, "max_err": {"error": "max"},
           "bad_w": {"weighting": "x"}, "tol": {"tolerance": -1.0}, "steps0": {"max_steps": 0}}
mechs = {}
for kind in list(M.KINDS) + ["banded-inverse-toeplitz", "nope"]:
    for sn, sch in schemas.items():
        for wn, wl in workloads.items():
            for on, opts in optsets.items():
                kw = dict(opts); kw.setdefault("max_steps", 3)
                def mk():
                    m, _ = M.plan(kind, R, sch, wl, **kw)
                    return m
                def fp():
                    m = mk()
                    mechs[(kind, sn, wn, on)] = m
                    return [m.kind, m.fingerprint() if callable(getattr(m, "fingerprint", None)) else repr(getattr(m, "fingerprint", None))]
                rec(f"plan/{kind}/{sn}/{wn}/{on}", fp)
                if on == "plain":
                    rec(f"build/{kind}/{sn}/{wn}", lambda: M.build(kind, R, sch, wl).kind)
rec("plan/blt/cool/big", lambda: M.plan("blt", 4097, MinSep(4, 2), Workload(cooldown=0.5), max_steps=1)[0].kind)
out["lists"] = [list(M.KINDS), list(M.BANDED_KINDS), list(M.OPTIMIZED_KINDS), list(getattr(M, "CLOSED_FORM_KINDS", ()))]
# noise
def h(x):
    if isinstance(x, dict):
        x = torch.cat([v.reshape(-1) for v in x.values()])
    return hashlib.sha256(x.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
layout = {"w": (3, 5), "b": (7,)}
salts = [bytes([i]) * 16 for i in range(R)]
seen = set()
for (kind, sn, wn, on), m in mechs.items():
    if on not in ("plain", "nb1", "msr") or (m.fingerprint() if callable(getattr(m, "fingerprint", None)) else None, kind, sn, wn) in seen:
        continue
    for dt in (torch.float32, torch.float64):
        for mode in ("plain", "salted", "regen", "shard"):
            def run():
                kw = {"dtype": dt, "seed": 1234}
                if mode == "salted": kw["salted"] = True
                if mode == "regen": kw["regenerate"] = True
                if mode == "shard": kw["shard"] = (1, 3)
                lay = 22 if mode == "shard" else layout
                g = NoiseGenerator(m, lay, 0.7, **kw)
                res = []
                for t in range(R):
                    if t == 3:
                        st = g.state_dict()
                        buf = io.BytesIO(); torch.save(st, buf); buf.seek(0)
                        st2 = torch.load(buf, weights_only=True)
                        g = NoiseGenerator(m, lay, 0.7, **kw); g.load_state_dict(st2)
                        meta = g.state_dict(include_seed=False)
                        res.append(sorted(k for k in meta))
                        res.append("seedleak" if any(str(v).find("1234") >= 0 for k, v in meta.items() if k not in ("structure",)) else "ok")
                    x = g.next(salt=salts[t]) if mode == "salted" else g.next()
                    res.append(h(x))
                try:
                    g.next(); res.append("no-horizon")
                except FedmfError as e:
                    res.append(type(e).__name__)
                return res
            rec(f"noise/{kind}/{sn}/{wn}/{on}/{dt}/{mode}", run)
mods = [m.__file__ for n, m in list(sys.modules.items()) if n.startswith('fedmf') and getattr(m, '__file__', None)]
bad = [f for f in mods if not f.startswith(T)]
assert not bad, bad
json.dump(out, sys.stdout, default=repr, sort_keys=True)
