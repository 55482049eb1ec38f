import statistics

import numpy as np
import torch

from fedmf import MinSep
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.count_noise import metric_noise
from fedmf.round.draws import key_of
from fedmf.round.privatize import RoundPrivatizer

S = MinSep(1, 200); mech = build("bsr", 200, S, num_bands=1)
layout = {"w": (2,)}
cm = ClientMetricRelease.create(2.0, 0.5, expected_users=4)
plan = RunPlan.create(mech, S, clip_norm=1.0, delta=1e-6, expected_users=4, noise_multiplier=1.0, client_metrics=cm)
p = RoundPrivatizer(plan, layout, seed=99, repeatable_noise=True, dtype=torch.float64)
u = lambda: {"w": torch.ones(2, dtype=torch.float64)}
vals = {"a": float("nan"), "b": -5.0, "c": 1e300, "d": True, "e": "7", "f": None, "g": [1.0], "h": float("inf"), "i": 1.5,
        "x": 2.0}  # x: value but no update
for t, (names, expect) in enumerate([(["a","b","c","h","i"], 0+0+2+0+1.5), (["d","e","f","g"], 1.0+2.0+0+0)]):
    mean, rep = p.privatize(t, {n: u() for n in names}, values=vals)
    noise = metric_noise(key_of(99), t, b"", 0.5)
    print(t, rep.noisy_client_metric, (expect + noise) / 4, rep.noisy_client_metric == (expect + noise)/4)
# rejected (not selected) user with a value
mean, rep = p.privatize(2, {"i": u(), "x": u()}, selected=["i"], values=vals)
print("not selected:", rep.noisy_client_metric, (1.5 + metric_noise(key_of(99), 2, b"", 0.5))/4, [x.status for x in rep.users])
# bad update (nan) from a user with a value: rejected
mean, rep = p.privatize(3, {"i": {"w": torch.tensor([float('nan'), 0.], dtype=torch.float64)}, "x": u()}, values=vals)
print("nan update:", rep.noisy_client_metric, (2.0 + metric_noise(key_of(99), 3, b"", 0.5))/4, [x.status for x in rep.users])
# huge update zeroed (contributed, zeroed): counts
mean, rep = p.privatize(4, {"i": {"w": torch.tensor([1e6, 0.], dtype=torch.float64)}}, values=vals)
print("zeroed update:", rep.noisy_client_metric, (1.5 + metric_noise(key_of(99), 4, b"", 0.5))/4, [(x.status, x.zeroed if hasattr(x,'zeroed') else x) for x in rep.users])
# salted: fresh noise each round and for a redone round; std check
q = RoundPrivatizer(plan, layout, seed=99, repeatable_noise=False, dtype=torch.float64)
draws = []
for t in range(200):
    mean, rep = q.privatize(t, {"i": u()}, values={"i": 1.0})
    draws.append(rep.noisy_client_metric * 4 - 1.0)
print("salted noise std", statistics.pstdev(draws), "mean", statistics.mean(draws), "expect 0.5")
# same seed, same round, different privatizer: differ?
r1 = RoundPrivatizer(plan, layout, seed=99, dtype=torch.float64).privatize(0, {"i": u()}, values={"i": 1.0})[1].noisy_client_metric
r2 = RoundPrivatizer(plan, layout, seed=99, dtype=torch.float64).privatize(0, {"i": u()}, values={"i": 1.0})[1].noisy_client_metric
print("two salted draws of round 0", r1, r2)
# abort/redo
z = RoundPrivatizer(plan, layout, seed=99, dtype=torch.float64)
z.begin(0, None); z.add("i", u()); m1, rep1 = z.finish({"i": 1.0})
print("type", type(rep1.noisy_client_metric))
for bad in (torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), complex(1, 1), 10**400, np.float32('nan'), torch.tensor(3.0)):
    try:
        print(repr(bad)[:30], cm.clipped(bad))
    except Exception as e:
        print("RAISES", repr(bad)[:30], type(e).__name__, e)
