"""Direct probes of the new tree (PYTHONPATH=$PWD): the zeta rule from released values only, the count's
own stream, the noise std per policy, division by the planned m, bad states refused without side
effects, and no secret bytes in the serialized state / reports / errors."""
import copy
import io

import torch
from fedmf.noise import key_of

from fedmf import MinSep, Workload
from fedmf.errors import CheckpointError, PlanMismatch
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.count_noise import count_noise
from fedmf.round.privatize import RoundPrivatizer

SEED, M, N, D = b"probe-seed-0123456789abcdef01234", 4, 6, 20000


def plan(adaptive, zeta0=0.7, kind="dp-sgd"):
    s = MinSep(1, N)
    return RunPlan.create(build(kind, N, s, Workload()), s, clip_norm=zeta0, delta=1e-5, expected_users=M,
                          noise_multiplier=1.3,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=M) if adaptive else None)


def ups(t, zeta, k=3):
    g = torch.Generator().manual_seed(t)
    out = {}
    for i in range(k):
        v = torch.randn(D, generator=g, dtype=torch.float64)
        out[f"u{i}"] = {"w": v / v.norm() * zeta * (0.5, 1.0, 3.0)[i % 3]}
    return out


for adaptive in (False, True):
    pl = plan(adaptive)
    # noise std: no updates, round 0 of dp-sgd (C = I): mean*m is the noise itself
    p = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    mean, rep = p.privatize(0, {})
    emp = float((mean["w"] * M).std())
    print(f"adaptive={adaptive}: report std {rep.noise_std:.6g}, plan z*zeta*sens {pl.noise_std:.6g}, "
          f"empirical {emp:.6g}, zeta0 {pl.clip_norm}")
    # divide by planned m, whatever was received: with/without updates on twins, same seed, same round
    a = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    b = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    u = ups(0, pl.clip_norm)
    ma, ra = a.privatize(0, u)
    mb, _ = b.privatize(0, {})
    signal = sum(x["w"] * min(1.0, pl.clip_norm / float(x["w"].norm())) for x in u.values())
    err = float(((ma["w"] - mb["w"]) * M - signal).abs().max())
    print(f"  (mean_with - mean_without)*m - sum clip(u) = {err:.3g} (received {len(u)}, m {M})")
    if adaptive:  # zeta_{t+1} from zeta_t, the released count and constants only; the count's own stream
        p = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
        ok = True
        for t in range(N):
            z = p.clip_norm
            _, r = p.privatize(t, ups(t, 1.0, k=4))
            unclipped = sum(1 for x in r.contributed if not (x.clipped or x.zeroed))
            noise = count_noise(key_of(SEED), t, b"", pl.adaptive_clipping.count_noise_std)
            nxt = pl.adaptive_clipping.next_clip_norm(z, r.noisy_unclipped, M, initial_clip_norm=pl.clip_norm)
            ok &= (r.clip_norm == z and r.noisy_unclipped == unclipped + noise and p.clip_norm == nxt
                   and r.noise_std == pl.noise_std_at(z))
        print(f"  zeta rule / count stream / reported std per round exact: {ok}")

# bad states refused without side effects
pl = plan(True)
good = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
for t in range(2):
    good.privatize(t, ups(t, 1.0))
buf = io.BytesIO(); torch.save(good.state_dict(), buf); blob = buf.getvalue()
state = torch.load(io.BytesIO(blob), weights_only=False)


def bad_states():
    s = copy.deepcopy(state); s["adaptive_clipping"] = {"clip_norm": -1.0}; yield "negative zeta", s
    s = copy.deepcopy(state); del s["adaptive_clipping"]; yield "no zeta", s
    s = copy.deepcopy(state); s["adaptive_clipping"] = {"clip_norm": 1e30}; yield "zeta 1e30 (outside zeta0*[1/R, R])", s
    s = copy.deepcopy(state); s["noise"]["salts"] = s["noise"]["salts"][:1]; yield "salts cut", s
    s = copy.deepcopy(state); s["noise"]["seed_check"] = "00" * 16; yield "seed check", s


for name, s in bad_states():
    twin = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    probe = RoundPrivatizer(pl, {"w": (D,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    for p in (twin, probe):
        p.load_state_dict(copy.deepcopy(state))
    try:
        probe.load_state_dict(s)
        print(f"bad state '{name}': ACCEPTED, zeta now {probe.clip_norm:g} (bounds "
              f"{pl.adaptive_clipping.clip_norm_bounds(pl.clip_norm)})")
    except (CheckpointError, PlanMismatch) as e:
        same = probe.clip_norm == twin.clip_norm and probe.next_round == twin.next_round
        m1, _ = probe.privatize(probe.next_round, ups(9, 1.0))
        m2, _ = twin.privatize(twin.next_round, ups(9, 1.0))
        print(f"bad state '{name}': refused ({type(e).__name__}); unchanged: {same and torch.equal(m1['w'], m2['w'])}")

# secrets in the serialized state, the report and the policy
key = key_of(SEED)
print("seed in state:", SEED in blob, "| key in state:", key in blob, "| key hex in state:", key.hex().encode() in blob)
print("policy attributes:", sorted(vars(good.clipping)))
print("state keys:", sorted(state), sorted(state["noise"]))
