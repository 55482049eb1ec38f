"""Wall time of `fedmf mechanism ...` commands (process start to exit), median of repeats.

    python benchmarks/cli.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [
    ["mechanism", "bisr", "--rounds", "1024", "--participations", "64", "--min-sep", "16", "--json"],
    ["mechanism", "bifr", "--rounds", "1024", "--participations", "64", "--min-sep", "16", "--json"],
    ["mechanism", "bifr", "--rounds", "2052", "--participations", "6", "--min-sep", "342", "--bands", "64", "--json"],
    ["mechanism", "bifr", "--rounds", "2052", "--participations", "6", "--min-sep", "342", "--bands", "64",
     "--workload", "momentum:0.95:cooldown=0.25", "--json"],
    ["mechanism", "tree", "--rounds", "1024", "--participations", "64", "--min-sep", "16", "--json"],
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("| command | median wall s | min | max |")
    print("|---|---|---|---|")
    for cmd in COMMANDS:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "fedmf.cli", *cmd], check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        print(f"| `fedmf {' '.join(cmd)}` | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |")


if __name__ == "__main__":
    main()
