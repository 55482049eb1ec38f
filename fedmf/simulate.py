"""Simulated private federated training in process: presets, the run, its results and plot.

``fedmf simulate`` (fedmf/cli/simulate.py) builds a ``RunConfig`` from a preset plus
overrides, takes the preset's task from ``client.tasks`` (at the edge: the engine itself knows
no task), and calls ``simulate``, which runs
``fedmf.federated.train`` (the same private round the Flower server runs) and writes, next to
the ledger and checkpoints in the output directory, ``results.json`` and ``progress.png``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .config import RunConfig
from .errors import ConfigError
from .files import atomic_write

__all__ = ["PRESETS", "preset_values", "simulate", "SimulationResult"]

#: preset → run configuration (kebab-case RunConfig keys; the task and its options included)
PRESETS: dict[str, dict[str, Any]] = {
    # a few seconds: the generated classification task
    "tiny": {"task": "tiny", "task-options": {"num_users": 40}, "mechanism": "bsr", "rounds": 20, "min-sep": 4,
             "clients-per-round": 8, "target-epsilon": 8.0, "delta": 1e-5, "server-lr": 1.0, "server-momentum": 0.5,
             "client-lr": 0.2, "batch-size": 16},
    # a few minutes on 2 cores: synthetic StackOverflow-like text, the small LSTM
    "so-tiny": {"task": "so-synthetic",
                "task-options": {"num_users": 400, "vocab_size": 2000, "max_sentences": 32, "model_size": "small"},
                "mechanism": "bsr", "rounds": 40, "min-sep": 10, "clients-per-round": 20, "target-epsilon": 8.0,
                "delta": 1e-5, "server-lr": 1.0, "server-momentum": 0.9, "client-lr": 0.5, "batch-size": 16},
    # tens of minutes on 2 cores
    "so-small": {"task": "so-synthetic",
                 "task-options": {"num_users": 5000, "vocab_size": 10000, "max_sentences": 64, "model_size": "small"},
                 "mechanism": "banded-toeplitz", "num-bands": 32, "rounds": 300, "min-sep": 50,
                 "clients-per-round": 100, "target-epsilon": 8.0, "delta": 1e-6, "server-lr": 1.0,
                 "server-momentum": 0.9, "client-lr": 0.5, "batch-size": 16},
    # the paper's geometry ("Multi-Epoch MF" StackOverflow): for a large machine
    "so-paper": {"task": "so-synthetic",
                 "task-options": {"num_users": 342477, "vocab_size": 10000, "max_sentences": 256,
                                  "model_size": "paper"},
                 "mechanism": "banded-toeplitz", "num-bands": 64, "rounds": 2052, "min-sep": 342,
                 "max-participations": 6, "clients-per-round": 1000, "target-epsilon": 8.84, "delta": 1e-6,
                 "server-lr": 1.0, "server-momentum": 0.95, "server-cooldown": 0.25, "client-lr": 0.5,
                 "batch-size": 16, "clip-norm": 1.0},
    # real text (Shakespeare roles as users)
    "shakespeare": {"task": "shakespeare", "task-options": {"model_size": "small"}, "mechanism": "bsr", "rounds": 40,
                    "min-sep": 10, "clients-per-round": 20, "target-epsilon": 8.0, "delta": 1e-5, "server-lr": 1.0,
                    "server-momentum": 0.9, "client-lr": 0.5, "batch-size": 16},
}


def preset_values(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A preset's RunConfig values with ``overrides`` applied (``task-options`` merged)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PRESETS[name].items()}
    for key, value in (overrides or {}).items():
        if key == "task-options":
            values["task-options"] = {**values.get("task-options", {}), **value}
        else:
            values[key] = value
    if (overrides or {}).get("noise-multiplier"):  # an explicit z replaces the preset's target ε
        values.pop("target-epsilon", None)
    values["task-options"] = json.dumps(values.get("task-options", {}), sort_keys=True)
    return values


@dataclass
class SimulationResult:
    out_dir: str
    ledger: str
    run_id: int
    rounds_done: int
    stopped: str
    epsilon: float
    delta: float
    noise_multiplier: float
    accuracy: float | None
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    plot: str | None = None

    def audit_command(self) -> str:
        return f"fedmf audit --ledger {self.ledger} --run {self.run_id}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "audit": self.audit_command()}


def simulate(config: RunConfig, *, model, users, local_update, evaluate, progress: bool = True,
             plot: bool = True) -> SimulationResult:
    """Train ``model`` privately under ``config`` in process over ``users`` with ``local_update``
    (``fedmf.federated.LocalUpdate``) and server-side ``evaluate(model)``; resumes from
    ``config.run_dir``. The caller (the CLI) takes these from a task of ``client.tasks``."""
    from .federated import train

    started = time.perf_counter()
    plan = config.build_plan()
    result = train(model, users, plan, local_update, server_lr=config.server_lr, checkpoint_dir=config.run_dir,
                   ledger=config.ledger_url, evaluate=evaluate, progress=progress)
    history = [asdict(r) for r in result.history]
    accuracy = next((h["metrics"].get("accuracy") for h in reversed(history) if "accuracy" in h["metrics"]), None)
    out = SimulationResult(config.run_dir, result.ledger, result.run_id, result.rounds_done, result.stopped,
                           plan.epsilon_after(result.rounds_done - 1) if result.rounds_done else 0.0, plan.delta,
                           plan.noise_multiplier, accuracy, time.perf_counter() - started, history)
    directory = Path(config.run_dir)
    if plot and history:
        out.plot = str(directory / "progress.png")
        _plot(history, out.plot)
    atomic_write(directory / "results.json", lambda f: json.dump(out.to_dict(), f, indent=1, allow_nan=False),
                 text=True, mode=0o600)
    return out


def _plot(history: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h["round"] + 1 for h in history]
    fig, left = plt.subplots(figsize=(7, 4))
    accuracy = [h["metrics"].get("accuracy", math.nan) for h in history]
    left.plot(rounds, accuracy, color="tab:blue", label="held-out accuracy")
    left.set_xlabel("round")
    left.set_ylabel("held-out accuracy", color="tab:blue")
    right = left.twinx()
    right.plot(rounds, [h["epsilon"] for h in history], color="tab:red", label="epsilon spent (planned)")
    right.set_ylabel("epsilon spent (planned)", color="tab:red")
    left.set_title("held-out accuracy and epsilon by round")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"), text=False, mode=0o600)
    plt.close(fig)
