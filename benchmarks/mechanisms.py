"""Strategy optimization: fedmf vs jax_privacy, side by side in one process.

    python benchmarks/mechanisms.py [--repeats 3] [--kinds banded-toeplitz,banded,blt,dense,dense-many] [--max-n 100000]

For each case both optimizers run ``repeats`` times (after one untimed warm-up each, so
jax's compilation is excluded from its medians — the first-call time is printed too);
both results are evaluated by fedmf under the same schema and definitions
(loss = (1/n)·||A C^-1||_F^2·sens^2). jax_privacy is optional (the ``bench`` extra);
without it only fedmf's times are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from fedmf.mechanisms.banded import ColumnNormalizedBanded, optimize_banded
from fedmf.mechanisms.banded_toeplitz import optimize_banded_toeplitz
from fedmf.mechanisms.toeplitz import BandedToeplitz
from fedmf.participation import FixedEpoch, MinSep

try:
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import banded as jp_banded
    from jax_privacy.matrix_factorization import buffered_toeplitz as jp_blt
    from jax_privacy.matrix_factorization import dense as jp_dense
    from jax_privacy.matrix_factorization import toeplitz as jp_toeplitz

    HAVE_JAX = True
except ImportError:  # the bench extra is not installed
    HAVE_JAX = False


def _timed(fn: Callable[[], object], repeats: int) -> tuple[object, float, float]:
    """(result, first-call seconds, median seconds of ``repeats`` further calls)."""
    start = time.perf_counter()
    result = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, first, statistics.median(times) if times else first


def case_banded_toeplitz(n: int, repeats: int) -> dict:
    k = 4
    b = n // k
    p = min(64, b)
    schema = MinSep(b, k)
    ours, first, med = _timed(lambda: optimize_banded_toeplitz(n, p, schema)[0], repeats)
    row = {"kind": "banded-toeplitz", "case": f"n={n} k={k} b={b} p={p}", "ours_loss": ours.loss(schema),
           "ours_s": med, "ours_first_s": first}
    if HAVE_JAX:
        coef, jfirst, jmed = _timed(lambda: np.asarray(jp_toeplitz.optimize_banded_toeplitz(n, p)), repeats)
        row.update(jax_loss=BandedToeplitz(n, coef / coef[0]).loss(schema), jax_s=jmed, jax_first_s=jfirst)
    return row


def case_banded(n: int, repeats: int) -> dict:
    k = 4
    b = n // k
    p = min(16, b)
    schema = MinSep(b, k)
    ours, first, med = _timed(lambda: optimize_banded(n, p, schema)[0], repeats)
    row = {"kind": "banded", "case": f"n={n} k={k} b={b} p={p}", "ours_loss": ours.loss(schema),
           "ours_s": med, "ours_first_s": first}
    if HAVE_JAX and n <= 1024:
        def theirs():
            strategy = jp_banded.optimize(n, bands=p)
            c = np.asarray(strategy.materialize())
            bands = np.zeros((p, n))
            for r in range(p):
                bands[r, : n - r] = np.diagonal(c, -r)
            return ColumnNormalizedBanded(n, bands)

        mech, jfirst, jmed = _timed(theirs, repeats)
        row.update(jax_loss=mech.loss(schema), jax_s=jmed, jax_first_s=jfirst)
    return row


def case_dense(n: int, repeats: int) -> dict:
    from fedmf.mechanisms.dense_optimize import optimize_dense

    k = {128: 2, 1024: 4, 2052: 6}.get(n, 2)
    schema = FixedEpoch(k, n // k)
    def ours_strategy():  # same work as jax's dense.optimize: the optimized strategy matrix C
        mech = optimize_dense(n, schema)[0]
        mech.strategy_matrix()
        return mech

    ours, first, med = _timed(ours_strategy, repeats if n <= 1024 else 0)
    row = {"kind": "dense", "case": f"n={n} k={k} b={n // k}", "ours_loss": ours.loss(schema),
           "ours_s": med, "ours_first_s": first}
    if HAVE_JAX and n <= 128:
        from fedmf.mechanisms.base import Mechanism  # noqa: F401

        c, jfirst, jmed = _timed(lambda: np.asarray(jp_dense.optimize(n, epochs=k)), repeats)
        row.update(jax_loss=_dense_loss(c, schema), jax_s=jmed, jax_first_s=jfirst)
    return row


def _dense_loss(c: np.ndarray, schema: FixedEpoch) -> float:
    """loss of an explicit strategy C under fixed-epoch participation (prefix workload)."""
    n = c.shape[0]
    x = c.T @ c
    sens2 = max(float(np.abs(x[np.ix_(p, p)]).sum()) for p in schema.patterns())
    b = np.tril(np.ones((n, n))) @ np.linalg.inv(c)
    return float(np.sum(b**2)) / n * sens2


def case_dense_many(n: int, k: int, repeats: int, momentum: bool = False) -> dict:
    """Dense with many participations (k > 12, fedmf's block dual) against jax_privacy's
    orthogonality-masked primal; jax only for n <= 128 (its L-BFGS on n x n takes minutes beyond)."""
    from fedmf.mechanisms.dense_optimize import optimize_dense
    from fedmf.workloads import Workload

    workload = Workload(0.95, 0.25) if momentum else Workload()
    schema = FixedEpoch(k, n // k)

    def ours_strategy():
        mech = optimize_dense(n, schema, workload)[0]
        mech.strategy_matrix()
        return mech

    ours, first, med = _timed(ours_strategy, repeats if n <= 1024 else 0)
    report = ours.evaluate(schema)
    label = "dense-many" + (" (momentum)" if momentum else "")
    row = {"kind": label, "case": f"n={n} k={k} b={n // k}", "ours_loss": report["loss"], "ours_s": med,
           "ours_first_s": first}
    if HAVE_JAX and n <= 128:
        a = workload.matrix(n)
        c, jfirst, jmed = _timed(lambda: np.asarray(jp_dense.optimize(n, epochs=k, A=jax.numpy.asarray(a))), repeats)
        loss, exact = _explicit_loss(c, a, schema)
        row.update(jax_loss=loss, jax_s=jmed, jax_first_s=jfirst)
        row["case"] += f" (sens exact: fedmf {report['sensitivity_exact']}, jax {exact})"
    return row


def _explicit_loss(c: np.ndarray, a: np.ndarray, schema: FixedEpoch) -> tuple[float, bool]:
    """(loss, sensitivity exact) of an explicit strategy C for workload A under fixed-epoch
    participation, with fedmf's sensitivity for updates of any dimension (pattern_sensitivity)."""
    from fedmf.sensitivity import pattern_sensitivity

    n = c.shape[0]
    x = c.T @ c
    sens = [pattern_sensitivity(x[np.ix_(p, p)]) for p in schema.patterns()]
    b = a @ np.linalg.inv(c)
    return float(np.sum(b**2)) / n * max(s.value for s in sens) ** 2, all(s.exact for s in sens)


def case_blt(n: int, repeats: int, k: int = 1) -> dict:
    from fedmf.mechanisms.blt_optimize import optimize_blt

    b = n // k
    schema = MinSep(b, k)
    error = "max" if n >= 10**6 else "mean"
    ours, first, med = _timed(lambda: optimize_blt(n, schema, error=error)[0], repeats)
    metric = (lambda m: m.max_error(schema) ** 2) if error == "max" else (lambda m: m.loss(schema))
    row = {"kind": "blt", "case": f"n={n} k={k} b={b} ({error} error)", "ours_loss": metric(ours),
           "ours_s": med, "ours_first_s": first}
    if HAVE_JAX:
        from fedmf.mechanisms.blt import BufferedLinearToeplitz

        def theirs():
            blt = jp_blt.optimize(n=n, min_sep=b, max_participations=k, error=error)
            return np.asarray(blt.buf_decay), np.asarray(blt.output_scale)

        (decay, scale), jfirst, jmed = _timed(theirs, repeats)
        mech = BufferedLinearToeplitz.from_output_scale(n, scale, decay)
        row.update(jax_loss=metric(mech), jax_s=jmed, jax_first_s=jfirst)
    return row


CASES: dict[str, list[tuple[int, Callable[[int], dict]]]] = {
    "banded-toeplitz": [(n, lambda r, n=n: case_banded_toeplitz(n, r)) for n in (128, 1024, 2052, 10_000, 100_000)],
    "banded": [(n, lambda r, n=n: case_banded(n, r)) for n in (128, 1024, 2052, 10_000)],
    "dense": [(n, lambda r, n=n: case_dense(n, r)) for n in (128, 2052)],
    "dense-many": [(128, lambda r: case_dense_many(128, 32, r)), (128, lambda r: case_dense_many(128, 32, r, True)),
                   (64, lambda r: case_dense_many(64, 16, r)), (2000, lambda r: case_dense_many(2000, 20, r))],
    "blt": [(n, lambda r, n=n: case_blt(n, r)) for n in (128, 1024, 10_000, 100_000, 1_000_000)]
    + [(1024, lambda r: case_blt(1024, r, k=4))],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(CASES))
    parser.add_argument("--max-n", type=int, default=10**6)
    args = parser.parse_args()
    print(f"jax_privacy installed: {HAVE_JAX}; repeats {args.repeats}")
    print("| kind | case | fedmf loss | jax loss | loss ratio | fedmf s (median) | jax s (median) | jax first call s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for n, case in CASES[kind]:
            if n > args.max_n:
                continue
            row = case(args.repeats)
            jl, js = row.get("jax_loss"), row.get("jax_s")
            ratio = f"{row['ours_loss'] / jl:.6f}" if jl else "-"
            jfirst = "-" if js is None else f"{row['jax_first_s']:.3f}"
            speed = f"{js / row['ours_s']:.1f}x" if js else "-"
            print(
                f"| {row['kind']} | {row['case']} | {row['ours_loss']:.6g} | {jl if jl is None else f'{jl:.6g}'} | "
                f"{ratio} | {row['ours_s']:.4f} | {'-' if js is None else f'{js:.4f}'} | "
                f"{jfirst} | {speed} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
