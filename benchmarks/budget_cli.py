"""Wall and CPU time of `fedmf budget` calls (process start to exit), median of repeats, for one or
more source trees side by side (interleaved, so that both suffer the same load).

    python benchmarks/budget_cli.py [--repeats 7] [--tree /path/to/checkout ...]

Each tree runs with PYTHONPATH set to it, on a fresh SQLite ledger with budgets set.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(tree: str, args: list[str]) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # cwd: not a source tree (python -m puts the working directory first on sys.path)
    subprocess.run([sys.executable, "-m", "fedmf.cli", *args], check=True, capture_output=True, env=env, cwd="/")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tree", action="append", help="a source tree (default: this checkout)")
    args = parser.parse_args()
    trees = args.tree or [str(Path(__file__).resolve().parents[1])]
    with tempfile.TemporaryDirectory() as tmp:
        ledger, key = f"{tmp}/ledger.db", f"{tmp}/budget.key"
        _run(trees[-1], ["budget", "default", "5", "--ledger", ledger, "--key", key])
        commands = {"set one user": ["budget", "set", "u1", "3", "--ledger", ledger, "--key", key],
                    "show (listing)": ["budget", "show", "--ledger", ledger, "--json"],
                    "look one user up by id": ["budget", "show", "--ledger", ledger, "--key", key, "--user", "u1"]}
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                for tree in trees:
                    try:
                        times.setdefault((name, tree), []).append(_run(tree, cmd))
                    except subprocess.CalledProcessError:  # a tree without this command
                        times.pop((name, tree), None)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print("| command | tree | median wall s | median CPU s (user+sys) | min wall s |")
    print("|---|---|---|---|---|")
    for (name, tree), values in times.items():
        if not values:
            continue
        walls, cpus = [w for w, _ in values], [c for _, c in values]
        print(f"| `fedmf {' '.join(commands[name][:2])}` ({name}) | {tree} | {statistics.median(walls):.3f} | "
              f"{statistics.median(cpus):.3f} | {min(walls):.3f} |")


if __name__ == "__main__":
    main()
