"""Time of each command README.md documents, on this machine: run in order in a scratch directory,
each for at most ``--limit`` seconds. A command that finishes gets its wall time; one that does not is
stopped and extrapolated from its last progress line (``fedmf.run.progress``: done/total at the measured
rate, an upper bound at the step limit, and the convergence trend's estimate where it printed one).

    python benchmarks/readme_times.py [--limit 90] [--only TEXT] [--skip TEXT ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: README's commands, in its order (files they write feed the later ones)
COMMANDS = [
    "fedmf mechanism bisr --rounds 1024 --participations 64 --min-sep 16 --json",
    "fedmf mechanism bifr --rounds 2052 --participations 6 --min-sep 342 --workload momentum:0.95:cooldown=0.25 "
    "--out so.mech.json",
    "fedmf evaluate --mechanism so.mech.json --min-sep 200",
    "fedmf evaluate --mechanism so.mech.json --fixed-epoch --json",
    "fedmf mechanism banded-toeplitz --rounds 1024 --participations 4 --min-sep 256 --bands 64 --json",
    "fedmf mechanism banded --rounds 1024 --participations 4 --min-sep 256 --bands 16",
    "fedmf mechanism blt --rounds 100000 --participations 1 --json",
    "fedmf mechanism dense --rounds 2052 --participations 6 --min-sep 342 --out so.dense.json",
    "fedmf mechanism robust --rounds 2000 --participations 5 --min-sep-range 200:400 --json",
    "fedmf mechanism robust --rounds 2000 --participations 5 --min-sep-range 200:400 --taper",
    "fedmf epsilon --mechanism so.mech.json --noise-multiplier 2.0 --delta 1e-6 --per-round --json",
    "fedmf calibrate --mechanism so.mech.json --epsilon 4 --delta 1e-6 --json",
    "fedmf calibrate --mechanism so.mech.json --epsilon 4 --delta 1e-6 --json",
    "fedmf mechanism bsr --rounds 1024 --participations 4 --min-sep 256 --bands 8 --out bsr.mech.json",
    "fedmf epsilon --mechanism bsr.mech.json --noise-multiplier 1.0 --delta 1e-3 --sampling bminsep:0.1",
    "fedmf epsilon --mechanism bsr.mech.json --noise-multiplier 1.0 --delta 1e-6 --sampling cyclic-poisson:0.5",
    "fedmf epsilon --mechanism bsr.mech.json --noise-multiplier 4.0 --delta 1e-6 --sampling poisson:0.01",
    "fedmf simulate --preset tiny --out sim-tiny",
    "fedmf audit --ledger sim-tiny/ledger.db",
    "fedmf audit-empirical --preset tiny --canaries 200 --epsilon 2 --out fedmf-audit",
    "fedmf budget default 12 --ledger budgets.db --key budget.key",
    "fedmf budget set 0 1 2 3 4 5 6 7 8 9 20 --ledger budgets.db --key budget.key",
    "fedmf budget show --ledger budgets.db --key budget.key --user 3",
    "fedmf simulate --preset so-tiny --out fedmf-sim",
    "fedmf simulate --preset so-tiny --adaptive-clipping 0.5 --adaptive-clipping-max-growth 1 "
    "--adaptive-clipping-count-noise 12 --out so-tiny-adaptive",
    "fedmf simulate --preset so-small --out sim-so-small",
    "fedmf simulate --preset shakespeare --out sim-shakespeare",
]

_PROGRESS = re.compile(r"(\d+)/(\d+) (steps|rounds)\s+([\d.]+) (steps|rounds)/s|(\d+)/(\d+) (steps|rounds)\s+([\d.]+) "
                       r"s/(step|round)")
_TREND = re.compile(r"ETA ~(\S+)")


def _extrapolate(err: str) -> str:
    for line in reversed(err.splitlines()):
        m = _PROGRESS.search(line)
        if not m:
            continue
        if m.group(1):
            done, total, unit, rate = int(m.group(1)), int(m.group(2)), m.group(3), float(m.group(4))
        else:
            done, total, unit, rate = int(m.group(6)), int(m.group(7)), m.group(8), 1 / float(m.group(9))
        left = (total - done) / rate
        trend = _TREND.search(line)
        return (f"at {done}/{total} {unit}, {rate:.3g} {unit}/s: ≤ {left:.0f} s more to the limit"
                + (f", ~{trend.group(1)} more by the convergence trend" if trend else ""))
    return "no progress line"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=float, default=90.0)
    parser.add_argument("--only", help="run only the commands containing this text")
    parser.add_argument("--skip", action="append", default=[], help="skip the commands containing this text")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0"}
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedmf-readme-") as tmp:
        for command in COMMANDS:
            if (args.only and args.only not in command) or any(text in command for text in args.skip):
                continue
            argv = [sys.executable, "-m", "fedmf.cli", *command.split()[1:]]
            start = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            try:
                _, err = proc.communicate(timeout=args.limit)
                wall = time.perf_counter() - start
                print(f"| `{command}` | {wall:.1f} s (rc {proc.returncode}) |", flush=True)
            except subprocess.TimeoutExpired:
                proc.terminate()
                _, err = proc.communicate()
                wall = time.perf_counter() - start
                print(f"| `{command}` | stopped after {wall:.0f} s; {_extrapolate(err)} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
