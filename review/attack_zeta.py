"""Hostile clients vs adaptive clipping (review of issue 25): drive ζ down with huge (zeroed) updates,
up with spread-out updates just above ζ, and look at what extreme ζ does to the privatizer."""
import math

import torch

from fedmf import MinSep, Workload
from fedmf.adaptive_clipping import AdaptiveClipping
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.privatize import RoundPrivatizer

D, M = 1000, 10


def plan(rounds, eta, gamma=0.5):
    schema = MinSep(1, rounds)
    mech = build("dp-sgd", rounds, schema, Workload())
    return RunPlan.create(mech, schema, clip_norm=1.0, delta=1e-5, expected_users=M, noise_multiplier=1.0,
                          adaptive_clipping=AdaptiveClipping.create(gamma, expected_users=M, learning_rate=eta,
                                                                    count_noise_std=0.5))


def run(rounds, eta, make_update, label):
    p = plan(rounds, eta)
    priv = RoundPrivatizer(p, {"w": (D,)}, dtype=torch.float32, seed=b"attack-seed-0123456789")
    first_bad = None
    for t in range(rounds):
        zeta = priv.clip_norm
        updates = {f"u{i}": {"w": make_update(zeta, i)} for i in range(M)}
        mean, rep = priv.privatize(t, updates)
        finite = bool(torch.isfinite(mean["w"]).all())
        if first_bad is None and (not finite or not (math.isfinite(priv.clip_norm) and priv.clip_norm > 0)):
            first_bad = (t, zeta, priv.clip_norm, finite)
    state = priv.state_dict()
    try:
        fresh = RoundPrivatizer(p, {"w": (D,)}, dtype=torch.float32, seed=b"attack-seed-0123456789")
        fresh.load_state_dict(state)
        resumable = "resumable"
    except Exception as e:  # noqa: BLE001
        resumable = f"NOT resumable: {type(e).__name__}: {e}"
    print(f"{label}: η={eta} after {rounds} rounds ζ={priv.clip_norm:.3g}; first non-finite/zero at {first_bad}; "
          f"{resumable}")


def huge(zeta, i):  # ℓ∞ > 100·ζ: zeroed, counted as 'unclipped' → pushes ζ down
    v = torch.zeros(D)
    v[0] = 1e30
    return v


def spread(zeta, i):  # ℓ2 = 2ζ, ℓ∞ = 2ζ/√D ≪ 100ζ: clipped, never zeroed → pushes ζ up
    return torch.full((D,), min(float(2 * zeta / math.sqrt(D)), 3.0e38), dtype=torch.float32)


def spread_const(zeta, i):  # a client that does not even know ζ: a constant huge spread-out update
    return torch.full((D,), 1e30 / math.sqrt(D), dtype=torch.float32) if zeta < 1e28 else torch.zeros(D)


if __name__ == "__main__":
    run(300, 0.2, huge, "all hostile, huge updates (default η)")
    run(300, 5.0, huge, "all hostile, huge updates")
    run(300, 0.2, spread, "all hostile, spread updates (default η)")
    run(300, 5.0, spread, "all hostile, spread updates")
