"""Dump every release of a few privatizer runs (tree chosen by PYTHONPATH) to a torch file:
    PYTHONPATH=<tree> python docs/reviews/i35-clipping/releases.py OUT.pt [quick]
Scenarios: fixed/adaptive x float32/float64/bfloat16 x salted (deterministic stand-in for
secrets.token_bytes)/repeatable x client metrics on/off x mechanisms; updates with dropouts (selected
users absent), zeroed (huge l-inf), NaN/inf, not selected, duplicates (begin/add API), exactly at zeta,
tiny zeta0 (everything zeroed) and large count noise; a checkpoint serialized with torch.save after
round 3 and resumed in a fresh privatizer; every salt each keyed stream was called with is recorded."""
import hashlib
import io
import math
import secrets
import sys

import torch

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.plan import RunPlan

try:  # the engine's layout since the root was grouped into rooms (issue 35)
    import fedmf.round.count_noise as cn
    import fedmf.round.noise as nz
    import fedmf.round.privatize as pv
    from fedmf.round.adaptive_clipping import AdaptiveClipping
    from fedmf.round.client_metrics import ClientMetricRelease
except ImportError:  # the tree before it (4c6cbb1: flat fedmf/)
    import fedmf.count_noise as cn
    import fedmf.noise as nz
    import fedmf.privatize as pv
    from fedmf.adaptive_clipping import AdaptiveClipping
    from fedmf.client_metrics import ClientMetricRelease
RoundPrivatizer = pv.RoundPrivatizer

ROUNDS, M = 9, 6
LAYOUT = {"a": (40, 7), "b": (13,)}
CALLS = []  # (stream, t or round, salt) for each keyed draw

_count, _metric, _next = cn.count_noise, cn.metric_noise, nz.NoiseGenerator.next


def _rec_count(key, t, salt, std):
    CALLS.append(("count", t, bytes(salt)))
    return _count(key, t, salt, std)


def _rec_metric(key, t, salt, std):
    CALLS.append(("metric", t, bytes(salt)))
    return _metric(key, t, salt, std)


def _rec_next(self, *a, **k):
    CALLS.append(("noise", self.round, bytes(k.get("salt") or b"")))
    return _next(self, *a, **k)


cn.count_noise, cn.metric_noise, nz.NoiseGenerator.next = _rec_count, _rec_metric, _rec_next
pv.metric_noise = _rec_metric
try:
    import fedmf.round.clipping as rc  # new tree only
    rc.count_noise = _rec_count
except ImportError:
    pass
if hasattr(pv, "count_noise"):
    pv.count_noise = _rec_count


def plan(kind, adaptive, metrics, zeta0=0.8, sigma_b=None):
    schema = MinSep(2, ROUNDS)
    mech = build(kind, ROUNDS, schema, Workload(), num_bands=3 if kind == "bsr" else None)
    ad = None
    if adaptive:
        ad = AdaptiveClipping.create(0.4, expected_users=M, **({} if sigma_b is None else {"count_noise_std": sigma_b}))
    return RunPlan.create(mech, schema, clip_norm=zeta0, delta=1e-5, expected_users=M, noise_multiplier=0.9,
                          adaptive_clipping=ad,
                          client_metrics=ClientMetricRelease.create(2.0, expected_users=M) if metrics else None)


def batch(t, zeta, dtype):
    g = torch.Generator().manual_seed(7919 * t + 17)
    out = {}
    for i, f in enumerate((0.2, 0.7, 1.0, 1.3, 3.0, 9.0)):
        a, b = torch.randn(40, 7, generator=g, dtype=torch.float64), torch.randn(13, generator=g, dtype=torch.float64)
        n = math.sqrt(float((a * a).sum() + (b * b).sum()))
        out[f"u{i}"] = {"a": (a / n * f * zeta).to(dtype), "b": (b / n * f * zeta).to(dtype)}
    out["u1"]["a"][t % 40, 0] = 300.0 * zeta  # zeroed (l-inf > 100 zeta)
    out["u3"]["b"][2] = math.nan if t % 2 else math.inf
    if t % 3 == 0:
        del out["u2"]  # a dropout: selected, never sent
    out["zz-stranger"] = {"a": torch.zeros(40, 7, dtype=dtype), "b": torch.ones(13, dtype=dtype)}
    out["u6-badshape"] = {"a": torch.zeros(7, 40, dtype=dtype), "b": torch.ones(13, dtype=dtype)}
    return out


def one_round(p, t, dtype, rec, use_add):
    zeta = p.clip_norm
    ups = batch(t, zeta, dtype)
    sel = [f"u{i}" for i in range(7)] + ["u6-badshape"]
    values = {u: 0.5 * i - 0.3 for i, u in enumerate(sorted(ups))}
    values["u4"] = math.nan
    if use_add:
        p.begin(t, sel)
        for u in sorted(ups, reverse=True):
            p.add(u, ups[u])
        p.add("u0", ups["u0"])  # duplicate
        mean, rep = p.finish(values)
    else:
        mean, rep = p.privatize(t, ups, selected=sel, values=values)
    rec.append({"t": t, "zeta_before": zeta, "mean": {k: v.clone() for k, v in mean.items()},
                "report": (rep.round, rep.noise_std, rep.expected_users, rep.clip_norm, rep.noisy_unclipped,
                           rep.noisy_client_metric,
                           [(str(u.user), u.status, u.reason, u.norm, u.clipped, u.zeroed) for u in rep.users]),
                "zeta_after": p.clip_norm})


def scenario(kind, adaptive, dtype, salted, metrics, zeta0=0.8, sigma_b=None, use_add=False):
    counter = iter(range(10**6))
    real = secrets.token_bytes
    secrets.token_bytes = lambda n=32: hashlib.sha256(b"salt-%d" % next(counter)).digest()[:n]
    CALLS.clear()
    try:
        pl = plan(kind, adaptive, metrics, zeta0, sigma_b)
        seed = b"review-i35-seed-0123456789abcdef"
        a = RoundPrivatizer(pl, LAYOUT, dtype=dtype, seed=seed, repeatable_noise=not salted)
        full, resumed = [], []
        blob = None
        for t in range(ROUNDS):
            one_round(a, t, dtype, full, use_add)
            if t == 3:
                buf = io.BytesIO()
                torch.save(a.state_dict(), buf)
                blob = buf.getvalue()
        calls_full = list(CALLS)
        # resume: a fresh process-equivalent privatizer from the serialized state, the same salts onward
        counter2 = iter(range(4, 10**6))  # rounds 0..3 used salts 0..3 (one per round)
        secrets.token_bytes = lambda n=32: hashlib.sha256(b"salt-%d" % next(counter2)).digest()[:n]
        CALLS.clear()
        b = RoundPrivatizer(pl, LAYOUT, dtype=dtype, seed=seed, repeatable_noise=not salted)
        b.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))
        for t in range(4, ROUNDS):
            one_round(b, t, dtype, resumed, use_add)
        return {"full": full, "resumed": resumed, "calls": calls_full, "calls_resumed": list(CALLS),
                "state_keys": sorted(torch.load(io.BytesIO(blob), weights_only=False))}
    finally:
        secrets.token_bytes = real


SCENARIOS = {}
for kind in ("bsr", "dp-sgd", "tree"):
    for adaptive in (False, True):
        for dtype in (torch.float32, torch.float64):
            for salted in (False, True):
                for metrics in (False, True):
                    SCENARIOS[(kind, adaptive, str(dtype), salted, metrics)] = {
                        "kind": kind, "adaptive": adaptive, "dtype": dtype, "salted": salted, "metrics": metrics}
SCENARIOS[("bsr", True, "bf16", True, True)] = {"kind": "bsr", "adaptive": True, "dtype": torch.bfloat16, "salted": True,
                                                    "metrics": True}
SCENARIOS[("bsr", False, "bf16", True, False)] = {"kind": "bsr", "adaptive": False, "dtype": torch.bfloat16, "salted": True,
                                                      "metrics": False}
SCENARIOS[("bsr", True, "tiny-zeta0", True, False)] = {"kind": "bsr", "adaptive": True, "dtype": torch.float32,
                                                        "salted": True, "metrics": False, "zeta0": 1e-4}
SCENARIOS[("bsr", True, "big-sigma_b", True, True)] = {"kind": "bsr", "adaptive": True, "dtype": torch.float64,
                                                        "salted": True, "metrics": True, "sigma_b": 50.0}
SCENARIOS[("bsr", True, "add-api", True, True)] = {"kind": "bsr", "adaptive": True, "dtype": torch.float32,
                                                    "salted": True, "metrics": True, "use_add": True}
SCENARIOS[("bsr", False, "add-api", True, True)] = {"kind": "bsr", "adaptive": False, "dtype": torch.float32,
                                                        "salted": True, "metrics": True, "use_add": True}

if __name__ == "__main__":
    quick = sys.argv[2:] == ["quick"]  # the bsr scenarios only (tests/round/test_clipping_policy_releases_unchanged.py)
    torch.save({k: scenario(**v) for k, v in SCENARIOS.items() if not quick or k[0] == "bsr"}, sys.argv[1])
