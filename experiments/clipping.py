"""EXPERIMENTS.md's "Adaptive clipping" runs: adaptive ζ (Andrew et al., NeurIPS 2021, Alg. 1) against
the best tuned fixed ζ and two untuned fixed ζ (0.1 and 10× the median update norm), at equal total
(ε, δ), on so-small and shakespeare with banded-Toeplitz DP-MF noise.

    python experiments/clipping.py norms                 # update norms at the initial model (JSON)
    python experiments/clipping.py run --phase sweep     # fixed ζ grid, seed 0
    python experiments/clipping.py run --phase final     # tuned / ζ = 0.1 / 10× median, seeds 0–2
    python experiments/clipping.py run --phase adaptive  # adaptive ζ, seeds 0–2 (needs the count's accountant)
    python experiments/clipping.py report                # table + ζₜ and accuracy plots

Shorter runs than experiments/run.py's (30 rounds) so that the grid fits on 2 CPU cores; the geometry,
seeds and secrets follow run.py (a seed fixes the noise seed and schedule key). Records go to
experiments/results/clipping/ (one small JSON per run).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _write_secrets  # noqa: E402  (experiments/run.py: fixed secrets, one recipe for every experiment)

from fedmf.errors import ConfigError, FedmfError  # noqa: E402

#: dataset → (preset, overrides): 30 rounds, min-sep 15 (≤ 2 participations per user), 20 users a round
#: (sized for 2 shared CPU cores: a so-small run took 155 s at 40 rounds there)
DATASETS: dict[str, tuple[str, dict[str, Any]]] = {
    "so-small": ("so-small", {"rounds": 30, "min-sep": 15, "clients-per-round": 20, "delta": 1e-6,
                              "server-momentum": 0.9, "client-lr": 0.5, "local-epochs": 1, "batch-size": 16,
                              "mechanism": "banded-toeplitz"}),
    "shakespeare": ("shakespeare", {"rounds": 30, "min-sep": 15, "clients-per-round": 20, "delta": 1e-5,
                                    "server-momentum": 0.9, "client-lr": 0.5, "local-epochs": 1, "batch-size": 16,
                                    "mechanism": "banded-toeplitz"}),
}
EPSILONS = (2.0, 8.0)
SEEDS = (0, 1, 2)
#: banded-toeplitz's tuned server learning rate per (dataset, ε) in EXPERIMENTS.md (ζ = 1, longer runs)
SERVER_LR: dict[tuple[str, float], float] = {("so-small", 2.0): 0.25, ("so-small", 8.0): 1.0,
                                             ("shakespeare", 2.0): 0.125, ("shakespeare", 8.0): 0.25}
#: the swept fixed ζ, as multiples of the median update norm at the initial model
SWEEP_MULTIPLES = (0.5, 1.0, 2.0)
#: the untuned fixed arms: ζ = 0.1 and ζ = 10 × median
UNTUNED_SMALL = 0.1
UNTUNED_LARGE_MULTIPLE = 10.0
#: adaptive arm: γ and η as Andrew et al. Sec. 3.1, untuned ζ₀; σ_b is set so that the count spends
#: ``count_share`` of the run's μ² (their σ_b = m/20 alone exceeds ε = 2's whole budget at m = 20)
ADAPTIVE = {"target_quantile": 0.5, "learning_rate": 0.2, "count_share": 0.2, "initial_clip_norm": 0.1}
#: users whose update norm is measured per dataset (a fixed sample)
NORM_SAMPLE = 200
NORM_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
EVAL_EVERY = 10
OUT = Path(__file__).resolve().parent / "results" / "clipping"


class ExperimentError(FedmfError):
    """The experiment cannot run as asked (missing norms, an accountant that did not charge the count)."""


# ---- grid ------------------------------------------------------------------------------------------
def round_zeta(zeta: float) -> float:
    """ζ to 4 significant digits (keys and records use this value)."""
    return float(f"{zeta:.4g}")


def untuned_zetas(median: float) -> tuple[float, float]:
    """The two untuned fixed ζ: 0.1 and 10 × the median update norm."""
    return UNTUNED_SMALL, round_zeta(UNTUNED_LARGE_MULTIPLE * median)


def sweep_zetas(median: float) -> list[float]:
    """The seed-0 sweep: multiples of the median norm, and the two untuned values (candidates too)."""
    return sorted({round_zeta(m * median) for m in SWEEP_MULTIPLES} | set(untuned_zetas(median)))


def key(job: dict[str, Any]) -> str:
    arm = "adaptive" if job.get("adaptive") else f"zeta{job['clip_norm']:g}"
    return f"{job['dataset']}_eps{job['epsilon']:g}_{arm}_seed{job['seed']}"


def final_accuracy(record: dict[str, Any]) -> float:
    """The last evaluation's held-out accuracy (as experiments/run.py); -inf for a diverged run."""
    accs = [h["accuracy"] for h in record["history"] if h.get("accuracy") is not None]
    return accs[-1] if accs and all(a == a for a in accs) else float("-inf")


def final_loss(record: dict[str, Any]) -> float:
    """The last evaluation's held-out loss; +inf for a diverged run."""
    losses = [h["loss"] for h in record["history"] if h.get("loss") is not None]
    return losses[-1] if losses and all(x == x for x in losses) else float("inf")


def best_zeta(records: list[dict[str, Any]], dataset: str, eps: float) -> float | None:
    """The fixed ζ with the lowest final held-out loss on seed 0 (ties: the smaller ζ); None before any
    sweep. Loss, not accuracy: 30 rounds are the early phase, where accuracy first falls below the
    "always EOS" predictor's (0.0745 on so-small) as a model learns, so the least-trained run would win."""
    runs = [r for r in records if not r["job"].get("adaptive") and r["job"]["dataset"] == dataset
            and r["job"]["epsilon"] == eps and r["job"]["seed"] == 0]
    if not runs:
        return None
    return min(runs, key=lambda r: (final_loss(r), r["job"]["clip_norm"]))["job"]["clip_norm"]


def jobs(phase: str, norms: dict[str, Any], records: list[dict[str, Any]], only: str | None = None
         ) -> list[dict[str, Any]]:
    """The runs of one phase (of dataset ``only``, default all), each {dataset, epsilon, clip_norm, seed,
    adaptive}."""
    out: list[dict[str, Any]] = []
    for dataset in [d for d in DATASETS if only is None or d == only]:
        if dataset not in norms:
            raise ExperimentError(f"no update norms for {dataset}: run `python experiments/clipping.py norms` first")
        median = norms[dataset]["median"]
        for eps in EPSILONS:
            base = dict(dataset=dataset, epsilon=eps, adaptive=False)
            if phase == "sweep":
                out += [{**base, "clip_norm": z, "seed": 0} for z in sweep_zetas(median)]
            elif phase == "final":
                tuned = best_zeta(records, dataset, eps)
                if tuned is None:
                    raise ExperimentError(f"no sweep records for {dataset} at ε = {eps:g}: run --phase sweep first")
                zetas = sorted({tuned, *untuned_zetas(median)})
                out += [{**base, "clip_norm": z, "seed": s} for z in zetas for s in SEEDS]
            elif phase == "adaptive":
                out += [{**base, "adaptive": True, "clip_norm": ADAPTIVE["initial_clip_norm"], "seed": s}
                        for s in SEEDS]
            else:
                raise ConfigError(f"phase must be sweep, final or adaptive, got {phase!r}")
    seen: set[str] = set()
    unique = [j for j in out if not (key(j) in seen or seen.add(key(j)))]
    unique.sort(key=lambda j: j["seed"])  # every configuration's first seed before any second one
    return unique


# ---- records -----------------------------------------------------------------------------------------
def load_records(out: Path = OUT) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def load_norms(out: Path = OUT) -> dict[str, Any]:
    path = out / "norms.json"
    return json.loads(path.read_text()) if path.exists() else {}


# ---- running -----------------------------------------------------------------------------------------
def _config(dataset: str, overrides: dict[str, Any]):
    from fedmf.config import RunConfig
    from fedmf.run.simulate import preset_values

    preset, base = DATASETS[dataset]
    return RunConfig.from_mapping(preset_values(preset, {**base, **overrides}))


def measure_norms(out: Path = OUT) -> dict[str, Any]:
    """ℓ2 norms of NORM_SAMPLE users' updates (one local epoch) at each dataset's initial model."""
    import numpy as np
    import torch

    from fedmf.tasks import ClientHyper, get_task

    torch.set_num_threads(1)
    result = load_norms(out)
    for dataset in DATASETS:
        if dataset in result:
            continue
        started = time.perf_counter()
        config = _config(dataset, {"run-dir": str(out / "tmp")})
        task = get_task(config.task, **config.task_options)
        users = task.users()
        sample = sorted(np.random.default_rng(0).choice(len(users), size=min(NORM_SAMPLE, len(users)),
                                                        replace=False))
        params = {k: v.detach().clone() for k, v in task.model().state_dict().items()}
        hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
        norms = []
        for i in sample:
            update = task.local_update(params, users[i], 0, hyper).update
            norms.append(math.sqrt(sum(float(t.double().square().sum()) for t in update.values())))
        qs = np.quantile(np.asarray(norms, dtype=np.float64), NORM_QUANTILES)
        result[dataset] = {"users": len(norms), "median": float(np.median(norms)), "mean": float(np.mean(norms)),
                           "quantiles": {f"{q:g}": float(v) for q, v in zip(NORM_QUANTILES, qs)},
                           "min": float(min(norms)), "max": float(max(norms)),
                           "seconds": time.perf_counter() - started}
        out.mkdir(parents=True, exist_ok=True)
        (out / "norms.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"{dataset}: {json.dumps(result[dataset])}", flush=True)
    return result


def adaptive_plan(fixed_plan, job: dict[str, Any], expected_users: float):
    """The adaptive arm's plan at the fixed arm's total (ε, δ): z calibrated with the count's Gaussian
    release composed in (fedmf.accounting), so z must exceed the fixed plan's z at the same ε."""
    from fedmf.plan import RunPlan
    from fedmf.round.adaptive_clipping import AdaptiveClipping

    rule = AdaptiveClipping.create(ADAPTIVE["target_quantile"], expected_users=expected_users,
                                   learning_rate=ADAPTIVE["learning_rate"],
                                   count_noise_std=count_noise_for_share(fixed_plan, ADAPTIVE["count_share"]))
    plan = RunPlan.create(fixed_plan.mechanism, fixed_plan.schema, clip_norm=job["clip_norm"],
                          delta=fixed_plan.delta, expected_users=expected_users, target_epsilon=job["epsilon"],
                          sampling=fixed_plan.sampling, accountant=fixed_plan.accountant, adaptive_clipping=rule)
    check_count_accounted(plan.noise_multiplier, fixed_plan.noise_multiplier, job["epsilon"])
    return plan


def count_noise_for_share(fixed_plan, share: float) -> float:
    """σ_b whose count release spends ``share`` of the fixed plan's μ² (un-amplified): by
    count_release's (1), k/σ_b² = share/z², so σ_b = z·√(k/share) and z_mf = z/√(1 − share)."""
    from fedmf.accounting import count_release

    k = count_release.participations(fixed_plan.schema, fixed_plan.rounds)
    return fixed_plan.noise_multiplier * math.sqrt(k / share)


def check_count_accounted(adaptive_z: float, fixed_z: float, eps: float) -> None:
    """At equal total ε the adaptive plan spends part of ε on the count, so its z must be larger."""
    if not adaptive_z > fixed_z:
        raise ExperimentError(f"adaptive clipping's z ({adaptive_z:.6g}) is not above the fixed arm's z "
                              f"({fixed_z:.6g}) at ε = {eps:g}: the accountant did not charge the count release")


def _ledger_trajectory(ledger: Path) -> dict[int, tuple[float | None, float | None]]:
    """round → (ζₜ, noisy unclipped count) from the run's SQLite ledger (rounds.clip_norm, 0004)."""
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT round_index, clip_norm, noisy_unclipped FROM rounds ORDER BY round_index").fetchall()
    return {int(t): (c, u) for t, c, u in rows}


def run_job(job: dict[str, Any], out: Path = OUT) -> dict[str, Any]:
    import torch

    from fedmf.run.federated import train
    from fedmf.tasks import ClientHyper, get_task

    name = key(job)
    target = out / "runs" / f"{name}.json"
    if target.exists():
        return json.loads(target.read_text())
    torch.set_num_threads(1)
    run_dir = out / "tmp" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    _write_secrets(run_dir, f"clipping/{job['dataset']}/{job['epsilon']}/{job['seed']}")
    config = _config(job["dataset"], {"run-dir": str(run_dir), "server-lr": SERVER_LR[job["dataset"], job["epsilon"]],
                                      "clip-norm": job["clip_norm"], "target-epsilon": job["epsilon"],
                                      "noise-multiplier": 0.0})
    task = get_task(config.task, **config.task_options)
    plan = config.build_plan(_mechanism(job["dataset"], config))
    fixed_z = plan.noise_multiplier
    if job.get("adaptive"):
        plan = adaptive_plan(plan, job, config.clients_per_round)
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    started = time.perf_counter()
    result = train(task.model(), task.users(), plan, None, local_updates=task.as_local_updates(hyper, vectorized=False),
                   server_lr=config.server_lr, checkpoint_dir=run_dir, evaluate=task.evaluate, observed_guard=False,
                   repeatable_noise=True, ledger_diagnostics=True,  # diagnostics: the clipped count per round
                   evaluate_every=EVAL_EVERY)  # rounds EVAL_EVERY, 2·EVAL_EVERY, … and the last
    seconds = time.perf_counter() - started
    trajectory = _ledger_trajectory(run_dir / "ledger.db")
    eps_curve = [float(e) for e in plan.epsilon_by_round()]
    history = [{"round": r.round + 1, "accuracy": r.metrics.get("accuracy"), "loss": r.metrics.get("loss"),
                "epsilon": eps_curve[r.round]} for r in result.history if "accuracy" in r.metrics]
    rounds = [{"round": r.round + 1, "clipped": r.clipped, "contributed": r.contributed,
               "clip_norm": trajectory.get(r.round, (None, None))[0] if job.get("adaptive") else job["clip_norm"],
               "noisy_unclipped": trajectory.get(r.round, (None, None))[1]} for r in result.history]
    record = {"job": job, "key": name, "seconds": seconds, "rounds": result.rounds_done, "stopped": result.stopped,
              "server_lr": config.server_lr, "clients_per_round": config.clients_per_round,
              "noise_multiplier": plan.noise_multiplier, "fixed_noise_multiplier": fixed_z,
              "noise_std_per_clip": plan.std_per_clip, "epsilon": eps_curve[-1], "delta": plan.delta,
              "adaptive_clipping": None if plan.adaptive_clipping is None else plan.adaptive_clipping.to_dict(),
              "history": history, "per_round": rounds}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record))
    shutil.rmtree(run_dir, ignore_errors=True)
    return record


_MECHANISMS: dict[str, Any] = {}


def _mechanism(dataset: str, config) -> Any:
    """Each dataset's banded-Toeplitz mechanism, optimized once per process (it depends on the geometry only)."""
    if dataset not in _MECHANISMS:
        _MECHANISMS[dataset] = config.build_mechanism()
    return _MECHANISMS[dataset]


def run(phase: str, out: Path = OUT, only: str | None = None, epsilon: float | None = None) -> None:
    todo = [j for j in jobs(phase, load_norms(out), load_records(out), only) if epsilon is None or j["epsilon"] == epsilon]
    left = [j for j in todo if not (out / "runs" / f"{key(j)}.json").exists()]
    print(f"{phase}: {len(todo)} runs, {len(left)} to do", flush=True)
    started = time.perf_counter()
    for job in left:
        record = run_job(job, out)
        print(f"[{time.perf_counter() - started:6.0f} s] {record['key']}: loss {final_loss(record):.4f} acc {final_accuracy(record):.4f} "
              f"in {record['seconds']:.0f} s (z {record['noise_multiplier']:.4g})", flush=True)


# ---- report -------------------------------------------------------------------------------------------
def arms(records: list[dict[str, Any]], norms: dict[str, Any], dataset: str, eps: float) -> dict[str, list[dict]]:
    """arm name → its runs (every seed) at (dataset, ε): tuned (best seed-0 ζ), ζ = 0.1, 10× median, adaptive."""
    here = [r for r in records if r["job"]["dataset"] == dataset and r["job"]["epsilon"] == eps]
    small, large = untuned_zetas(norms[dataset]["median"])
    tuned = best_zeta(records, dataset, eps)
    fixed = {"tuned fixed ζ": tuned, f"fixed ζ = {small:g}": small, f"fixed ζ = {large:g} (10× median)": large}
    out = {arm: sorted((r for r in here if not r["job"].get("adaptive") and r["job"]["clip_norm"] == z),
                       key=lambda r: r["job"]["seed"]) for arm, z in fixed.items()}
    out["adaptive (γ 0.5, ζ₀ 0.1)"] = sorted((r for r in here if r["job"].get("adaptive")),
                                             key=lambda r: r["job"]["seed"])
    return out


def mean_sd(values: list[float]) -> str:
    """"mean ± sd" (sample sd; "—" for one value; "not yet run" for none)."""
    if not values:
        return "not yet run"
    sd = f"{statistics.stdev(values):.4f}" if len(values) > 1 else "—"
    return f"{statistics.mean(values):.4f} ± {sd}"


def table(records: list[dict[str, Any]], norms: dict[str, Any]) -> str:
    lines = ["| dataset | ε | arm | ζ (ζ₀) | z | final loss (mean ± sd) | final accuracy (mean ± sd) | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for dataset in DATASETS:
        if dataset not in norms:
            continue
        for eps in EPSILONS:
            for arm, runs in arms(records, norms, dataset, eps).items():
                zeta = f"{runs[0]['job']['clip_norm']:g}" if runs else "—"
                z = f"{runs[0]['noise_multiplier']:.4g}" if runs else "—"
                lines.append(f"| {dataset} | {eps:g} | {arm} | {zeta} | {z} | "
                             f"{mean_sd([final_loss(r) for r in runs])} | "
                             f"{mean_sd([final_accuracy(r) for r in runs])} | {len(runs)} |")
    return "\n".join(lines)


def sweep_table(records: list[dict[str, Any]], norms: dict[str, Any]) -> str:
    lines = ["| dataset | ε | " + " | ".join(f"{m:g}× median" for m in SWEEP_MULTIPLES) + " | ζ = 0.1 | 10× median |",
             "|---|---|" + "---|" * (len(SWEEP_MULTIPLES) + 2)]
    for dataset in DATASETS:
        if dataset not in norms:
            continue
        median = norms[dataset]["median"]
        zetas = [round_zeta(m * median) for m in SWEEP_MULTIPLES] + list(untuned_zetas(median))
        for eps in EPSILONS:
            cells = []
            for z in zetas:
                match = [r for r in records if r["job"] == dict(dataset=dataset, epsilon=eps, adaptive=False,
                                                                clip_norm=z, seed=0)]
                cells.append(f"{final_loss(match[0]):.3f} / {final_accuracy(match[0]):.4f} (ζ {z:g})" if match else "—")
            lines.append(f"| {dataset} | {eps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(out: Path = OUT) -> str:
    """table.md (arms, sweep) and clipping-<dataset>.png (ζₜ by round per seed, held-out loss by round
    as the mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, norms = load_records(out), load_norms(out)
    text = (table(records, norms) + "\n\nFixed-ζ sweep (seed 0, final held-out loss / accuracy):\n\n" + sweep_table(records, norms)
            + "\n")
    (out / "table.md").write_text(text)
    for dataset in DATASETS:
        if dataset not in norms:
            continue
        fig, axes = plt.subplots(2, len(EPSILONS), figsize=(6 * len(EPSILONS), 7.5), sharex=True)
        for col, eps in enumerate(EPSILONS):
            for arm, runs in arms(records, norms, dataset, eps).items():
                if not runs:
                    continue
                for r in runs:  # ζₜ per seed (one line per fixed arm: all seeds equal)
                    rounds = [p["round"] for p in r["per_round"]]
                    axes[0][col].plot(rounds, [p["clip_norm"] for p in r["per_round"]], alpha=0.7,
                                      color=f"C{list(arms(records, norms, dataset, eps)).index(arm)}",
                                      label=(f"{arm} = {r['job']['clip_norm']:g}" if arm.startswith("tuned")
                                             else arm) if r is runs[0] else None)
                length = min(len(r["history"]) for r in runs)
                rounds = [h["round"] for h in runs[0]["history"][:length]]
                mean = [statistics.mean(r["history"][i]["loss"] for r in runs) for i in range(length)]
                axes[1][col].plot(rounds, mean, marker="o", label=arm)
            axes[1][col].set_yscale("log")
            axes[0][col].axhline(norms[dataset]["median"], color="grey", linestyle=":", label="median norm (t = 0)")
            axes[0][col].set_yscale("log")
            axes[0][col].set_title(f"{dataset}, ε = {eps:g}: clip norm ζₜ")
            axes[1][col].set_title(f"{dataset}, ε = {eps:g}: held-out loss (mean over seeds)")
            axes[1][col].set_xlabel("round")
            for ax in axes[:, col]:
                ax.grid(alpha=0.3)
        for ax in axes.flat:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"clipping-{dataset}.png", dpi=100)
        plt.close(fig)
    print(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("norms", "run", "report"))
    parser.add_argument("--phase", choices=("sweep", "final", "adaptive"), default="sweep")
    parser.add_argument("--only", choices=sorted(DATASETS))
    parser.add_argument("--epsilon", type=float, choices=EPSILONS)
    args = parser.parse_args()
    try:
        if args.step == "norms":
            measure_norms()
        elif args.step == "run":
            run(args.phase, only=args.only, epsilon=args.epsilon)
        else:
            report()
    except FedmfError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
