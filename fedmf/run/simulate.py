"""Simulated private federated training in process: presets, the run, its results and plot.

``fedmf simulate`` (fedmf/cli/simulate.py) builds a ``RunConfig`` from a preset plus
overrides, takes the preset's task from ``fedmf.tasks`` (at the edge: the engine itself knows
no task), and calls ``simulate``, which runs
``fedmf.run.federated.train`` (the same private round the Flower server runs) and writes, next to
the ledger and checkpoints in the output directory, ``final-model.pt``, ``results.json`` and
``progress.png``. Both always cover the whole run (``run_history``: the ledger's committed rounds
with the round log's records), however many processes, re-runs and resumes it took.

``--backend flower`` runs the same configuration as the Flower app on the Flower simulation engine:
``launcher/flower_backend.py``, which the CLI finds through the ``fedmf.simulate_backends`` entry
point (nothing here imports it), reads the finished run back into the same ``SimulationResult``
with ``run_history`` and ``write_outputs``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import DEFAULTS, RunConfig
from ..errors import ConfigError
from ..files import atomic_write
from .cohort import counts as cohort_counts
from .progress import ProgressCallback

__all__ = ["PRESETS", "PRESET_COST", "PRESET_EVAL_EVERY", "preset_values", "simulate", "SimulationResult", "run_history", "write_outputs",
           "record_elapsed", "ELAPSED_FILE", "chain_head"]

#: preset → what it changes in ``DEFAULTS`` (kebab-case RunConfig keys; a changed task brings its own
#: ``task-options``, which replace the table's). Every preset calibrates z for its target ε
#: (noise-multiplier 0 instead of the table's fixed z). Each preset's learning rates, momentum, clip
#: norm and epochs come from a tuning with its own mechanism and ε over 3 seeds, recorded in
#: EXPERIMENTS.md ("Presets"); costs are wall-clock on a shared 2-core machine, one user at a time.
PRESETS: dict[str, dict[str, Any]] = {
    # about 5 s (20 rounds): the generated classification task. bsr, ε 8; server lr 0.5, client lr 0.5,
    # clip 0.5, momentum 0.5 (EXPERIMENTS.md "Presets": held-out loss 1.47 -> 0.15, accuracy 0.94)
    "tiny": {"task-options": {"num_users": 40}, "rounds": 20, "min-sep": 4, "clients-per-round": 8,
             "noise-multiplier": 0.0, "target-epsilon": 8.0, "server-momentum": 0.5, "server-lr": 0.5,
             "client-lr": 0.5, "clip-norm": 0.5},
    # 16-22 minutes at a load average of 8-17 on 2 cores, 61 s idle (40 rounds x 40 users):
    # synthetic StackOverflow-like text, the small LSTM; bsr, ε 8; server lr 3 (better than 1 on seed 0;
    # not bracketed above), client lr 1, 3 local epochs (EXPERIMENTS.md "Presets": held-out loss
    # 7.60 -> 4.80, accuracy 0.158 against 0.081 for EOS, 3 seeds)
    "so-tiny": {"task": "so-synthetic",
                "task-options": {"num_users": 800, "vocab_size": 2000, "max_sentences": 32, "model_size": "small"},
                "rounds": 40, "min-sep": 10, "clients-per-round": 40, "noise-multiplier": 0.0, "target-epsilon": 8.0,
                "server-lr": 3.0, "client-lr": 1.0, "local-epochs": 3},
    # 23 minutes on an idle 2-core machine (1403 s measured; 200 rounds x 100 users, a held-out evaluation every round):
    # EXPERIMENTS.md's so-small configuration exactly, banded-toeplitz (32 bands) at ε 8 with its tuned
    # server lr 1 (3 seeds: accuracy 0.192 against 0.166 for independent noise, dp-sgd, tuned at that ε)
    "so-small": {"task": "so-synthetic",
                 "task-options": {"num_users": 5000, "vocab_size": 10000, "max_sentences": 64, "model_size": "small"},
                 "mechanism": "banded-toeplitz", "num-bands": 32, "rounds": 200, "min-sep": 40,
                 "clients-per-round": 100, "noise-multiplier": 0.0, "target-epsilon": 8.0, "delta": 1e-6,
                 "server-momentum": 0.9, "client-lr": 0.5},
    # the paper's geometry ("Multi-Epoch MF" StackOverflow, Sec. 5.2 / App. F): 2,052 rounds of 1,000
    # users, k = 6, b = 342, δ = 1e-6, ε 8.84; SGD with momentum 0.95 and a linear learning-rate cooldown
    # over the last 25% of rounds, both in the workload A, factorized directly as the paper's MF6,6e;
    # server lr 1, client lr 1 (its Fig. 12). BLT is optimized for that exact A (the Toeplitz kinds
    # need a workload without cooldown; dense does not finish at n = 2052 on 2 cores): planning takes
    # 3-5 minutes on 2 cores; training is for a large machine (about 16 days on 2 cores)
    "so-paper": {"task": "so-synthetic",
                 "task-options": {"num_users": 342477, "vocab_size": 10000, "max_sentences": 256,
                                  "model_size": "paper"},
                 "mechanism": "blt", "rounds": 2052, "min-sep": 342,
                 "max-participations": 6, "clients-per-round": 1000, "noise-multiplier": 0.0, "target-epsilon": 8.84,
                 "delta": 1e-6, "server-momentum": 0.95, "server-cooldown": 0.25, "client-lr": 1.0},
    # 120 rounds x 40 users: 8.4 minutes on an idle 2-core machine (504 s measured), with the held-out evaluation of 20,044
    # lines every 10th round (PRESET_EVAL_EVERY; every round: 30-60 minutes): real text (roles as users),
    # EXPERIMENTS.md's shakespeare configuration exactly, banded-toeplitz (20 bands) at ε 8 with its tuned
    # server lr 1/4 (3 seeds: accuracy 0.155 against 0.140 for independent noise, dp-sgd, tuned at the same ε)
    "shakespeare": {"task": "shakespeare", "task-options": {"model_size": "small"}, "mechanism": "banded-toeplitz",
                    "rounds": 120, "min-sep": 20, "clients-per-round": 40, "noise-multiplier": 0.0,
                    "target-epsilon": 8.0, "server-momentum": 0.9, "server-lr": 0.25, "client-lr": 0.5},
}


#: preset → its expected cost on 2 CPU cores, in process (``fedmf simulate --help`` shows it; README's
#: table of times says how each was measured). Keep it next to the preset's numbers when they change.
#: preset → its in-process held-out evaluation interval (``fedmf simulate --eval-every``; default 1):
#: shakespeare's 20,044 held-out lines take longer than a round's training on 2 cores (EXPERIMENTS.md
#: evaluated every 10th round too)
PRESET_EVAL_EVERY: dict[str, int] = {"shakespeare": 10}

PRESET_COST: dict[str, str] = {
    "tiny": "seconds",
    "so-tiny": "about a minute (61 s idle; 16-22 min on a loaded machine)",
    "so-small": "about 23 minutes idle (1403 s measured)",
    "shakespeare": "about 8 minutes idle (504 s measured; the held-out evaluation every 10th round; 30-60 min loaded with --eval-every 1)",
    "so-paper": "3-5 minutes to plan, then days of training (the paper's geometry: for a large machine with a GPU)",
}


def preset_values(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every RunConfig value of a preset: ``DEFAULTS``, the preset's changes, then ``overrides``
    (``task-options`` merged into the preset's)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    overrides = overrides or {}
    preset = PRESETS[name]
    values = {**DEFAULTS, **preset}
    values["task-options"] = dict(preset["task-options"]) if "task-options" in preset else \
        json.loads(DEFAULTS["task-options"])
    for key, value in overrides.items():
        if key == "task-options":
            values["task-options"] = {**values["task-options"], **value}
        else:
            values[key] = value
    if overrides.get("noise-multiplier"):  # an explicit z replaces the preset's target ε
        values["target-epsilon"] = DEFAULTS["target-epsilon"]
    if "min-sep" not in overrides:
        values["min-sep"] = _preset_min_sep(values)
    if "num-bands" not in overrides and not _preset_bands_apply(values):
        values["num-bands"] = DEFAULTS["num-bands"]  # the preset's bands were for its own mechanism and geometry
    values["task-options"] = json.dumps(values["task-options"], sort_keys=True)
    return values


def _preset_min_sep(values: Mapping[str, Any]) -> Any:
    """A preset's min-sep, capped at the rounds: a default that follows a smaller ``--rounds`` (b = n:
    each user at most once), as its band count does; a min-sep the user gives is kept and checked."""
    min_sep = values["min-sep"]
    try:
        rounds = int(values["rounds"])
        return min(int(min_sep), rounds) if rounds >= 1 else min_sep
    except (TypeError, ValueError):
        return min_sep  # a bad value is RunConfig's to report, in one line


def _preset_bands_apply(values: Mapping[str, Any]) -> bool:
    """Whether a preset's ``num-bands`` still fits after overrides: a banded kind, at most the rounds
    and at most min-sep (a banded C keeps its MinSep sensitivity only up to b bands)."""
    from ..mechanisms import BANDED_KINDS

    bands = values["num-bands"]
    if not bands:
        return True
    try:
        limit = min(int(values["rounds"]), int(values["min-sep"]))
    except (TypeError, ValueError):
        return True  # a bad value is RunConfig's to report, in one line
    return values["mechanism"] in BANDED_KINDS and bands <= limit


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
    #: ρ-zCDP spent so far as planned (un-amplified accounting; None where the accountant is amplified)
    rho: float | None = None
    #: wall-clock seconds of every invocation of this run directory so far, this one included
    #: (``ELAPSED_FILE``); ``seconds`` is this invocation's
    seconds_total: float | None = None
    #: the ledger's chain head at the last committed round, "ROUND:HASH" (ROUND -1: the genesis): record it
    #: outside the ledger, check it later with ``fedmf audit --verify --head ROUND:HASH``
    chain_head: str | None = None
    #: rounds without contribution / below the expected users (``fedmf.run.cohort.counts``)
    cohorts: dict[str, Any] | None = None
    #: whether the run is learning (``fedmf.run.learning_check.LearningCheck.to_dict``, over the whole run)
    learning: dict[str, Any] | None = None

    def audit_command(self) -> str:
        """``fedmf audit`` as the auditor runs it (``fedmf.audit.auditor``: never the server's role or password)."""
        from ..audit.auditor import audit_command  # here: the CLI reads PRESETS without loading the ledger's SQL

        return audit_command(self.ledger, self.run_id)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "audit": self.audit_command()}


def simulate(config: RunConfig, *, model, users, local_update=None, local_updates=None, evaluate,
             progress: bool | ProgressCallback = True, plot: bool = True, repeatable_noise: bool = False,
             plan_progress: ProgressCallback | None = None, evaluate_every: int = 1,
             secure_aggregation: tuple[Any, Any] | None = None) -> SimulationResult:
    """Train ``model`` privately under ``config`` in process over ``users`` with ``local_update``
    (``fedmf.run.federated.LocalUpdate``, one user at a time) or ``local_updates`` (a round's users
    together: vectorized clients) and server-side ``evaluate(model)``; resumes from
    ``config.run_dir``. The caller (the CLI) takes these from a task of ``fedmf.tasks``.
    ``repeatable_noise``: tests only, unsafe (``fedmf.run.private_run.PrivateRun.open``). The ledger's budget
    secret file (lifetime budgets) is ``config.budget_key``. ``progress``: the rounds' progress
    (``fedmf.run.federated.train``); ``plan_progress``: the mechanism optimizer's, when the plan needs one.
    The run directory's ``ELAPSED_FILE`` adds this invocation's time after every round.
    ``evaluate_every``: held-out evaluation after every n-th round and the last (``train``).
    ``secure_aggregation``: (``SecAggParams``, the ``fedmf.secure_aggregation`` entry point's factory
    (params, plan, dim, population) → the round's secure sum): every round is summed by secure
    aggregation, and the plan records it (``RunPlan.with_secure_aggregation``: its fingerprint, σ from ζ_eff)."""
    from .federated import train

    started = time.perf_counter()
    token = secrets.token_hex(8)  # this invocation's entry in ELAPSED_FILE
    plan = config.build_plan(config.build_mechanism(progress=plan_progress))
    secure_sum = None
    if secure_aggregation is not None:
        params, factory = secure_aggregation
        dim = sum(p.numel() for p in model.parameters())
        secure_sum = factory(params, plan, dim, len(list(users)))  # refuses a cohort that could wrap
        plan = plan.with_secure_aggregation(params, dim)

    def on_round(record) -> None:
        record_elapsed(config.run_dir, token, time.perf_counter() - started)

    check = learning_check(config)
    result = train(model, users, plan, local_update, local_updates=local_updates, server_lr=config.server_lr,
                   checkpoint_dir=config.run_dir, on_round=on_round,
                   ledger=config.ledger_url, evaluate=evaluate, progress=progress, repeatable_noise=repeatable_noise,
                   ledger_diagnostics=config.ledger_diagnostics, budget_key=config.budget_key,
                   witness=config.witness, min_clients_per_round=config.min_clients_per_round, learning=check,
                   evaluate_every=evaluate_every, secure_sum=secure_sum)
    import torch

    # the final model, as the Flower ServerApp writes it (both backends leave the same files)
    atomic_write(Path(config.run_dir) / "final-model.pt", lambda f: torch.save(model.state_dict(), f), text=False,
                 mode=0o600)
    history = run_history(config, plan, result.run_id)  # the whole run, not only the rounds of this process
    if history and not history[-1]["metrics"] and evaluate is not None:
        with torch.no_grad():  # the last round's log line is missing (a stop between its commit and release)
            history[-1]["metrics"] = {k: float(v) for k, v in evaluate(model).items()}
    accuracy = next((h["metrics"].get("accuracy") for h in reversed(history) if "accuracy" in h["metrics"]), None)
    out = SimulationResult(config.run_dir, result.ledger, result.run_id, result.rounds_done, result.stopped,
                           plan.epsilon_after(result.rounds_done - 1) if result.rounds_done else 0.0, plan.delta,
                           plan.noise_multiplier, accuracy, time.perf_counter() - started, history,
                           rho=rho_spent(plan, result.rounds_done), chain_head=result.head,
                           cohorts=cohort_counts(history, plan, result.min_cohort),
                           learning=check.replay(history).to_dict())
    return write_outputs(out, config.run_dir, plot, token=token)


def _open_ledger(config: RunConfig):
    """``config``'s ledger, opened with its run directory's ledger secret (read-only use)."""
    from ..ledger import Ledger

    directory = Path(config.run_dir)
    try:
        secret = (directory / "secrets" / "ledger_secret").read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the run's ledger secret in {str(directory)!r}: {e.strerror or e}") from None
    return Ledger.open(config.ledger_url or str(directory / "ledger.db"), secret=secret)


def chain_head(config: RunConfig, run_id: int) -> str:
    """Run ``run_id``'s chain head in ``config``'s ledger as "ROUND:HASH" (the last committed round's
    hash; -1 and the genesis before round 0), read with the run's ledger secret."""
    with _open_ledger(config) as book:
        run = book.run(run_id)
        last = run.next_round - 1
        return f"{last}:{run.round(last).chain_sha256 if last >= 0 else run.info.genesis_sha256}"


def learning_check(config: RunConfig, flag: str = "--"):
    """The run's ``fedmf.run.learning_check.LearningCheck``, its advice naming ``config``'s values."""
    from .learning_check import LearningCheck

    settings = {"server-lr": config.server_lr, "clip-norm": config.clip_norm}
    if config.target_epsilon is not None:
        settings["epsilon"] = config.target_epsilon
    return LearningCheck(settings=settings, flag=flag, stop_when_diverging=config.stop_when_diverging)


def rho_spent(plan, rounds_done: int) -> float | None:
    """The planned ρ-zCDP after ``rounds_done`` rounds (None where the accountant is amplified)."""
    rho = plan.rho_after(rounds_done - 1) if rounds_done else 0.0
    return None if plan.rho() is None else rho


def run_history(config: RunConfig, plan, run_id: int) -> list[dict[str, Any]]:
    """Every committed round of run ``run_id`` of ``config.run_dir``, in order, rebuilt from what is
    durable across re-runs and resumes: the ledger's committed rounds, each with the record its round
    log line holds (``fedmf.run.round_log``: ``RoundRecord`` fields with the released metrics). A committed
    round without a log line (the process died between the commit and the release) keeps the ledger's
    counts, no metrics, and ``None`` for what only the log knew."""
    from ..round.adaptive_clipping import adaptive_metrics
    from .round_log import read_rounds

    directory = Path(config.run_dir)
    with _open_ledger(config) as book:
        run = book.run(run_id)
        plan.check_fingerprint(run.info.plan_fingerprint, f"ledger run {run_id}")
        rounds = [run.round(t) for t in range(run.next_round)]
    logged = read_rounds(directory, run_id, {r.round_index: r.checkpoint_sha256 for r in rounds})
    history = []
    for r in rounds:
        entry = logged.get(r.round_index)
        if entry is None:
            entry = {"round": r.round_index, "epsilon": plan.epsilon_after(r.round_index), "selected": r.selected,
                     "contributed": r.contributed, "dropped": r.dropped, "rejected": r.rejected, "clipped": r.clipped,
                     "zeroed": None, "seconds": None, "checkpoint_bytes": None, "metrics": {}}
            if r.clip_norm is not None:  # adaptive clipping: ζₜ and b̃ₜ are in the ledger
                entry["metrics"] = adaptive_metrics(r.clip_norm, r.noisy_unclipped, plan.expected_users)
        history.append(entry)
    return history


#: ``<run-dir>/elapsed.json``: wall-clock seconds of each invocation that ran rounds in the directory
ELAPSED_FILE = "elapsed.json"


def record_elapsed(run_dir: str | os.PathLike, token: str, seconds: float) -> float:
    """Record ``seconds`` as invocation ``token``'s time in ``run_dir``'s ``ELAPSED_FILE`` (replacing its
    earlier value: an invocation updates its entry after every round, so a killed one keeps the time up
    to its last round); returns the run's total over every invocation. A damaged file starts over."""
    path = Path(run_dir) / ELAPSED_FILE
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["invocations"]
        entries = {str(k): float(v) for k, v in entries.items() if math.isfinite(float(v)) and float(v) >= 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        entries = {}
    entries[token] = float(seconds)
    atomic_write(path, lambda f: json.dump({"invocations": entries}, f), text=True, mode=0o600)
    return sum(entries.values())


def write_outputs(out: SimulationResult, run_dir: str, plot: bool, token: str | None = None) -> SimulationResult:
    """Write ``results.json`` (and ``progress.png`` with ``plot``) of ``out`` into ``run_dir``; ``out``,
    with ``seconds_total`` (``out.seconds`` recorded as invocation ``token``, default a new one)."""
    directory = Path(run_dir)
    out.seconds_total = record_elapsed(run_dir, token or secrets.token_hex(8), out.seconds)
    if plot and out.history:
        out.plot = str(directory / "progress.png")
        _plot(out.history, out.plot)
    if out.accuracy is not None and not math.isfinite(out.accuracy):
        out.accuracy = None
    for entry in out.history:  # JSON has no NaN or infinity: a non-finite metric is null
        entry["metrics"] = {k: v if not isinstance(v, float) or math.isfinite(v) else None
                            for k, v in entry["metrics"].items()}
    atomic_write(directory / "results.json", lambda f: json.dump(out.to_dict(), f, indent=1, allow_nan=False),
                 text=True, mode=0o600)
    return out


def _plot(history: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h["round"] for h in history]  # 0-based, as the ledger numbers them (ARCHITECTURE.md, Names)
    zetas = [h["metrics"].get("clip-norm", math.nan) for h in history]
    adaptive = any(not math.isnan(z) for z in zetas)  # adaptive clipping: a panel for ζₜ below
    if adaptive:
        fig, (left, lower) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        lower.plot(rounds, zetas, color="tab:green", drawstyle="steps-mid")
        lower.set_yscale("log")
        lower.set_xlabel("round (0-based)")
        lower.set_ylabel("clip norm ζ")
        lower.set_title("adaptive clip norm by round")
    else:
        fig, left = plt.subplots(figsize=(7, 4))
    accuracy = [h["metrics"].get("accuracy", math.nan) for h in history]
    left.plot(rounds, accuracy, color="tab:blue", label="held-out accuracy")
    if not adaptive:  # the ζ panel below carries the round axis
        left.set_xlabel("round (0-based)")
    left.set_ylabel("held-out accuracy", color="tab:blue")
    right = left.twinx()
    right.plot(rounds, [h["epsilon"] for h in history], color="tab:red", label="epsilon spent (planned)")
    right.set_ylabel("epsilon spent (planned)", color="tab:red")
    left.set_title("held-out accuracy and epsilon by round")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"), text=False, mode=0o600)
    plt.close(fig)
