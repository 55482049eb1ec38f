"""A run whose ζ hits both bounds of a small range (R = 1.2, η = 3) audits clean; the same recorded ζ
sequence replayed with another R (the legacy 1e6, or 1.5) is flagged: the audit replays the clamp with
the run's own R, read from the ledger's plan."""
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.getcwd())
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp()
from tests.test_review_i33 import USERS, _update

from fedmf import MinSep, Workload
from fedmf.audit.replay import audit, clip_norm_violations
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.run.federated import train
from tests import _federated_task as task

d = pathlib.Path(tempfile.mkdtemp()) / "r"
task.write_secrets(d, b"range")
schema = MinSep(2, None)
mech = build("bsr", 6, schema, Workload(momentum=0.0), num_bands=2)
rule = AdaptiveClipping.create(0.5, expected_users=3, count_noise_std=1.0, learning_rate=3.0, clip_norm_range=1.2)
plan = RunPlan.create(mech, schema, clip_norm=0.05, delta=1e-5, expected_users=3, noise_multiplier=0.7, adaptive_clipping=rule)
r = train(task.Tiny(), USERS, plan, _update, checkpoint_dir=d, repeatable_noise=True)
zetas = [0.05] + [h.metrics["clip-norm"] for h in r.history]
print("zeta", zetas)
print("at bounds:", sum(abs(z - 0.05 * 1.2) < 1e-12 or abs(z - 0.05 / 1.2) < 1e-12 for z in zetas))
rep = audit(r.ledger, r.run_id, verify=True)
rows = [{"round_index": x["round"], "clip_norm": x["clip_norm"], "noisy_unclipped": x["noisy_unclipped"]}
        for x in rep.rounds if x["status"] == "committed"]
print("recorded plan rule:", rep.realized.get("clip_norm_rule"), "flagged:", rep.flagged)
own = clip_norm_violations(rule.to_dict(), 0.05, 3, rows)
legacy = clip_norm_violations({k: v for k, v in rule.to_dict().items() if k != "clip_norm_range"}, 0.05, 3, rows)
other = clip_norm_violations({**rule.to_dict(), "clip_norm_range": 1.5}, 0.05, 3, rows)
print("violations own R:", own, "legacy R:", legacy, "R 1.5:", other)
assert own == [] and legacy and other
