import math
import sys

sys.path.insert(0, ".")
import pathlib
import tempfile

from scipy.optimize import brentq
from scipy.stats import norm

from fedmf.audit.replay import audit
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.run.federated import train
from fedmf.tasks.base import LocalResult
from tests import _federated_task as task


def gdp_eps(mu, delta):
    return brentq(lambda e: norm.cdf(-e/mu + mu/2) - math.exp(e)*norm.cdf(-e/mu - mu/2) - delta, 0, 500)
d = pathlib.Path(tempfile.mkdtemp())
plan = task.plan(rounds=8, client_metrics=ClientMetricRelease.create(3.0, 5.0, expected_users=10))
def lu(params, user, t):
    u = task.local_update(params, user, t)
    return None if u is None else LocalResult(u, 1, {"train-loss": 31415.9265})
res = train(task.Tiny(), task.users(), plan, lu, checkpoint_dir=d / "run")
rep = audit(res.ledger, res.run_id)
k = plan.schema.participations(plan.rounds)
mu = math.sqrt(1/plan.noise_multiplier**2 + k*9/25)
print("k", k, "planned", rep.planned["epsilon"], "plan", plan.epsilon(), "gdp", gdp_eps(mu, plan.delta))
print({kk: v for kk, v in rep.realized.items() if "eps" in kk or "rho" in kk})
import subprocess

out = subprocess.run(["grep", "-rl", "31415", str(d)], capture_output=True, text=True).stdout
print("raw value found in files:", out or "none")
print([r.metrics for r in res.history][:3])
