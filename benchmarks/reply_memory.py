"""What one hostile oversized reply costs the ServerApp in peak memory, over real processes (issue 34, item 4).

    PYTHONPATH=$PWD python benchmarks/reply_memory.py                       # baseline, train, identity
    PYTHONPATH=$PWD python benchmarks/reply_memory.py --cases baseline train --factor 10 --json out.json

Each case is a fresh federation on loopback: an insecure SuperLink, two SuperNodes (Flower's default
subprocess isolation, one ``flwr-clientapp`` per message) with user ids 0 and 1, and one round of
``so-synthetic`` with the StackOverflow paper's LSTM (``model_size = "paper"``: 4,053,428
parameters, 16.2 MB in float32; two short sentences per user so that training is quick) through
``flwr run . deploy`` (``identity = "declared-insecure"``: the proofs are not what is measured).

* ``baseline``: both nodes honest;
* ``train``: node 1's TRAIN reply carries, besides its honest update, an extra ArrayRecord of
  ``factor`` × the model's float32 bytes (rejected by fedmf: an unexpected record);
* ``identity``: node 1's identity reply carries the same extra ArrayRecord (the server reads only
  the identity record of a reply).

The hostile node is an honest SuperNode whose ``flwr-clientapp`` processes load a
``sitecustomize`` hook (written by this script into the run's directory and put first on the
PYTHONPATH of every process of the federation; it acts only in processes whose node config has
``bench-hostile``) that adds the padding to the reply the real ClientApp built. The same hook
writes each process's ``VmHWM`` (peak resident set, /proc/self/status) at exit; the script also
polls the ``flwr-serverapp`` process's VmHWM every 0.1 s while it runs and reports the larger of
the two. Every process is started and killed by PID (``tests.flower_harness.Deployment``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.flower_cli import flower_env  # noqa: E402
from tests.flower_harness import Deployment  # noqa: E402

TASK_OPTIONS = {"num_users": 2, "model_size": "paper", "min_sentences": 1, "mean_sentences": 2.0,
                "max_sentences": 2, "eval_users": 1}
PARAMS = 4_053_428  # the paper model at vocab_size 10,000 (fedmf.tasks.models.PAPER_PARAMS)

HOOK = r'''
import atexit, os, sys

_hwm_dir = os.environ.get("FEDMF_BENCH_HWM_DIR")


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


if _hwm_dir:
    def _write_hwm():
        try:
            name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            with open(os.path.join(_hwm_dir, f"{name}-{os.getpid()}.kib"), "w") as f:
                f.write(str(_status("VmHWM")))
        except Exception:
            pass

    atexit.register(_write_hwm)

if sys.argv and os.path.basename(sys.argv[0]) == "flwr-clientapp":
    from flwr.clientapp import ClientApp

    _call = ClientApp.__call__

    def _hostile_call(self, message, context):
        reply = _call(self, message, context)
        mode = context.node_config.get("bench-hostile")
        kind = message.metadata.message_type
        if mode and reply.has_content() and ((mode == "train" and kind == "train") or
                                            (mode == "identity" and kind == "query")):
            import numpy as np
            from flwr.app import Array, ArrayRecord

            pad = int(context.node_config["bench-pad-bytes"])
            reply.content["padding"] = ArrayRecord({"padding": Array(np.ones(pad // 4, dtype=np.float32))})
        return reply

    ClientApp.__call__ = _hostile_call
'''


def _hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class _Poller(threading.Thread):
    """Polls the VmHWM of the deployment's flwr-serverapp processes every 0.1 s."""

    def __init__(self, deployment: Deployment) -> None:
        super().__init__(daemon=True)
        self.deployment, self.stop, self.peak_kib = deployment, threading.Event(), {}

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in self.deployment.serverapp_pids():
                value = _hwm_kib(pid)
                if value is not None:
                    self.peak_kib[pid] = max(value, self.peak_kib.get(pid, 0))
            time.sleep(0.1)


def run_case(case: str, factor: float, work: Path, timeout: float) -> dict:
    work.mkdir(parents=True)
    hook_dir, hwm_dir = work / "hook", work / "hwm"
    hook_dir.mkdir()
    hwm_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = flower_env(work / "flwr")
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), str(REPO)] + ([env["PYTHONPATH"]]
                                                                     if env.get("PYTHONPATH") else []))
    env["FEDMF_BENCH_HWM_DIR"] = str(hwm_dir)
    model_bytes = 4 * PARAMS
    hostile = {"user-id": "1"}
    if case != "baseline":
        hostile.update({"bench-hostile": case, "bench-pad-bytes": int(factor * model_bytes)})
    values = {"task": "so-synthetic", "task-options": json.dumps(TASK_OPTIONS), "mechanism": "bsr", "rounds": 1,
              "min-sep": 1, "clients-per-round": 2, "noise-multiplier": 1.0, "client-lr": 0.1, "batch-size": 2,
              "run-dir": str(work / "run"), "identity": "declared-insecure", "identity-timeout": 300.0,
              "reply-timeout": 600.0}
    started = time.monotonic()
    with Deployment(work / "flwr", [{"user-id": "0"}, hostile], env=env, ready_timeout=180) as d:
        poller = _Poller(d)
        poller.start()
        try:
            result = d.run(REPO, values, timeout=timeout)
        finally:
            poller.stop.set()
            poller.join()
    import sqlite3

    db = sqlite3.connect(work / "run" / "ledger.db")
    statuses = sorted(db.execute("SELECT status, reason FROM participations").fetchall(), key=str)
    db.close()
    at_exit = {p.name: int(p.read_text() or 0) for p in hwm_dir.glob("flwr-serverapp-*.kib")}
    peak = max(list(at_exit.values()) + list(poller.peak_kib.values()) + [0])
    return {"case": case, "rc": result.rc, "wall_s": round(time.monotonic() - started, 1),
            "serverapp_vmhwm_mib": round(peak / 1024, 1), "serverapp_vmhwm_at_exit_kib": at_exit,
            "serverapp_vmhwm_polled_kib": poller.peak_kib, "pad_bytes": hostile.get("bench-pad-bytes", 0),
            "model_float32_bytes": model_bytes,
            "ledger_participations": statuses,  # (status, reason): the hostile TRAIN reply is rejected
            "output_tail": None if result.rc == 0 else result.output[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["baseline", "train", "identity"],
                        choices=["baseline", "train", "identity"])
    parser.add_argument("--factor", type=float, default=10.0, help="padding, in model sizes (default 10)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per case, seconds")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="fedmf-reply-memory-") as tmp:
        for case in args.cases:
            results.append(run_case(case, args.factor, Path(tmp) / case, args.timeout))
            r = results[-1]
            print(f"{case:<9} rc {r['rc']}  ServerApp VmHWM {r['serverapp_vmhwm_mib']:.1f} MiB  "
                  f"pad {r['pad_bytes'] / 2**20:.1f} MiB  wall {r['wall_s']} s", flush=True)
            if r["output_tail"]:
                print(r["output_tail"], file=sys.stderr)
    base = next((r["serverapp_vmhwm_mib"] for r in results if r["case"] == "baseline"), None)
    if base is not None:
        for r in results:
            if r["case"] != "baseline":
                print(f"{r['case']}: +{r['serverapp_vmhwm_mib'] - base:.1f} MiB over the baseline "
                      f"({(r['serverapp_vmhwm_mib'] - base) * 2**20 / r['pad_bytes']:.2f} × the padding)")
    report = {"results": results, "factor": args.factor, "task_options": TASK_OPTIONS,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
