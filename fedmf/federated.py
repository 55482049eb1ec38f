"""Private federated training in a plain PyTorch loop — the in-process backend, and the
reference the Flower strategy must match bit for bit.

    result = train(model, users, plan, local_update, checkpoint_dir="run/", server_lr=1.0)

Each round t follows ARCHITECTURE.md's data flow:
guard → select → open + record selection → local updates → validate, zero, clip, sum → noise →
divide by the planned expected users → server optimizer (exactly the workload A) → checkpoint →
ledger commit (naming the checkpoint's hash) → only then release (progress, evaluation, callbacks).

Started again with the same plan and directory, ``train`` resumes after the last committed
round; a round that was not committed is redone with the same selection and the same noise.
With deterministic local updates the final model is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch

from .checkpoint import CheckpointStore, RunSecrets
from .errors import ConfigError, FedmfError, HorizonReached, PrivacyBudgetExceeded
from .files import atomic_write
from .plan import RunPlan
from .privatize import RoundPrivatizer, RoundReport, layout_of

__all__ = ["train", "TrainResult", "RoundRecord", "LocalUpdate", "EVENTS"]

#: a user's update: a mapping name → tensor (the model delta), or None when the user dropped out
LocalUpdate = Callable[[Mapping[str, torch.Tensor], Hashable, int], Mapping[str, torch.Tensor] | None]
#: the points of a round at which ``on_event(event, t)`` is called (fault-injection tests use them)
EVENTS = ("guarded", "selected", "updates", "noised", "stepped", "checkpointed", "committed", "released")
_RUN_FILE = "run.json"


@dataclass
class RoundRecord:
    """What a round released once committed (no noise, no per-user data)."""

    round: int
    epsilon: float
    selected: int
    contributed: int
    dropped: int
    rejected: int
    clipped: int
    zeroed: int
    seconds: float
    checkpoint_bytes: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    run_id: int
    ledger: str
    rounds_done: int
    stopped: str
    history: list[RoundRecord]
    plan: dict[str, Any]

    def audit_command(self) -> str:
        return f"fedmf audit --ledger {self.ledger} --run {self.run_id}"


def _param_dtype(params: Mapping[str, torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    dtypes = {p.dtype for p in params.values()}
    devices = {p.device for p in params.values()}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ConfigError("all trainable parameters must share one floating dtype and one device")
    dtype = dtypes.pop()
    if not dtype.is_floating_point:
        raise ConfigError(f"trainable parameters must be floating point, got {dtype}")
    return dtype, devices.pop()


class _Progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled and total > 0, total

    def show(self, record: RoundRecord) -> None:
        if not self.enabled:
            return
        metrics = " ".join(f"{k} {v:.4g}" for k, v in record.metrics.items())
        sys.stderr.write(f"\rround {record.round + 1}/{self.total}  eps {record.epsilon:.4g}  users "
                         f"{record.contributed}/{record.selected}  {metrics}".ljust(79))
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def train(
    model: torch.nn.Module,
    users: Sequence[Hashable],
    plan: RunPlan,
    local_update: LocalUpdate,
    *,
    server_lr: float = 1.0,
    rounds: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    ledger: str | os.PathLike | None = None,
    available: Callable[[int], Iterable[Hashable]] | None = None,
    evaluate: Callable[[torch.nn.Module], Mapping[str, float]] | None = None,
    on_event: Callable[[str, int], None] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    observed_guard: bool | None = None,
    progress: bool = False,
) -> TrainResult:
    """Train ``model`` privately under ``plan`` over ``users`` (ids with a stable ``str``).

    ``local_update(params, user, t)`` gets a copy of the global parameters and returns the
    user's model delta (or None: the user dropped out). ``rounds``: stop after this many rounds
    in total (default: the plan's horizon). ``checkpoint_dir``: checkpoints, secrets (0600) and
    by default the SQLite ledger; the run resumes from it. ``available(t)``: the users reachable
    in round t (default: all). ``evaluate(model)`` runs after each commit (server-side held-out
    data). ``observed_guard`` (default: on for unamplified runs) also stops before a round when a
    user's observed ε, accounted from the ledger, exceeds the target."""
    from .ledger import Ledger
    from .schedule import make_scheduler
    from .server_optimizer import server_optimizer

    if not isinstance(plan, RunPlan):
        raise ConfigError(f"plan must be a RunPlan, got {type(plan).__name__}")
    users = list(users)
    if not users or len({str(u) for u in users}) != len(users):
        raise ConfigError("users must be a non-empty list of distinct ids (distinct as strings)")
    end = plan.rounds if rounds is None else int(rounds)
    if not 0 < end <= plan.rounds:
        raise ConfigError(f"rounds must lie in [1, {plan.rounds}], got {rounds!r}")
    if observed_guard is None:
        observed_guard = plan.sampling.kind == "none" and plan.target_epsilon is not None

    temporary = None
    if checkpoint_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="fedmf-")
        checkpoint_dir = temporary.name
    directory = Path(checkpoint_dir)
    store = CheckpointStore(directory)
    secrets = RunSecrets(directory / "secrets")
    ledger_url = str(ledger) if ledger is not None else str(directory / "ledger.db")
    book = Ledger.open(ledger_url, secret=secrets.ledger_secret)
    try:
        params = dict(model.named_parameters())
        dtype, device = _param_dtype(params)
        privatizer = RoundPrivatizer(plan, layout_of(params), device=device, dtype=dtype, seed=secrets.noise_seed)
        optimizer = server_optimizer(params, plan.mechanism.workload, plan.rounds, server_lr)
        scheduler = make_scheduler(plan.schema, plan.sampling, key=secrets.schedule_key, rounds=plan.rounds,
                                   users_per_round=_users_per_round(plan), population=users)
        run, start = _open_run(book, directory, store, plan, model, privatizer, optimizer, scheduler)
        history: list[RoundRecord] = []
        stopped = "horizon" if end == plan.rounds else "rounds"
        bar = _Progress(progress, end)
        event = on_event or (lambda name, t: None)
        try:
            for t in range(start, end):
                try:
                    observed = _observed_epsilon(book, run, plan) if observed_guard and t > 0 else None
                    plan.guard(t, observed)
                except (PrivacyBudgetExceeded, HorizonReached) as e:
                    stopped = f"guard: {e}"
                    break
                event("guarded", t)
                record = _round(t, model, params, users, plan, local_update, run, privatizer, optimizer, scheduler,
                                store, available, event)
                if evaluate is not None:  # released only now: round t is committed
                    record.metrics.update({k: float(v) for k, v in evaluate(model).items()})
                event("released", t)
                history.append(record)
                bar.show(record)
                if on_round is not None:
                    on_round(record)
        finally:
            bar.close()
        done = run.next_round
        return TrainResult(run.id, ledger_url if ledger is not None else str(directory / "ledger.db"), done, stopped,
                           history, plan.to_dict())
    finally:
        book.close()
        if temporary is not None:
            temporary.cleanup()


def _users_per_round(plan: RunPlan) -> int | None:
    if plan.sampling.kind != "none":
        return None
    m = plan.expected_users
    return int(m) if float(m).is_integer() else None


def _open_run(book, directory: Path, store: CheckpointStore, plan: RunPlan, model, privatizer, optimizer,
              scheduler):
    """The ledger run to continue (restoring the last committed checkpoint) or a new one."""
    run_file = directory / _RUN_FILE
    if run_file.exists():
        try:
            recorded = json.loads(run_file.read_text(encoding="utf-8"))
            run_id, fingerprint = int(recorded["run_id"]), recorded["plan_fingerprint"]
            initial_sha256 = str(recorded["initial_sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"{str(run_file)!r} is damaged") from None
        plan.check_fingerprint(fingerprint, f"checkpoint directory {str(directory)!r}")
        run = book.run(run_id)
        plan.check_fingerprint(run.info.plan_fingerprint, f"ledger run {run_id}")
        start = run.next_round
        last = start - 1  # -1: the initial state, before round 0
        digest = run.round(last).checkpoint_sha256 if last >= 0 else initial_sha256
        state = store.load(last, digest)
        plan.check_fingerprint(state.get("plan_fingerprint"), f"checkpoint of round {last}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        privatizer.load_state_dict(state["privatizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        return run, start
    initial_sha256 = store.save(-1, _state(plan, model, optimizer, privatizer, scheduler))
    run = book.create_run(plan.mechanism, noise_multiplier=plan.noise_multiplier, clip_norm=plan.clip_norm,
                          delta=plan.delta, target_epsilon=plan.target_epsilon, schema=plan.schema,
                          sampling=str(plan.sampling), plan=plan.to_dict(), plan_fingerprint=plan.fingerprint)
    record = {"run_id": run.id, "plan_fingerprint": plan.fingerprint, "initial_sha256": initial_sha256}
    atomic_write(run_file, lambda f: json.dump(record, f), text=True)
    return run, 0


def _state(plan: RunPlan, model, optimizer, privatizer, scheduler) -> dict[str, Any]:
    """Everything a resumed run needs, secrets excepted."""
    return {"plan_fingerprint": plan.fingerprint, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "privatizer": privatizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state()}}


def _observed_epsilon(book, run, plan: RunPlan) -> float | None:
    """The worst user's ε over the committed rounds, accounted from the ledger's pattern."""
    from .accounting.posthoc import account_observed

    observed = run.observed_pattern()
    if not observed.rounds_by_user:
        return None
    report = account_observed(plan.mechanism, plan.noise_multiplier, plan.delta, observed, plan.schema,
                              accountant=plan.accountant)
    return report.epsilon


def _round(t, model, params, users, plan, local_update, run, privatizer, optimizer, scheduler, store, available,
           event) -> RoundRecord:
    started = time.perf_counter()
    reachable_now = users if available is None else list(available(t))
    selection = scheduler.select(t, reachable_now)
    event("selected", t)
    run.open_round(t)
    try:
        accepted = run.record_selection(t, list(selection.selected))
        if len(accepted) != len(selection.selected):  # the scheduler enforces the schema; the ledger agrees
            raise FedmfError(f"round {t}: the ledger refused users the scheduler selected (a plan mismatch)")
        updates: dict[Hashable, Any] = {}
        for user in selection.reachable:
            snapshot = {name: p.detach().clone() for name, p in params.items()}
            update = local_update(snapshot, user, t)
            if update is not None:
                updates[user] = update
        event("updates", t)
        mean, report = privatizer.privatize(t, updates, selected=selection.selected)
        event("noised", t)
        optimizer.step(mean)
        event("stepped", t)
        for user_report in report.users:
            if user_report.status == "contributed":
                run.record_contribution(t, user_report.user, update_norm=user_report.norm,
                                        clipped=user_report.clipped)
            else:
                run.record_rejection(t, user_report.user, user_report.reason)
        digest = store.save(t, _state(plan, model, optimizer, privatizer, scheduler))
        event("checkpointed", t)
        summary = run.commit_round(t, noise_std=plan.noise_std, epsilon_planned=plan.epsilon_after(t),
                                   checkpoint_sha256=digest)
    except BaseException:
        try:
            run.abort_round(t, "the server stopped during the round")
        except Exception:
            pass  # the round stays open; resume takes it over as a new attempt
        raise
    event("committed", t)
    store.prune(keep=t)
    counts = report.counts()
    return RoundRecord(t, plan.epsilon_after(t), summary.selected, summary.contributed, summary.dropped,
                       summary.rejected, summary.clipped, counts["zeroed"], time.perf_counter() - started,
                       store.last_bytes)
