"""Min-separation miscalibration: rmse at several real separations in [B0, B1] per strategy.

    python benchmarks/robust.py [--rounds 2000 --participations 5 --range 200:400]

Strategies (all exact sensitivity at every separation shown, via the Toeplitz closed form
or the banded closed form; 'bound' is printed where neither applies):
  robust (worst)   fedmf robust, worst case over the range
  robust (mean)    fedmf robust, mean over the range
  BandToep(B1)     banded Toeplitz optimized for MinSep(B1, k), B1 bands
  taper(B1)        the same with the App. H taper ("Scaling up BandMF")
  BLT(B0)          BLT optimized for MinSep(B0, k)
  BandToep(B0)     banded Toeplitz with B0 bands (valid for every separation >= B0)
"""

from __future__ import annotations

import argparse
import time

from fedmf.mechanisms.banded_toeplitz import optimize_banded_toeplitz
from fedmf.mechanisms.robust import optimize_robust, separation_grid, taper
from fedmf.mechanisms.toeplitz import BandedToeplitz
from fedmf.participation import MinSep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--participations", type=int, default=5)
    parser.add_argument("--range", default="200:400")
    args = parser.parse_args()
    n, k = args.rounds, args.participations
    b0, b1 = (int(x) for x in args.range.split(":"))
    seps = separation_grid(b0, b1, 5)

    strategies = {}
    t = time.perf_counter()
    strategies["robust (worst)"], _ = optimize_robust(n, b0, b1, participations=k, weighting="worst")
    times = {"robust (worst)": time.perf_counter() - t}
    t = time.perf_counter()
    strategies["robust (mean)"], _ = optimize_robust(n, b0, b1, participations=k, weighting="mean")
    times["robust (mean)"] = time.perf_counter() - t
    t = time.perf_counter()
    bt1, _ = optimize_banded_toeplitz(n, b1, MinSep(b1, k))
    times["BandToep(B1)"] = time.perf_counter() - t
    strategies["BandToep(B1)"] = bt1
    strategies["taper(B1)"] = BandedToeplitz(n, taper(bt1.coefficients, b0, b1))
    times["taper(B1)"] = times["BandToep(B1)"]
    try:
        from fedmf.mechanisms.blt_optimize import optimize_blt

        t = time.perf_counter()
        strategies["BLT(B0)"], _ = optimize_blt(n, MinSep(b0, k))
        times["BLT(B0)"] = time.perf_counter() - t
    except ImportError:
        pass
    t = time.perf_counter()
    strategies["BandToep(B0)"], _ = optimize_banded_toeplitz(n, b0, MinSep(b0, k))
    times["BandToep(B0)"] = time.perf_counter() - t

    header = " | ".join(f"b'={s}" for s in seps)
    print(f"n = {n}, k = {k}, real min-separation b' in [{b0}, {b1}]; rmse (noise multiplier 1, clip 1)\n")
    print(f"| strategy | {header} | worst case | optimize s |")
    print("|---|" + "---|" * (len(seps) + 2))
    for name, mech in strategies.items():
        cells, worst = [], 0.0
        for s in seps:
            ev = mech.evaluate(MinSep(s, k))
            worst = max(worst, ev["rmse"])
            cells.append(f"{ev['rmse']:.4f}" + ("" if ev["sensitivity_exact"] else " (bound)"))
        print(f"| {name} | " + " | ".join(cells) + f" | **{worst:.4f}** | {times[name]:.1f} |")


if __name__ == "__main__":
    main()
