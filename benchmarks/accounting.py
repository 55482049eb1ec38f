"""Accounting speed, in one run.

    python benchmarks/accounting.py [--workers 2] [--mc-samples 40000] [--certify-delta 1e-6]
                                    [--certify-rounds 64] [--skip-certify] [--skip-jax]
                                    [--only calibration|monte-carlo|certify] [--json]

1. Calibration of a banded mechanism with n = 2048 (BSR, 64 bands, MinSep(64, 32)):
   un-amplified and cyclic-Poisson, first call and repeated (cached) call; per-round spend.
2. Monte Carlo samples per second of the b-min-sep accountant (fedmf) vs jax_privacy's
   Monte Carlo accountant (jax_privacy.experimental.monte_carlo.sample_generation) on the
   same case, in the same run, with both divergence directions (a "pair" = one sample
   of each direction: jax_privacy draws them separately, fedmf shares the Gaussian draw).
   Also their delta estimates on a 2-band case (where jax_privacy's tail norms are right).
3. Wall time to certify delta = 1e-6 (EVR: pilot + verification of the candidates, each
   with the minimum number of samples for the target) on a small case.
jax_privacy is used here for comparison only; fedmf never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from fedmf import MinSep
from fedmf.accounting import calibrate, epsilon_by_round, evr
from fedmf.accounting.bminsep import BMinSep
from fedmf.accounting.montecarlo import MonteCarloAccountant
from fedmf.mechanisms import build


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - started


def bench_calibration() -> dict:
    schema = MinSep(64, 32)
    mechanism = build("bsr", 2048, schema, num_bands=64)
    out: dict = {"mechanism": "bsr, n=2048, 64 bands, MinSep(64, 32)", "target": "(2.0, 1e-6)"}
    res, first = timed(calibrate, mechanism, 2.0, 1e-6, schema)
    _, again = timed(calibrate, mechanism, 2.0, 1e-6, schema)
    out["unamplified"] = {"noise_multiplier": res.noise_multiplier, "first_s": first, "repeat_s": again}
    res, first = timed(calibrate, mechanism, 2.0, 1e-6, schema, sampling="cyclic-poisson:0.5")
    _, again = timed(calibrate, mechanism, 2.0, 1e-6, schema, sampling="cyclic-poisson:0.5")
    out["cyclic_poisson_q0.5"] = {"noise_multiplier": res.noise_multiplier, "first_s": first, "repeat_s": again}
    by_round, per_round_s = timed(epsilon_by_round, mechanism, 1.0, 1e-6, schema)
    out["per_round"] = {"rounds": 2048, "seconds": per_round_s, "method": by_round.method,
                        "final_epsilon": float(by_round.epsilons[-1])}
    return out


def _jax_pairs(coefficients, n, b, p, sigma, samples, seed):
    from jax_privacy import batch_selection
    from jax_privacy.experimental.monte_carlo import sample_generation as sg

    strategy = batch_selection.BMinSepSampling(sampling_prob=p, iterations=n, min_sep=b, warm_start=False)
    c = np.asarray(coefficients, dtype=np.float64)
    started = time.perf_counter()
    pos, _ = sg.get_privacy_loss_sample(strategy, sigma, c, seed=seed, positive_sample=True, num_samples=samples)
    mid = time.perf_counter()
    neg, _ = sg.get_privacy_loss_sample(strategy, sigma, c, seed=seed + 1, positive_sample=False,
                                        num_samples=samples)
    end = time.perf_counter()
    return np.asarray(pos), np.asarray(neg), mid - started, end - mid


def bench_monte_carlo(samples: int, workers: int, skip_jax: bool) -> dict:
    out: dict = {"cases": []}
    cases = [
        ("4-band BSR-like c, n=512, b=8, p=0.02, sigma=1", [1.0, 0.5, 0.375, 0.3125], 512, 8, 0.02, 1.0),
        ("DP-SGD (c=[1]), n=512, b=1, p=0.02, sigma=1", [1.0], 512, 1, 0.02, 1.0),
        ("2-band c, n=128, b=4, p=0.05, sigma=0.8", [1.0, 0.5], 128, 4, 0.05, 0.8),
    ]
    for name, c, n, b, p, sigma in cases:
        row: dict = {"case": name, "samples": samples}
        scheme = BMinSep.from_coefficients(c, n, b, p)
        MonteCarloAccountant(scheme).losses(sigma, 2000, seed=0)  # warm-up (imports, caches)
        ours, t1 = timed(MonteCarloAccountant(scheme, workers=1).losses, sigma, samples, seed=1, epsilons=(1.0,))
        row["fedmf_pairs_per_s_1_worker"] = samples / t1
        if workers > 1:
            _, tw = timed(MonteCarloAccountant(scheme, workers=workers).losses, sigma, samples, seed=2)
            row[f"fedmf_pairs_per_s_{workers}_workers"] = samples / tw
        row["fedmf_delta_at_eps1"] = list(ours.exact[1.0])
        if not skip_jax:
            pos, neg, tp, tn = _jax_pairs(c, n, b, p, sigma, samples, seed=3)
            row["jax_privacy_positive_per_s"] = samples / tp
            row["jax_privacy_negative_per_s"] = samples / tn
            row["jax_privacy_pairs_per_s"] = samples / (tp + tn)
            row["jax_privacy_delta_at_eps1"] = [float(np.mean(-np.expm1(np.minimum(1.0 - pos, 0)))),
                                                float(np.mean(-np.expm1(np.minimum(1.0 - neg, 0))))]
            row["speedup_1_worker"] = row["fedmf_pairs_per_s_1_worker"] / row["jax_privacy_pairs_per_s"]
            if workers > 1:
                row[f"speedup_{workers}_workers"] = row[f"fedmf_pairs_per_s_{workers}_workers"] / \
                    row["jax_privacy_pairs_per_s"]
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
    return out


def bench_certify(delta: float, workers: int, rounds: int) -> dict:
    """EVR calibration at (eps=2, delta) for a 2-band C, b=4, p=0.05 with one candidate
    below the analytic fallback (so: pilot steps of s/16 samples + one verification of s
    samples per direction). More candidates cost one verification each."""
    from fedmf.accounting import gaussian

    c, b, p, eps = [1.0, 0.5], 4, 0.05, 2.0
    scheme = BMinSep.from_coefficients(c, rounds, b, p)
    acc = MonteCarloAccountant(scheme, workers=workers)
    samples = evr.minimum_samples(delta)
    sens = float(np.sqrt(sum(x * x for x in c) * -(-rounds // b)))
    fallback = gaussian.calibrate(eps, delta / 2) * sens
    result, seconds = timed(evr.calibrate, acc, eps, delta, fallback, samples=samples, candidates=1,
                            pilot_samples=max(200_000, samples // 16), seed=7)
    return {"case": f"2-band c={c}, n={rounds}, b={b}, p={p}, eps={eps}", "delta": delta, "samples": samples,
            "workers": workers, "seconds": seconds, "noise_multiplier": result.noise_multiplier,
            "verified": result.verified, "fallback_noise_multiplier": fallback,
            "overall_delta": result.overall_delta,
            "pilot_seconds": sum(s["seconds"] for s in result.pilot["steps"]),
            "verification_seconds": [v.seconds for v in result.verifications]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--mc-samples", type=int, default=40_000)
    parser.add_argument("--certify-delta", type=float, default=1e-6)
    parser.add_argument("--certify-rounds", type=int, default=64)
    parser.add_argument("--skip-certify", action="store_true")
    parser.add_argument("--skip-jax", action="store_true")
    parser.add_argument("--only", choices=("calibration", "monte-carlo", "certify"), help="run one part")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args()
    report: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "load_average": os.getloadavg()}}
    if args.only in (None, "calibration"):
        report["calibration"] = bench_calibration()
        print(json.dumps(report["calibration"]), flush=True)
    if args.only in (None, "monte-carlo"):
        report["monte_carlo"] = bench_monte_carlo(args.mc_samples, args.workers, args.skip_jax)
    if args.only == "certify" or (args.only is None and not args.skip_certify):
        report["certify"] = bench_certify(args.certify_delta, args.workers, args.certify_rounds)
        print(json.dumps(report["certify"]), flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
