import os
import pathlib
import struct
import sys
import tempfile

sys.path.insert(0, ".")
os.environ.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", RAY_USAGE_STATS_ENABLED="0", FLWR_HOME=tempfile.mkdtemp())
from tests import test_client_metrics as t


class MP:
    def __init__(self): self.undo = []
    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name))); setattr(obj, name, value)
    def restore(self):
        for o, n, v in reversed(self.undo): setattr(o, n, v)
VAL = t.SYBIL_LOSS
pats = [repr(VAL).encode(), b"2.71828", struct.pack("<d", VAL), struct.pack(">d", VAL)]
for name, over in (("default", {}), ("private", {"client-metrics": "private", "client-metrics-clip": 5.0, "client-metrics-noise": 0.5})):
    mp = MP(); tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        result, run_dir, log = t._serve(tmp, name, mp, 1e-300, **over)
    finally:
        mp.restore()
    hits = []
    for f in run_dir.rglob("*"):
        if f.is_file():
            b = f.read_bytes()
            hits += [(str(f.relative_to(run_dir)), p) for p in pats if p in b]
    metrics = {k: dict(v) for k, v in result.train_metrics_clientapp.items()}
    print(name, "hits:", hits, "log has value:", any(p.decode('latin1') in log for p in pats[:2]))
    print("  keys:", sorted({k for v in metrics.values() for k in v}))
    print("  log lines with 'loss':", [l for l in log.splitlines() if "loss" in l][:4])
