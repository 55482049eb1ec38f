"""MMCC speed: amplified epsilon of a banded Toeplitz C (BSR) under Poisson sampling.

    python benchmarks/mmcc.py [--rounds 128 512 2048] [--bands 8] [--p 0.0625] [--sigma 8]
                              [--delta 1e-6] [--budget 180] [--json]

One MMCC run (fedmf.accounting.mmcc, delta1 = delta2 = delta/2, grid 1e-3, PLD
discretization 1e-4) per n; prints seconds, epsilon, distinct row PLDs and max p~/p. Sizes
after one that took longer than --budget seconds are skipped.
"""

from __future__ import annotations

import argparse
import json
import platform

from fedmf import MinSep
from fedmf.accounting import mmcc
from fedmf.mechanisms import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--bands", type=int, default=8)
    parser.add_argument("--p", type=float, default=1 / 16)
    parser.add_argument("--sigma", type=float, default=8.0, help="noise std in clip-norm units")
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--budget", type=float, default=180.0, help="skip larger n after a slower run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows = []
    for n in args.rounds:
        if rows and rows[-1]["seconds"] > args.budget:
            rows.append({"rounds": n, "skipped": f"previous size took > {args.budget:g} s"})
            continue
        mech = build("bsr", n, MinSep(args.bands, -(-n // args.bands)), num_bands=args.bands)
        result = mmcc.epsilon(mech, args.p, args.sigma, args.delta)
        rows.append({"rounds": n, "bands": args.bands, "p": args.p, "sigma": args.sigma, "delta": args.delta,
                     "epsilon": result.epsilon, "distinct_rows": result.distinct_rows,
                     "max_ratio": result.max_ratio, "seconds": result.seconds})
        if not args.json:
            print(f"n={n:5d} bands={args.bands} p={args.p:g} sigma={args.sigma:g}: epsilon={result.epsilon:.4f} "
                  f"(delta={args.delta:g}) distinct rows={result.distinct_rows} max p~/p={result.max_ratio:.3f} "
                  f"{result.seconds:.1f} s", flush=True)
    if args.json:
        print(json.dumps({"platform": platform.platform(), "python": platform.python_version(), "rows": rows}))
    else:
        for row in rows:
            if "skipped" in row:
                print(f"n={row['rounds']:5d}: skipped ({row['skipped']})")


if __name__ == "__main__":
    main()
