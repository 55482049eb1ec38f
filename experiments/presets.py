"""EXPERIMENTS.md's preset runs: every ``fedmf simulate --preset`` (``fedmf.run.simulate.PRESETS``) at its own
mechanism and ε, through the same call the CLI makes (``preset_values`` → ``RunConfig`` → the task →
``fedmf.run.simulate.simulate``), with a server learning-rate sweep and three seeds.

    python experiments/presets.py run --preset tiny --lrs 0.25,0.5,1,2,4 --seeds 0,1,2
    python experiments/presets.py run --preset so-tiny --mechanism dp-sgd --lrs 0.5 --seeds 0,1,2
    python experiments/presets.py report            # experiments/results/presets/table.md

Each record holds the initial model's held-out loss and accuracy, the always-most-frequent-label
baseline on the same held-out data (for text: the most frequent non-pad target token; for tiny:
the majority class), and the held-out loss and accuracy after every round. Seeds: the data and the
initial model are fixed per preset; a seed fixes the run's secrets (noise seed, schedule key), as in
``experiments/run.py``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _write_secrets  # noqa: E402  (experiments/run.py: fixed secrets, one recipe for every experiment)

OUT = Path(__file__).resolve().parent / "results" / "presets"


def majority_baseline(task) -> float:
    """Accuracy of always predicting the held-out data's most frequent label (non-pad targets for text)."""
    import torch

    _, y = task.heldout_data()
    y = y.reshape(-1)
    if hasattr(task, "vocab_size"):
        from fedmf.tasks.text import PAD

        y = y[y != PAD]
    return float(torch.bincount(y).max()) / len(y)


def _key(preset: str, mechanism: str, lr: float, seed: int, extra: dict[str, Any] | None = None) -> str:
    more = "".join(f"_{k}{v:g}" for k, v in sorted((extra or {}).items()))
    return f"{preset}_{mechanism}_lr{lr:g}{more}_seed{seed}"


def run_one(preset: str, mechanism: str | None, lr: float, seed: int, workers: int, out: Path = OUT,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of ``preset`` (optionally with another mechanism and ``extra`` RunConfig values, e.g.
    {"client-lr": 0.5}) at server learning rate ``lr`` and secrets of ``seed``; the record."""
    import torch

    from fedmf.config import RunConfig
    from fedmf.run.simulate import PRESETS, preset_values, simulate
    from fedmf.tasks import ClientHyper, get_task

    kind = mechanism or PRESETS[preset].get("mechanism", "bsr")
    key = _key(preset, kind, lr, seed, extra)
    target = out / f"{key}.json"
    if target.exists():
        return json.loads(target.read_text())
    run_dir = out / "runs" / key
    shutil.rmtree(run_dir, ignore_errors=True)
    _write_secrets(run_dir, f"{preset}/{kind}/{seed}", namespace="fedmf-presets")
    overrides: dict[str, Any] = {**(extra or {}), "run-dir": str(run_dir), "server-lr": lr}
    if mechanism:
        overrides["mechanism"] = mechanism
    values = preset_values(preset, overrides)
    config = RunConfig.from_mapping(values)
    task = get_task(config.task, **config.task_options)
    with torch.no_grad():
        initial = task.evaluate(task.model())
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    clients = ({"local_update": task.as_local_update(hyper)} if workers == 1 else
               {"local_updates": task.as_local_updates(hyper, vectorized=False, workers=workers)})
    started = time.perf_counter()
    result = simulate(config, model=task.model(), users=task.users(), **clients, evaluate=task.evaluate,
                      progress=False, plot=False, repeatable_noise=True)  # reproducible from the fixed secrets
    seconds = time.perf_counter() - started
    history = [{"round": h["round"], **{k: h["metrics"].get(k) for k in ("loss", "accuracy")}}
               for h in result.history if h["metrics"]]
    record = {"preset": preset, "mechanism": kind, "server_lr": lr, "extra": extra or {}, "seed": seed, "seconds": seconds,
              "workers": workers, "epsilon": result.epsilon, "delta": result.delta,
              "noise_multiplier": result.noise_multiplier, "rounds": result.rounds_done, "stopped": result.stopped,
              "initial": initial, "baseline_accuracy": majority_baseline(task), "final": history[-1],
              "config": {k: v for k, v in values.items() if k != "run-dir"},
              "history": history}
    out.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record))
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints are not kept (disk); the record is
    return record


def initial_and_baseline(preset: str, out: Path = OUT) -> dict[str, Any]:
    """The preset's initial model on its held-out data and the majority baseline (no training):
    what a preset's recorded runs are compared with where they were made by ``experiments/run.py``."""
    import torch

    from fedmf.config import RunConfig
    from fedmf.run.simulate import preset_values
    from fedmf.tasks import get_task

    config = RunConfig.from_mapping(preset_values(preset, {"run-dir": str(out / "runs" / "baseline")}))
    task = get_task(config.task, **config.task_options)
    with torch.no_grad():
        initial = task.evaluate(task.model())
    record = {"preset": preset, "initial": initial, "baseline_accuracy": majority_baseline(task)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "baselines" / f"{preset}.json").parent.mkdir(exist_ok=True)
    (out / "baselines" / f"{preset}.json").write_text(json.dumps(record))
    return record


def _load(out: Path = OUT) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _mean_sd(values: list[float]) -> str:
    sd = f"{statistics.stdev(values):.4f}" if len(values) > 1 else "—"
    return f"{statistics.mean(values):.4f} ± {sd}"


def report(out: Path = OUT) -> str:
    """One row per (preset, mechanism, server lr): final held-out loss and accuracy over seeds, the
    initial model's loss, the majority baseline, and how many seeds learned (final loss below the
    initial and accuracy above the baseline)."""
    groups: dict[tuple[str, str, float, str], list[dict[str, Any]]] = {}
    for r in _load(out):
        other = ", ".join(f"{k} {v:g}" for k, v in sorted(r.get("extra", {}).items())) or "preset's"
        groups.setdefault((r["preset"], r["mechanism"], r["server_lr"], other), []).append(r)
    lines = ["| preset | mechanism | ε (δ) | server lr | other values | seeds | initial loss | final loss (mean ± sd) | "
             "baseline acc | final accuracy (mean ± sd) | seeds that learned | minutes/run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (preset, kind, lr, other), runs in sorted(groups.items()):
        losses = [r["final"]["loss"] for r in runs]
        accs = [r["final"]["accuracy"] for r in runs]
        learned = sum(r["final"]["loss"] < r["initial"]["loss"] and r["final"]["accuracy"] > r["baseline_accuracy"]
                      for r in runs)
        lines.append(f"| {preset} | {kind} | {runs[0]['epsilon']:.3g} ({runs[0]['delta']:g}) | {lr:g} | {other} | "
                     f"{','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} | "
                     f"{runs[0]['initial']['loss']:.4f} | {_mean_sd(losses)} | {runs[0]['baseline_accuracy']:.4f} | "
                     f"{_mean_sd(accs)} | {learned} of {len(runs)} | "
                     f"{statistics.mean(r['seconds'] for r in runs) / 60:.2f} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--preset", required=True)
    p.add_argument("--mechanism", help="another mechanism kind (e.g. dp-sgd: independent noise at the same ε)")
    p.add_argument("--lrs", required=True, help="server learning rates, comma-separated")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT, help=f"records directory (default {OUT})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=NUMBER",
                   help="another RunConfig value for these runs (e.g. client-lr=0.5); repeatable")
    r = sub.add_parser("report")
    r.add_argument("--out", type=Path, default=OUT)
    b = sub.add_parser("baseline", help="the initial model's held-out loss and the majority baseline")
    b.add_argument("--preset", required=True)
    args = parser.parse_args()
    if args.command == "baseline":
        print(json.dumps(initial_and_baseline(args.preset)))
        return
    if args.command == "report":
        print(report(args.out))
        return
    extra = {k: float(v) for k, v in (item.split("=", 1) for item in args.set)}
    for seed in (int(s) for s in args.seeds.split(",")):
        for lr in (float(x) for x in args.lrs.split(",")):
            r = run_one(args.preset, args.mechanism, lr, seed, args.workers, args.out, extra=extra)
            print(f"{_key(args.preset, r['mechanism'], lr, seed, extra)}: loss {r['initial']['loss']:.4f} -> "
                  f"{r['final']['loss']:.4f}, acc {r['final']['accuracy']:.4f} (baseline "
                  f"{r['baseline_accuracy']:.4f}) in {r['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
