"""server-lr beyond the model dtype's range (1e45 on float32): what the failure leaves."""
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.getcwd())
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp()
from tests.test_review_i33 import USERS, _plan, _rows, _update

from fedmf import MinSep
from fedmf.run.federated import train
from tests import _federated_task as task

d = pathlib.Path(tempfile.mkdtemp()) / "r"
task.write_secrets(d, b"lr")
plan = _plan(MinSep(2, None), adaptive=False)
try:
    train(task.Tiny(), USERS, plan, _update, checkpoint_dir=d, repeatable_noise=True, server_lr=1e45)
except Exception as e:
    print("first:", type(e).__name__, str(e)[:200])
print("ledger after the crash:", _rows(str(d / "ledger.db"), d, 1))
try:
    train(task.Tiny(), USERS, plan, _update, checkpoint_dir=d, repeatable_noise=True, server_lr=1.0)
except Exception as e:
    print("resume with server-lr 1:", type(e).__name__, str(e)[:200])
