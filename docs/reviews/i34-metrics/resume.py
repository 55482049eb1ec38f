import pathlib
import sys
import tempfile

sys.path.insert(0, ".")
from fedmf import MinSep
from fedmf.errors import FedmfError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.run.federated import train
from tests import _federated_task as task

d = pathlib.Path(tempfile.mkdtemp())
p1 = task.plan(rounds=6, client_metrics=ClientMetricRelease.create(3.0, 5.0, expected_users=10))
train(task.Tiny(), task.users(), p1, task.local_update, checkpoint_dir=d / "run", rounds=2)
for label, rel in (("L", ClientMetricRelease.create(4.0, 5.0, expected_users=10)), ("sigma", ClientMetricRelease.create(3.0, 6.0, expected_users=10)), ("none", None)):
    p2 = task.plan(rounds=6, client_metrics=rel)
    try:
        train(task.Tiny(), task.users(), p2, task.local_update, checkpoint_dir=d / "run", rounds=4)
        print(label, "RESUMED (bad)")
    except FedmfError as e:
        print(label, "refused:", type(e).__name__, str(e)[:120])
S = MinSep(8, 4); mech = build("bsr", 64, S, num_bands=8)
for samp in ("poisson:0.1", "bminsep:0.5", "cyclic-poisson:0.5"):
    try:
        RunPlan.create(mech, S, clip_norm=1.0, delta=1e-6, expected_users=10, noise_multiplier=1.0, sampling=samp, client_metrics=ClientMetricRelease.create(1.0, 5.0, expected_users=10))
        print(samp, "accepted")
    except FedmfError as e:
        print(samp, "refused:", str(e)[:150])
