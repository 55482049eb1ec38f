"""EXPERIMENTS.md's runs: DP-MF (banded-Toeplitz, BLT, the optimal multi-epoch dense, robust) vs
DP-FedAvg with independent noise (``dp-sgd``) vs no noise, at equal (ε, δ), on so-small
(synthetic StackOverflow-like) and shakespeare (real text).

Every run is the in-process private loop (``fedmf.run.federated.train``, the same round the Flower
server runs) with vectorized clients; only the experiment's grid lives here.

    python experiments/run.py prepare --out exp                   # mechanisms, noise multipliers (CPU)
    python experiments/run.py run --out exp --phase sweep --device cuda --workers 8
    python experiments/run.py run --out exp --phase final --device cuda --workers 8
    python experiments/run.py report --out exp                    # table + plots for EXPERIMENTS.md

Seeds: the data and the initial model are fixed per dataset; a seed fixes the run's secrets
(noise seed, schedule key) — independent noise and user order per seed, reproducible.
"No noise" is the same loop (clipping, ÷ planned users, server optimizer) with z = 1e-9.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: dataset → (preset, overrides): the geometry every method shares
DATASETS: dict[str, tuple[str, dict[str, Any]]] = {
    "so-small": ("so-small", {"rounds": 200, "min-sep": 40, "clients-per-round": 100, "delta": 1e-6,
                              "server-momentum": 0.9, "client-lr": 0.5, "local-epochs": 1, "batch-size": 16}),
    "shakespeare": ("shakespeare", {"rounds": 120, "min-sep": 20, "clients-per-round": 40, "delta": 1e-5,
                                    "server-momentum": 0.9, "client-lr": 0.5, "local-epochs": 1, "batch-size": 16}),
}
#: method → mechanism kind (None: no noise)
METHODS: dict[str, str | None] = {"banded-toeplitz": "banded-toeplitz", "blt": "blt", "dense": "dense",
                                  "robust": "robust", "dp-fedavg": "dp-sgd", "no-noise": None}
EPSILONS = (2.0, 8.0)
SEEDS = (0, 1, 2)
SERVER_LRS = (0.015625, 0.03125, 0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
#: the server learning rate of a configuration with no sweep record yet (the first sweep's common best;
#: independent noise prefers far smaller steps: EXPERIMENTS.md)
DEFAULT_LR = 0.5
NO_NOISE_Z = 1e-9
EVAL_EVERY = 10


def _values(dataset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from fedmf.run.simulate import preset_values

    preset, base = DATASETS[dataset]
    return preset_values(preset, {**base, **overrides})


def _schema(method: str) -> dict[str, Any]:
    """dense is optimized for fixed-epoch participation (every user once per min-sep rounds, in a
    fixed order); the others for min-sep participation. Each is calibrated under its own schema."""
    out: dict[str, Any] = {"schema": "fixed-epoch"} if method == "dense" else {}
    if method not in ("banded-toeplitz", "robust"):
        out["num-bands"] = 0  # the preset's bands are for the banded kinds
    return out


def _mechanism_file(out: Path, dataset: str, method: str) -> Path:
    return out / "mechanisms" / f"{dataset}-{method}.json"


def prepare(out: Path) -> None:
    """Optimize each dataset's mechanisms once (they depend on the geometry, not on ε or the seed)."""
    from fedmf.config import RunConfig
    from fedmf.mechanisms.io import save

    (out / "mechanisms").mkdir(parents=True, exist_ok=True)
    for dataset in DATASETS:
        for method, kind in METHODS.items():
            path = _mechanism_file(out, dataset, method)
            if kind is None or path.exists():
                continue
            started = time.perf_counter()
            config = RunConfig.from_mapping(_values(dataset, {"mechanism": kind, "run-dir": str(out / "tmp"),
                                                              **_schema(method)}))
            if kind == "robust":  # planned for min-sep b but good for any real min-sep in [b/2, b]
                from fedmf.mechanisms import plan as plan_mechanism

                mechanism, _ = plan_mechanism(kind, config.rounds, config.participation_schema(), config.workload(),
                                              min_sep_range=(config.min_sep // 2, config.min_sep))
            else:
                mechanism = config.build_mechanism()
            save(mechanism, path, config.participation_schema())
            plan = config.build_plan(mechanism)
            print(f"{dataset} {method}: {time.perf_counter() - started:.1f} s, z at eps 8 = "
                  f"{plan.noise_multiplier:.4g}, noise_std/clip = {plan.noise_std / plan.clip_norm:.4g}", flush=True)


def _jobs(phase: str, out: Path) -> list[dict[str, Any]]:
    jobs = []
    results = _load(out) if phase == "final" else []  # the sweep's records, read once
    for dataset in DATASETS:
        for method in METHODS:
            epsilons = (None,) if METHODS[method] is None else EPSILONS
            for eps in epsilons:
                if phase == "sweep":
                    jobs += [dict(dataset=dataset, method=method, epsilon=eps, server_lr=lr, seed=0)
                             for lr in SERVER_LRS]
                else:
                    best = _best_lr(results, dataset, method, eps)
                    jobs += [dict(dataset=dataset, method=method, epsilon=eps, server_lr=best, seed=s)
                             for s in SEEDS]
    if phase == "final":  # every configuration's first seed before any second one
        jobs.sort(key=lambda j: j["seed"])
    return jobs


def _key(job: dict[str, Any]) -> str:
    eps = "inf" if job["epsilon"] is None else f"{job['epsilon']:g}"
    return f"{job['dataset']}_{job['method']}_eps{eps}_lr{job['server_lr']:g}_seed{job['seed']}"


def _load(out: Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted((out / "results").glob("*.json")):
        results.append(json.loads(path.read_text()))
    return results


def _final_accuracy(result: dict[str, Any], metric: str = "accuracy") -> float:
    accs = [h[metric] for h in result["history"] if h.get(metric) is not None]
    return accs[-1] if accs and all(a == a for a in accs) else float("-inf")


def _best_lr(results: list[dict[str, Any]], dataset: str, method: str, eps: float | None) -> float:
    """The swept server learning rate with the best final accuracy (seed 0); DEFAULT_LR where the
    device budget left no sweep for this configuration (EXPERIMENTS.md says which)."""
    runs = [r for r in results if r["job"]["dataset"] == dataset and r["job"]["method"] == method
            and r["job"]["epsilon"] == eps and r["job"]["seed"] == 0 and r["job"]["server_lr"] in SERVER_LRS]
    return max(runs, key=_final_accuracy)["job"]["server_lr"] if runs else DEFAULT_LR


def _write_secrets(run_dir: Path, label: str, *, namespace: str = "fedmf-experiments") -> None:
    """Fixed secrets for the run (reproducible experiments; a production run draws them at random),
    derived from ``namespace/label`` (each experiment's records name their own)."""
    directory = run_dir / "secrets"
    directory.mkdir(mode=0o700, parents=True)
    os.chmod(run_dir, 0o700)
    for name in ("noise_seed", "schedule_key", "ledger_secret"):
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, hashlib.sha256(f"{namespace}/{label}/{name}".encode()).digest())
        os.close(fd)


def run_job(job: dict[str, Any], out: Path, device: str) -> dict[str, Any]:
    import shutil

    import torch

    from fedmf.config import RunConfig
    from fedmf.run.federated import train
    from fedmf.tasks import ClientHyper, get_task

    key = _key(job)
    target = out / "results" / f"{key}.json"
    if target.exists():
        return json.loads(target.read_text())
    torch.set_num_threads(1)
    run_dir = out / "runs" / key
    shutil.rmtree(run_dir, ignore_errors=True)
    _write_secrets(run_dir, f"{job['dataset']}/{job['method']}/{job['epsilon']}/{job['seed']}")
    kind = METHODS[job["method"]]
    overrides: dict[str, Any] = {"run-dir": str(run_dir), "server-lr": job["server_lr"],
                                 **_schema(job["method"])}
    if kind is None:
        overrides.update({"mechanism": "dp-sgd", "noise-multiplier": NO_NOISE_Z})
    else:
        overrides.update({"mechanism": str(_mechanism_file(out, job["dataset"], job["method"])),
                          "target-epsilon": job["epsilon"], "noise-multiplier": 0.0})
    config = RunConfig.from_mapping(_values(job["dataset"], overrides))
    task = get_task(config.task, **config.task_options)
    plan = config.build_plan()
    model = task.model()
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)

    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        return task.evaluate(m, device=device)

    started = time.perf_counter()
    # vectorized clients on an accelerator; one user at a time on the CPU (faster there: BENCHMARKS.md)
    clients = task.as_local_updates(hyper, vectorized=device != "cpu", device=device)
    # unsalted noise: a job rerun from its fixed secrets reproduces its numbers (never in a deployment)
    result = train(model, task.users(), plan, None, local_updates=clients, server_lr=config.server_lr,
                   checkpoint_dir=run_dir, evaluate=evaluate, observed_guard=False, repeatable_noise=True,
                   evaluate_every=EVAL_EVERY)  # rounds 10, 20, … and the last (train also evaluates the initial model)
    seconds = time.perf_counter() - started
    eps_curve = None if kind is None else [float(e) for e in plan.epsilon_by_round()]
    history = [{"round": r.round + 1, "accuracy": r.metrics.get("accuracy"),
                "accuracy_no_oov_eos": r.metrics.get("accuracy_no_oov_eos"), "loss": r.metrics.get("loss"),
                "epsilon": None if eps_curve is None else eps_curve[r.round]}
               for r in result.history if "accuracy" in r.metrics]
    record = {"job": job, "key": key, "seconds": seconds, "device": device, "rounds": result.rounds_done, "stopped": result.stopped,
              "noise_multiplier": plan.noise_multiplier, "noise_std": plan.noise_std,
              "sensitivity": plan.sensitivity.value, "epsilon": None if kind is None else eps_curve[-1],
              "delta": plan.delta, "history": history}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record))
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints are not kept (disk); the record is
    return record


def _worker(args: tuple[dict[str, Any], str, str]) -> str:
    job, out, device = args
    try:
        record = run_job(job, Path(out), device)
        return f"{record['key']}: acc {_final_accuracy(record):.4f} in {record['seconds']:.0f} s"
    except Exception as e:  # one failed run must not stop the grid; it is reported
        return f"{_key(job)}: FAILED {type(e).__name__}: {e}"


def run(out: Path, phase: str, device: str, workers: int, only: str | None, skip: str | None = None,
        epsilon: float | None = None, lrs: str | None = None) -> None:
    import multiprocessing as mp

    jobs = _jobs(phase, out)
    if only:
        jobs = [j for j in jobs if j["dataset"] == only]
    if epsilon is not None:  # this ε's runs (and the no-noise ones, which have none)
        jobs = [j for j in jobs if j["epsilon"] in (epsilon, None)]
    if lrs:
        rates = {float(x) for x in lrs.split(",")}
        jobs = [j for j in jobs if j["server_lr"] in rates]
    if skip:
        jobs = [j for j in jobs if j["method"] not in skip.split(",")]
    todo = [j for j in jobs if not (out / "results" / f"{_key(j)}.json").exists()]
    by_dataset = [[j for j in todo if j["dataset"] == d] for d in DATASETS]  # interleaved: both advance
    todo = [j for group in itertools.zip_longest(*by_dataset) for j in group if j is not None]
    print(f"{phase}: {len(jobs)} runs, {len(todo)} to do, {workers} workers on {device}", flush=True)
    started = time.perf_counter()
    with mp.get_context("spawn").Pool(workers, maxtasksperchild=1) as pool:
        for line in pool.imap_unordered(_worker, [(j, str(out), device) for j in todo]):
            print(f"[{time.perf_counter() - started:6.0f} s] {line}", flush=True)


def _finals(results: list[dict[str, Any]]) -> dict[tuple[str, str, float | None], list[dict[str, Any]]]:
    """Each configuration's runs at its best server learning rate (chosen on seed 0), every seed."""
    configurations = {(r["job"]["dataset"], r["job"]["method"], r["job"]["epsilon"]) for r in results}
    best = {c: _best_lr(results, *c) for c in configurations}  # once per configuration, not per record
    finals: dict[tuple[str, str, float | None], list[dict[str, Any]]] = {}
    for r in results:
        j = r["job"]
        key = (j["dataset"], j["method"], j["epsilon"])
        if j["server_lr"] == best[key]:
            finals.setdefault(key, []).append(r)
    return finals


def _mean_sd(values: list[float]) -> str:
    """The cell "mean ± sd" (sample sd; "—" for one value)."""
    sd = f"{statistics.stdev(values):.4f}" if len(values) > 1 else "—"
    return f"{statistics.mean(values):.4f} ± {sd}"


def welch_t(a: list[float], b: list[float]) -> float | None:
    """Welch's t statistic of mean(a) - mean(b) (unequal variances); None below two samples a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return None if se == 0 else (statistics.mean(a) - statistics.mean(b)) / se


def versus_table(finals: dict[tuple[str, str, float | None], list[dict[str, Any]]]) -> str:
    """Every DP-MF configuration against DP-FedAvg at the same dataset and ε, both at their best rates."""
    def cell(runs: list[dict[str, Any]]) -> str:
        return (f"{_mean_sd([_final_accuracy(r) for r in runs])} (lr {runs[0]['job']['server_lr']:g}, "
                f"{len(runs)} seed{'s' * (len(runs) > 1)})")

    lines = ["| dataset | ε | DP-MF method | DP-MF accuracy | DP-FedAvg accuracy | difference | Welch t |",
             "|---|---|---|---|---|---|---|"]
    for dataset in DATASETS:
        for eps in EPSILONS:
            base = finals.get((dataset, "dp-fedavg", eps))
            if not base:
                continue
            b = [_final_accuracy(r) for r in base]
            base_cell = cell(base)
            for method, kind in METHODS.items():
                runs = finals.get((dataset, method, eps))
                if kind in (None, "dp-sgd") or not runs:
                    continue
                a = [_final_accuracy(r) for r in runs]
                t = welch_t(a, b)
                lines.append(f"| {dataset} | {eps:g} | {method} | {cell(runs)} | {base_cell} | "
                             f"{statistics.mean(a) - statistics.mean(b):+.4f} | {'—' if t is None else f'{t:.1f}'} |")
    return "\n".join(lines)


def report(out: Path) -> None:
    """The table (mean ± sd over seeds of the final held-out accuracy) and accuracy-by-round plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = _load(out)
    finals = _finals(results)
    lines = ["| dataset | method | ε (δ) | server lr | z | σ (ζ = 1) | final accuracy (mean ± sd) | without OOV/EOS | seeds "
             "| minutes/run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (dataset, method, eps), runs in sorted(finals.items(), key=lambda kv: (kv[0][0], kv[0][2] or 1e9,
                                                                                 list(METHODS).index(kv[0][1]))):
        accs = [_final_accuracy(r) for r in runs]
        accs2 = [_final_accuracy(r, "accuracy_no_oov_eos") for r in runs]
        eps_txt = "∞ (no noise)" if eps is None else f"{eps:g} ({runs[0]['delta']:g})"
        lines.append(f"| {dataset} | {method} | {eps_txt} | {runs[0]['job']['server_lr']:g} | "
                     f"{runs[0]['noise_multiplier']:.4g} | {runs[0]['noise_std'] / 1.0:.4g} | "
                     f"{_mean_sd(accs)} | {_mean_sd(accs2)} | {len(accs)} | "
                     f"{statistics.mean(r['seconds'] for r in runs) / 60:.1f} |")
    sweep = ["| dataset | method | ε | " + " | ".join(f"lr {lr:g}" for lr in SERVER_LRS) + " |",
             "|---|---|---|" + "---|" * len(SERVER_LRS)]
    for dataset in DATASETS:
        for eps in (*EPSILONS, None):
            for method in METHODS:
                cells = []
                for lr in SERVER_LRS:
                    match = [r for r in results if r["job"] == dict(dataset=dataset, method=method, epsilon=eps,
                                                                    server_lr=lr, seed=0)]
                    cells.append(f"{_final_accuracy(match[0]):.4f}" if match else "—")
                if any(c != "—" for c in cells):
                    sweep.append(f"| {dataset} | {method} | {'∞' if eps is None else f'{eps:g}'} | "
                                 + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n\nServer learning-rate sweep (seed 0, final accuracy):\n\n"
                                  + "\n".join(sweep) + "\n\nTuned against tuned (each at its best rate):\n\n"
                                  + versus_table(finals) + "\n")
    print((out / "table.md").read_text())
    for dataset in DATASETS:
        fig, axes = plt.subplots(1, len(EPSILONS), figsize=(6 * len(EPSILONS), 4.2), sharey=True)
        for ax, eps in zip(axes, EPSILONS):
            for method in METHODS:
                runs = finals.get((dataset, method, eps if METHODS[method] is not None else None), [])
                if not runs:
                    continue
                rounds = [h["round"] for h in runs[0]["history"]]
                curves = [[h["accuracy"] for h in r["history"]] for r in runs]
                mean = [statistics.mean(c[i] for c in curves) for i in range(len(rounds))]
                ax.plot(rounds, mean, label=method, linestyle="--" if METHODS[method] is None else "-")
            ax.set_title(f"{dataset}, ε = {eps:g}")
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out accuracy (mean over seeds)")
        axes[-1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"accuracy-{dataset}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("prepare", "run", "report"))
    parser.add_argument("--out", default="experiments-out")
    parser.add_argument("--phase", choices=("sweep", "final"), default="sweep")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--only", choices=sorted(DATASETS))
    parser.add_argument("--skip", help="methods to leave out of this run, comma-separated")
    parser.add_argument("--epsilon", type=float, help="only this ε's runs (and no noise)")
    parser.add_argument("--lrs", help="only these server learning rates, comma-separated")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.step == "prepare":
        prepare(out)
    elif args.step == "run":
        run(out, args.phase, args.device, args.workers, args.only, args.skip, args.epsilon, args.lrs)
    else:
        report(out)


if __name__ == "__main__":
    main()
