"""optimize_blt vs jax_privacy's buffered_toeplitz.optimize, in one process, medians of 3.

Both BLTs are scored by fedmf's evaluator (loss = error^2 x sens^2 under MinSep(b, k)), and
jax_privacy's own LossFn value is printed alongside as a cross-check. Needs the `bench`
extra (jax-privacy). Usage: python benchmarks/blt_vs_jax_privacy.py [--reps 3] [--only N]
Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

from jax_privacy.matrix_factorization import buffered_toeplitz as bt  # noqa: E402

from fedmf.mechanisms.blt import BufferedLinearToeplitz  # noqa: E402
from fedmf.mechanisms.blt_optimize import optimize_blt  # noqa: E402
from fedmf.participation import MinSep  # noqa: E402

# (n, b, k, error)
CONFIGS = [
    (128, 128, 1, "mean"),
    (128, 64, 2, "mean"),
    (1024, 1024, 1, "mean"),
    (1024, 256, 4, "mean"),
    (100_000, 100_000, 1, "mean"),
    (100_000, 25_000, 4, "mean"),
    (1_000_000, 1_000_000, 1, "max"),
]


def _score(blt: BufferedLinearToeplitz, schema: MinSep, error: str) -> float:
    return blt.loss(schema) if error == "mean" else blt.max_error(schema) ** 2


def _theirs(n: int, b: int, k: int, error: str) -> tuple[float, BufferedLinearToeplitz, float, int]:
    started = time.perf_counter()
    blt = bt.optimize(n=n, min_sep=b, max_participations=k, error=error)
    seconds = time.perf_counter() - started
    if k == 1 and error == "max":
        loss_fn = bt.LossFn.build_closed_form_single_participation(n=n)
    else:
        loss_fn = bt.LossFn.build_min_sep(n=n, error=error, min_sep=b, max_participations=k)
    own = float(loss_fn.loss(blt))
    ours = BufferedLinearToeplitz.from_output_scale(n, list(map(float, blt.output_scale)), list(map(float, blt.buf_decay)))
    return seconds, ours, own, len(blt.buf_decay)


def run(n: int, b: int, k: int, error: str, reps: int) -> dict:
    schema = MinSep(b, k)
    rows = {"ours": [], "jax_privacy": []}
    for _ in range(reps):
        started = time.perf_counter()
        blt, result = optimize_blt(n, schema, error=error)
        rows["ours"].append((time.perf_counter() - started, _score(blt, schema, error), blt.num_buffers, result.converged))
        seconds, theirs, own, m = _theirs(n, b, k, error)
        rows["jax_privacy"].append((seconds, _score(theirs, schema, error), m, own))
    out = {"n": n, "min_sep": b, "k": k, "error": error, "reps": reps}
    for name, r in rows.items():
        out[name] = {
            "seconds_median": statistics.median(x[0] for x in r),
            "seconds": [round(x[0], 3) for x in r],
            "loss": r[0][1],
            "buffers": r[0][2],
            ("converged" if name == "ours" else "own_loss"): r[0][3],
        }
    out["speedup"] = out["jax_privacy"]["seconds_median"] / out["ours"]["seconds_median"]
    out["loss_ratio"] = out["ours"]["loss"] / out["jax_privacy"]["loss"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", type=int, default=None, help="run the configurations with this n only")
    args = parser.parse_args()
    for n, b, k, error in CONFIGS:
        if args.only is None or args.only == n:
            print(json.dumps(run(n, b, k, error, args.reps)), flush=True)


if __name__ == "__main__":
    main()
