"""Load on one machine (issue 13 item 9): N SuperNodes (one user each) against one SuperLink on
insecure loopback, R rounds of the `tiny` task through `flwr run . deploy`, with the round time, the
resident memory of every Flower process (sampled from /proc/<pid>/status while the run goes) and the
check that nothing was lost: every round committed exactly once, every selected user contributed (no
drops, no rejections), and the ledger's participation rows equal the selections per round.

    FEDMF_LOAD_NODES=20 FEDMF_LOAD_ROUNDS=20 FEDMF_LOAD_REPORT=/tmp/load.json \\
        python -m pytest -m heavy tests/flower/test_load.py -s

Every process started is killed by PID on exit (tests/flower_harness.py)."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.flower.test_flower_app import ROOT, _values
from tests.flower_harness import Deployment, _cmdline, enrolled_users, tagged_pids

NODES = int(os.environ.get("FEDMF_LOAD_NODES", "20"))
ROUNDS = int(os.environ.get("FEDMF_LOAD_ROUNDS", "20"))
PER_ROUND = int(os.environ.get("FEDMF_LOAD_PER_ROUND", "10"))

_KINDS = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp", "flwr-clientapp", "flwr")


def _kind(pid: int) -> str:
    argv = _cmdline(pid).split()
    for a in argv[:3]:
        base = os.path.basename(a)
        if base in _KINDS:
            return base
    return "other"


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class _RssSampler(threading.Thread):
    """Every ``period`` s: VmRSS of each live process carrying the deployment's tag, by kind."""

    def __init__(self, tag: str, period: float = 0.5):
        super().__init__(daemon=True)
        self.tag, self.period = tag, period
        self.stop = threading.Event()
        self.peak: dict[int, tuple[str, int]] = {}  # pid -> (kind, peak KiB)
        self.concurrent_clientapps = 0
        self.total_kib_peak = 0

    def run(self) -> None:
        while not self.stop.is_set():
            total, clientapps = 0, 0
            for pid in tagged_pids(self.tag):
                rss = _rss_kib(pid)
                if rss is None:
                    continue
                kind = self.peak.get(pid, (None, 0))[0] or _kind(pid)
                self.peak[pid] = (kind, max(rss, self.peak.get(pid, (kind, 0))[1]))
                total += rss
                clientapps += kind == "flwr-clientapp"
            self.concurrent_clientapps = max(self.concurrent_clientapps, clientapps)
            self.total_kib_peak = max(self.total_kib_peak, total)
            self.stop.wait(self.period)

    def by_kind(self) -> dict[str, dict]:
        out: dict[str, list[int]] = {}
        for kind, kib in self.peak.values():
            out.setdefault(kind, []).append(kib)
        return {k: {"processes": len(v), "peak_rss_mib_median": round(statistics.median(v) / 1024, 1),
                    "peak_rss_mib_max": round(max(v) / 1024, 1)} for k, v in sorted(out.items())}


def _ts(s: str) -> datetime:
    return datetime.fromisoformat(s)


@pytest.mark.heavy
def test_many_supernodes_against_one_superlink(tmp_path):
    values = _values(tmp_path / "run", users=NODES, rounds=ROUNDS, per_round=PER_ROUND, **{"noise-multiplier": 0.3,
                                                                                           "reply-timeout": 300.0})
    enrollment, node_configs = enrolled_users(tmp_path / "users", [str(i) for i in range(NODES)])
    values.update({"user-enrollment": str(enrollment), "identity-timeout": 120.0})
    t0 = time.monotonic()
    with Deployment(tmp_path / "flwr", node_configs, ready_timeout=180) as d:
        startup_s = time.monotonic() - t0
        sampler = _RssSampler(d.tracker.tag)
        sampler.start()
        t1 = time.monotonic()
        try:
            result = d.run(ROOT, values, timeout=60 * 30)
        finally:
            sampler.stop.set()
            sampler.join()
        run_s = time.monotonic() - t1
    wall_s = time.monotonic() - t0
    assert result.rc == 0, result.output[-3000:]

    # the ServerApp's progress lines: "fedmf round t (t+1/R done) ... users contributed/selected rejected r dropped d"
    text = result.output + "".join(result.logs.values())
    progress = {int(m[1]): (int(m[2]), int(m[3]), int(m[4]), int(m[5]))
                for m in re.finditer(r"fedmf round (\d+) \(\d+/\d+ done\) .*?users (\d+)/(\d+)\s+rejected (\d+)"
                                     r"\s+dropped (\d+)", text)}

    db = sqlite3.connect(tmp_path / "run" / "ledger.db")
    (run_id,) = db.execute("SELECT max(id) FROM runs").fetchone()
    rounds = db.execute("SELECT round_index, status, attempts, opened_at, closed_at, selected, contributed, dropped,"
                        " rejected FROM rounds WHERE run_id = ? ORDER BY round_index", (run_id,)).fetchall()
    parts = dict(((t, s), n) for t, s, n in db.execute(
        "SELECT round_index, status, count(*) FROM participations WHERE run_id = ? GROUP BY round_index, status",
        (run_id,)))
    db.close()

    assert [r[0] for r in rounds] == list(range(ROUNDS))
    for t, status, attempts, _, _, selected, contributed, dropped, rejected in rounds:
        assert (status, attempts) == ("committed", 1), (t, status, attempts)  # committed exactly once
        assert selected > 0 and (contributed, dropped, rejected) == (selected, 0, 0), (t, selected, contributed)
        assert parts.get((t, "contributed"), 0) == selected, t
        assert parts.get((t, "dropped"), 0) == parts.get((t, "rejected"), 0) == 0, t
        if progress:  # the scheduler's selection as the ServerApp reported it
            assert progress[t] == (selected, selected, 0, 0), (t, progress.get(t))
    assert len(progress) in (0, ROUNDS), sorted(progress)

    open_close = [(_ts(r[4]) - _ts(r[3])).total_seconds() for r in rounds]
    commit_gaps = [(_ts(b[4]) - _ts(a[4])).total_seconds() for a, b in zip(rounds, rounds[1:])]
    report = {
        "nodes": NODES, "rounds": ROUNDS, "clients_per_round": PER_ROUND, "cpus": os.cpu_count(),
        "loadavg_after": os.getloadavg(),
        "selected_per_round": [r[5] for r in rounds],
        "progress_lines": len(progress),
        "startup_s": round(startup_s, 1), "flwr_run_s": round(run_s, 1), "wall_s": round(wall_s, 1),
        "round_open_to_commit_s": {"median": round(statistics.median(open_close), 2),
                                   "min": round(min(open_close), 2), "max": round(max(open_close), 2)},
        "commit_to_commit_s_median": round(statistics.median(commit_gaps), 2) if commit_gaps else None,
        "rss": sampler.by_kind(), "max_concurrent_clientapps": sampler.concurrent_clientapps,
        "peak_total_rss_mib": round(sampler.total_kib_peak / 1024, 1),
    }
    print(json.dumps(report, indent=1))
    if os.environ.get("FEDMF_LOAD_REPORT"):
        Path(os.environ["FEDMF_LOAD_REPORT"]).write_text(json.dumps(report, indent=1))
    assert sampler.by_kind().get("flower-supernode", {}).get("processes") == NODES
