"""fedmf.run.federated.train end to end (tree chosen by PYTHONPATH), every secret from a deterministic
stand-in for secrets.token_bytes; dumps the final model and every round's released record (clip-norm included):
    PYTHONPATH=<tree> python docs/reviews/i35-clipping/train_e2e.py OUT.pt
Also (salted=False only) a run stopped after 4 rounds and resumed from its checkpoint directory."""
import hashlib
import math
import secrets
import sys
import tempfile

import torch

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.run.federated import train

ROUNDS, USERS = 8, [f"user{i}" for i in range(10)]


def fake_secrets():
    counter = iter(range(10**6))
    secrets.token_bytes = lambda n=32: hashlib.sha256(b"e2e-%d" % next(counter)).digest()[:n]


def local_update(params, user, t):
    i = int(user[4:])
    if (i + t) % 7 == 0:
        return None  # dropout
    g = torch.Generator().manual_seed(100 * t + i)
    out = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) * (0.05 * (1 + i)) for k, v in params.items()}
    k0 = next(iter(out))
    if i == 3:
        out[k0].view(-1)[t % out[k0].numel()] = 1e4  # zeroed
    if i == 5 and t % 2:
        out[k0].view(-1)[0] = math.nan  # rejected
    return out, {"train-loss": 0.1 * i}


def run(adaptive, dtype, salted, metrics, rounds_stop=None, directory=None):
    # the release witness kept beside the run (deterministic secrets: never in the user's state directory)
    schema = MinSep(2, ROUNDS)
    plan = RunPlan.create(build("bsr", ROUNDS, schema, Workload(), num_bands=2), schema, clip_norm=0.5, delta=1e-5,
                          expected_users=5, noise_multiplier=0.8,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=5) if adaptive else None,
                          client_metrics=ClientMetricRelease.create(1.0, expected_users=5) if metrics else None)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(dtype)
    records = []
    train(model, USERS, plan, local_update, checkpoint_dir=directory, rounds=rounds_stop,
                repeatable_noise=not salted, on_round=records.append, ledger_diagnostics=True,
                witness=f"{directory}/witness")
    out = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "records": [(r.round, r.epsilon, r.selected, r.contributed, r.dropped, r.rejected, r.clipped, r.zeroed,
                        dict(r.metrics)) for r in records]}
    return out


if __name__ == "__main__":
    results = {}
    real = secrets.token_bytes
    for adaptive in (False, True):
        for dtype in (torch.float32, torch.float64):
            for salted in (False, True):
                metrics = salted
                fake_secrets()
                with tempfile.TemporaryDirectory() as d:
                    r = run(adaptive, dtype, salted, metrics, directory=d)
                if not salted:  # stop after 4 rounds, resume in a new train() call from the same directory
                    fake_secrets()
                    with tempfile.TemporaryDirectory() as d:
                        run(adaptive, dtype, salted, metrics, rounds_stop=4, directory=d)
                        r["resumed_params"] = run(adaptive, dtype, salted, metrics, directory=d)["params"]
                results[(adaptive, str(dtype), salted)] = r
    secrets.token_bytes = real
    torch.save(results, sys.argv[1])
