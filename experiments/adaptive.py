"""Adaptive clipping's feedback loop, measured per round, and the README example against the fixed-ζ main job
(issue 33, item 3).

    python experiments/adaptive.py run ARM [--seeds 0 1 2] [--rounds N] [--preset so-tiny] [--tag T]
                                           [--set key=value ...] [--eval-every K] [--trace]
    python experiments/adaptive.py report [--preset so-tiny]
    python experiments/adaptive.py paired ARM [--against fixed] [--last 5] [--preset so-tiny]

EXPERIMENTS.md ("Adaptive clipping that cannot run away") lists the exact commands run.

ARM names a configuration of ``ARMS`` (the preset's overrides). Each run records, per round: ζₜ, the
released noisy count b̃ₜ, the quantiles of the received update norms (the privatizer's reports: a
measurement, never released by a run), the norm of the released clipped sum Σ clip(Δᵢ, ζₜ)/m and of the
released noise ζₜ·z·sens·(C⁻¹Z)ₜ/m, and the held-out loss and accuracy. Secrets follow experiments/run.py
(``_write_secrets``: a seed fixes the noise seed and schedule key). Records: experiments/results/adaptive/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _write_secrets  # noqa: E402  (experiments/run.py: fixed secrets, one recipe for every experiment)

OUT = Path(__file__).resolve().parent / "results" / "adaptive"
#: arm → the preset overrides (the fixed-ζ main job, the README's adaptive example before issue 33, after its
#: first pass and the two steps between them, the second pass's screen and the README example now)
ARMS: dict[str, dict[str, Any]] = {
    "fixed": {},
    "readme-before": {"adaptive-clipping": 0.5, "clip-norm": 0.1, "adaptive-clipping-count-noise": 2.0,
                      "adaptive-clipping-range": 1e6},
    "readme-eta0.2-sb2": {"adaptive-clipping": 0.5, "clip-norm": 0.1, "adaptive-clipping-count-noise": 2.0},
    "readme-eta1-sb2": {"adaptive-clipping": 0.5, "clip-norm": 0.1, "adaptive-clipping-count-noise": 2.0,
                        "adaptive-clipping-lr": 1.0},
    "readme": {"adaptive-clipping": 0.5, "clip-norm": 0.1, "adaptive-clipping-count-noise": 6.0,
               "adaptive-clipping-lr": 1.0},
    "readme-eta2-sb12": {"adaptive-clipping": 0.5, "clip-norm": 0.1, "adaptive-clipping-count-noise": 12.0,
                         "adaptive-clipping-lr": 2.0},
    "readme-z0.25-R4-eta2-sb12": {"adaptive-clipping": 0.5, "clip-norm": 0.25, "adaptive-clipping-range": 4.0,
                                  "adaptive-clipping-count-noise": 12.0, "adaptive-clipping-lr": 2.0},
}
#: paired arms: an adaptive arm under the fixed arm's secrets (the same noise seed, so the same Z and the same
#: schedule): the difference from the fixed run of that seed is the rule's own, not another noise draw's
ARMS["readme-paired"] = ARMS["readme"]
ARMS["readme-z0.25-R4-eta2-sb12-paired"] = ARMS["readme-z0.25-R4-eta2-sb12"]
#: the third pass's screen: the same rule constants with the bound ζ₀·R = 0.5, half the fixed job's untuned ζ = 1
ARMS["readme-z0.25-R2-eta2-sb12-paired"] = {"adaptive-clipping": 0.5, "clip-norm": 0.25, "adaptive-clipping-range": 2.0,
                                            "adaptive-clipping-count-noise": 12.0, "adaptive-clipping-lr": 2.0}
#: the fourth pass: the README example's constants with the target quantile γ = 0.9 (every update clipped: the
#: climb is e^{ηγ} = e^{1.8} a round, and b̃ₜ/m > γ, the only way ζ leaves its bound, needs the count's noise
#: above γ/(σ_b/m) = 3 sd)
ARMS["readme-q0.9-z0.25-R4-eta2-sb12-paired"] = {**ARMS["readme-z0.25-R4-eta2-sb12"], "adaptive-clipping": 0.9}
#: its control: ζ pinned at 1 (ζ₀ 1, R 1), the count still released and accounted (z 0.6033): the fixed job but for
#: the count's 0.5% more noise, so the candidate's paired difference splits into the ramp's and the count's
ARMS["control-q0.9-z1-R1-eta2-sb12-paired"] = {**ARMS["readme-q0.9-z0.25-R4-eta2-sb12-paired"], "clip-norm": 1.0,
                                               "adaptive-clipping-range": 1.0}
#: the fifth pass: --clip-norm as a ceiling (G = 1: ζ never above ζ₀, the fixed job's ζ = 1), the paper's η = 0.2,
#: the count at σ_b = 12 (1% of μ² on so-tiny: z 0.6033 against 0.6002): ζ can only go below the fixed job's ζ
ARMS["ceiling-paired"] = {"adaptive-clipping": 0.5, "adaptive-clipping-max-growth": 1.0,
                          "adaptive-clipping-count-noise": 12.0}
#: the secrets label of an arm where it differs from its name (the runs were made under these names)
LABELS = {"readme-before": "readme", "readme-eta0.2-sb2": "readme_R10", "readme-eta1-sb2": "readme_R10_eta1",
          "readme": "readme_R10_eta1_sb6", "readme-paired": "fixed", "readme-z0.25-R4-eta2-sb12-paired": "fixed",
          "readme-z0.25-R2-eta2-sb12-paired": "fixed", "readme-q0.9-z0.25-R4-eta2-sb12-paired": "fixed",
          "control-q0.9-z1-R1-eta2-sb12-paired": "fixed", "ceiling-paired": "fixed"}


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _instrument(trace: list[dict[str, Any]]) -> None:
    """Record each round's norms and noise from inside the privatizer (measurement only)."""
    import torch

    from fedmf.round.privatize import RoundPrivatizer

    if getattr(RoundPrivatizer, "_traced", False):
        RoundPrivatizer._trace = trace
        return
    original = RoundPrivatizer.finish

    def finish(self, values: Any = None):
        report = self._open
        zeta = self.clip_norm
        m = self.plan.expected_users
        factor = self.clipping.sum_unit / m
        signal = self._sum.double().clone()
        mean, rep = original(self, values)
        flat = torch.cat([mean[k].reshape(-1).double() for k in self.layout])
        noise = flat - signal * factor
        norms = sorted(u.norm for u in report.contributed if u.norm is not None)

        def q(p):
            return norms[min(len(norms) - 1, int(p * len(norms)))] if norms else None

        RoundPrivatizer._trace.append({
            "round": rep.round, "zeta": zeta, "noisy_unclipped": rep.noisy_unclipped,
            "contributed": len(report.contributed),
            "unclipped": sum(1 for u in report.contributed if not (u.clipped or u.zeroed)),
            "norm_q10": q(0.1), "norm_q50": q(0.5), "norm_q90": q(0.9),
            "signal_norm": float(signal.norm()) * factor, "noise_norm": float(noise.norm())})
        return mean, rep

    RoundPrivatizer.finish = finish
    RoundPrivatizer._traced = True
    RoundPrivatizer._trace = trace


def run_one(preset: str, arm: str, seed: int, rounds: int | None, extra: dict[str, Any], out: Path,
            tag: str = "", eval_every: int = 1) -> dict[str, Any]:
    import torch

    from fedmf.config import RunConfig
    from fedmf.run.federated import train
    from fedmf.run.simulate import preset_values
    from fedmf.tasks import ClientHyper, get_task

    name = f"{preset}_{arm}{tag}_seed{seed}" + ("" if rounds is None else f"_r{rounds}")
    target = out / "runs" / f"{name}.json"
    if target.exists():
        return json.loads(target.read_text())
    torch.set_num_threads(1)
    run_dir = out / "tmp" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    _write_secrets(run_dir, f"adaptive/{preset}/{LABELS.get(arm, arm)}{tag}/{seed}")
    overrides = {**ARMS.get(arm, {}), **extra, "run-dir": str(run_dir)}
    if rounds is not None:
        overrides["rounds"] = rounds
    config = RunConfig.from_mapping(preset_values(preset, overrides))
    task = get_task(config.task, **config.task_options)
    plan = config.build_plan()
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    trace: list[dict[str, Any]] = []
    _instrument(trace)
    evals: dict[int, dict[str, float]] = {}
    model = task.model()
    with torch.no_grad():
        initial = {k: float(v) for k, v in task.evaluate(model).items()}

    keys: set[str] = set()

    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        metrics = {k: float(v) for k, v in task.evaluate(m).items()}
        keys.update(metrics)
        return metrics

    started = time.perf_counter()
    # train picks the rounds to evaluate (every eval_every-th and the last) and files each evaluation under its
    # round; it also evaluates the initial model once (the learning check): a count of the calls would be off by one
    result = train(model, task.users(), plan, None, local_updates=task.as_local_updates(hyper, vectorized=False),
                   server_lr=config.server_lr, checkpoint_dir=run_dir, evaluate=evaluate, observed_guard=False,
                   repeatable_noise=True, evaluate_every=eval_every)
    seconds = time.perf_counter() - started
    for r in result.history:
        if keys & set(r.metrics):
            evals[r.round] = {k: float(r.metrics[k]) for k in keys & set(r.metrics)}
    for row in trace:
        row.update(evals.get(row["round"], {}))
    record = {"preset": preset, "arm": arm, "tag": tag, "seed": seed, "overrides": {k: v for k, v in overrides.items()
                                                                                    if k != "run-dir"},
              "seconds": seconds, "rounds": result.rounds_done, "stopped": result.stopped,
              "noise_multiplier": plan.noise_multiplier, "epsilon": float(plan.epsilon()), "initial": initial,
              "adaptive_clipping": None if plan.adaptive_clipping is None else plan.adaptive_clipping.to_dict(),
              "per_round": trace}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=0))
    shutil.rmtree(run_dir, ignore_errors=True)
    return record


def summary(record: dict[str, Any]) -> str:
    rows = record["per_round"]
    last = rows[-1]
    return (f"{record['preset']} {record['arm']}{record['tag']} seed {record['seed']}: "
            f"z {record['noise_multiplier']:.4g}, "
            f"ζ {rows[0]['zeta']:.4g} → {last['zeta']:.4g}, loss {record['initial'].get('loss', float('nan')):.4f} → "
            f"{last.get('loss', float('nan')):.4f}, accuracy {last.get('accuracy', float('nan')):.4f} "
            f"({record['seconds']:.0f} s)")


def trace_table(record: dict[str, Any], every: int = 1) -> str:
    lines = ["| round | ζₜ | b̃ₜ/m | norm q10 / q50 / q90 | ‖Σclip‖/m | ‖noise‖ | loss | acc |",
             "|---|---|---|---|---|---|---|---|"]
    m = record["per_round"][0]["contributed"] or 1
    for r in record["per_round"]:
        if r["round"] % every and r["round"] != len(record["per_round"]) - 1:
            continue
        b = "—" if r["noisy_unclipped"] is None else f"{r['noisy_unclipped'] / m:.2f}"
        lines.append(f"| {r['round'] + 1} | {r['zeta']:.3g} | {b} | {r['norm_q10']:.3g} / {r['norm_q50']:.3g} / "
                     f"{r['norm_q90']:.3g} | {r['signal_norm']:.3g} | {r['noise_norm']:.3g} | "
                     f"{r.get('loss', float('nan')):.3f} | {r.get('accuracy', float('nan')):.4f} |")
    lines = [line.replace("| nan | nan |", "| | |") for line in lines]
    return "\n".join(lines)


def report(out: Path, preset: str) -> None:
    """One table row per arm (and tag and round count): final loss and accuracy, mean ± sd over seeds."""
    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob(f"{preset}_*.json"))]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(f"{r['arm']}{r['tag']} ({len(r['per_round'])} rounds)", []).append(r)

    def sd(v):
        return f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else ""

    for arm, runs in groups.items():
        losses = [r["per_round"][-1]["loss"] for r in runs]
        accs = [r["per_round"][-1]["accuracy"] for r in runs]
        zetas = [r["per_round"][-1]["zeta"] for r in runs]
        print(f"| {preset} | {arm} | {len(runs)} | {statistics.mean(losses):.4f}{sd(losses)} | "
              f"{statistics.mean(accs):.4f}{sd(accs)} | {min(zetas):.3g}–{max(zetas):.3g} |")


def paired(out: Path, preset: str, arm: str, against: str, last: int) -> None:
    """Per seed and mean ± sd: ARM's held-out loss and accuracy minus AGAINST's at the final round and averaged
    over the last ``last`` rounds (the seeds both have records for; meaningful for a ``-paired`` arm)."""
    def load(a: str) -> dict[int, dict[str, Any]]:
        return {r["seed"]: r for r in (json.loads(p.read_text()) for p in sorted((out / "runs").glob(
            f"{preset}_{a}_seed*.json")))}

    mine, base = load(arm), load(against)
    seeds = sorted(set(mine) & set(base))
    if not seeds:
        raise SystemExit(f"no seed has records for both {arm} and {against}")

    def at(rec: dict[str, Any], key: str, window: int) -> float:
        rows = [r for r in rec["per_round"] if key in r][-window:]
        return statistics.mean(r[key] for r in rows)

    for label, window in (("final round", 1), (f"last {last} rounds", last)):
        for key in ("loss", "accuracy"):
            diffs = [at(mine[s], key, window) - at(base[s], key, window) for s in seeds]
            own = [at(mine[s], key, window) for s in seeds]
            sd = f" ± {statistics.stdev(diffs):.4f}" if len(diffs) > 1 else ""
            print(f"{label}, {key}: {arm} {', '.join(f'{v:.4f}' for v in own)}; minus {against}: "
                  f"{', '.join(f'{d:+.4f}' for d in diffs)} (seeds {seeds}); mean {statistics.mean(diffs):+.4f}{sd}")
    for s in seeds:
        below = sum(1 for r in mine[s]["per_round"] if r["zeta"] < mine[s]["per_round"][-1]["zeta"] * (1 - 1e-9))
        print(f"seed {s}: ζ below its final value in {below} rounds; "
              f"min ζ {min(r['zeta'] for r in mine[s]['per_round']):.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("arm")
    r.add_argument("--preset", default="so-tiny")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--rounds", type=int)
    r.add_argument("--tag", default="")
    r.add_argument("--set", nargs="*", default=[])
    r.add_argument("--trace", action="store_true")
    r.add_argument("--eval-every", type=int, default=1)
    p = sub.add_parser("report")
    p.add_argument("--preset", default="so-tiny")
    q = sub.add_parser("paired")
    q.add_argument("arm")
    q.add_argument("--against", default="fixed")
    q.add_argument("--last", type=int, default=5)
    q.add_argument("--preset", default="so-tiny")
    args = parser.parse_args()
    if args.cmd == "run":
        for seed in args.seeds:
            record = run_one(args.preset, args.arm, seed, args.rounds, _parse_set(args.set), OUT, args.tag,
                             args.eval_every)
            print(summary(record), flush=True)
            if args.trace:
                print(trace_table(record), flush=True)
    elif args.cmd == "paired":
        paired(OUT, args.preset, args.arm, args.against, args.last)
    else:
        report(OUT, args.preset)


if __name__ == "__main__":
    main()
