"""The Flower ServerApp: read the run configuration, open (or resume) the private run, start the
DP-MF strategy. ``flwr run .`` runs it (see the README)."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedmf.errors import CheckpointError, FedmfError
from fedmf.files import atomic_write
from fedmf.ledger.db import public_url
from fedmf.run.outcome import STOP_PREFIXES, RunOutcome, write_outcome
from fedmf.run.private_run import REPEATABLE_NOISE_WARNING, PrivateRun, repeatable_noise_from_env

from .config import ServerConfig
from .identity import identity_policy
from .secagg_round import run_quantization
from .strategy import DPMFStrategy

__all__ = ["app", "run_server", "ServerAppError"]

log = logging.getLogger("fedmf.server")
app = ServerApp()


class ServerAppError(RuntimeError):
    """The ServerApp stopped on a user-facing error (already logged as one line)."""


class _NoTracebackForServerAppError(logging.Filter):
    """Flower logs the exception that ends a ServerApp with its traceback ("ServerApp raised an
    exception", "Simulation raised an exception"); a ``ServerAppError`` was already logged as one
    line, so its record keeps one line and loses the traceback. The run still ends as failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ServerAppError):
            record.exc_info = None
            record.exc_text = None
            record.msg, record.args = "%s stopped: %s", (str(record.args[0]) if record.args else "ServerApp", error)
        return True


def _quiet_flower_tracebacks() -> None:
    """Install ``_NoTracebackForServerAppError`` on Flower's logger (once per process)."""
    flower = logging.getLogger("flwr")
    if not any(isinstance(f, _NoTracebackForServerAppError) for f in flower.filters):
        flower.addFilter(_NoTracebackForServerAppError())


def _fault_injection():
    """``FEDMF_KILL_AT=EVENT:ROUND`` (fault-injection tests only): SIGKILL this process at that
    point of that round (events: ``fedmf.run.private_run.EVENTS``)."""
    spec = os.environ.get("FEDMF_KILL_AT")
    if not spec:
        return None
    event, _, round_text = spec.partition(":")
    target = (event, int(round_text))

    def on_event(name: str, t: int) -> None:
        if (name, t) == target:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_event


def _stopped(strategy: DPMFStrategy) -> str:
    """The strategy's stop as ``RunOutcome.stopped``: "horizon", "rounds", "guard: <why>", "cohort: <why>"
    (too few users could join a round: ``fedmf.run.cohort``) or "learning: <why>" (``fedmf.run.learning_check``)."""
    said = strategy.stopped
    return said if said in ("horizon", "rounds") or said.startswith(STOP_PREFIXES) else f"guard: {said}"


def _record_error(run_config: dict, run: PrivateRun | None, error: FedmfError) -> None:
    """Write the error stop to ``<run-dir>/outcome.json`` where the run directory is known and exists."""
    run_dir = run_config.get("run-dir")
    if not isinstance(run_dir, str) or not run_dir or not os.path.isdir(run_dir):
        return
    opened = run is not None
    outcome = RunOutcome(run.run_id if opened else None, run.next_round if opened else None, "error",
                         public_url(run.ledger_url) if opened else None, str(error))
    try:
        write_outcome(run_dir, outcome)
    except OSError as e:  # the error itself is the one line the operator sees
        log.warning("fedmf: warning: cannot write the run outcome in %s: %s", run_dir, e.strerror or e)


def run_server(grid: Grid, run_config: dict) -> DPMFStrategy:
    """Validate the configuration (one-line errors before round 1), then run or resume; the
    final model is written to ``<run-dir>/final-model.pt`` (0600) and how the run ended to
    ``<run-dir>/outcome.json`` (``fedmf.run.outcome``; on a ``FedmfError`` too)."""
    opened: list[PrivateRun] = []  # the run, once open (for the outcome of an error stop)
    try:
        return _serve(grid, run_config, opened)
    except FedmfError as e:
        _record_error(run_config, opened[0] if opened else None, e)
        raise


def _serve(grid: Grid, run_config: dict, opened: list[PrivateRun]) -> DPMFStrategy:
    from fedmf.tasks import get_task

    config = ServerConfig.from_mapping(run_config)
    task = get_task(config.task, **config.task_options)
    identity = identity_policy(grid, config, task.users())  # before the run opens: a deployment needs enrollment
    plan = config.build_plan()
    model = task.model()
    if config.secagg is not None:  # before the run opens: the whole population's sum must not wrap
        dim = sum(p.numel() for p in model.parameters())
        run_quantization(config.secagg, plan, dim, len(task.users()))
        plan = plan.with_secure_aggregation(config.secagg, dim)  # recorded, in the fingerprint; σ from ζ_eff

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # server-side held-out evaluation of the committed model (post-processing)
        evaluated = task.model()
        evaluated.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            return MetricRecord({k: float(v) for k, v in task.evaluate(evaluated).items()})

    repeatable = repeatable_noise_from_env()  # FEDMF_UNSAFE_REPEATABLE_NOISE=1: tests only
    if repeatable:
        log.warning("fedmf: warning: %s", REPEATABLE_NOISE_WARNING)
    with PrivateRun.open(model, plan, config.run_dir, ledger=config.ledger_url, server_lr=config.server_lr,
                         population=task.users(), on_event=_fault_injection(), repeatable_noise=repeatable,
                         ledger_diagnostics=config.ledger_diagnostics, budget_key=config.budget_key,
                         witness=config.witness, min_clients_per_round=config.min_clients_per_round) as run:
        opened.append(run)
        users = task.users()
        wanted = min(len(users), max(1, math.ceil(plan.expected_users)))
        strategy = DPMFStrategy(run, config, evaluate_fn=evaluate, identity=identity, min_available=wanted)
        strategy.start(grid)
        final = Path(config.run_dir) / "final-model.pt"
        try:
            atomic_write(final, lambda f: torch.save(run.model.state_dict(), f), text=False, mode=0o600)
        except OSError as e:  # a full disk: every round is committed, a restart writes it
            raise CheckpointError(f"cannot write the final model {str(final)!r}: {e.strerror or e}") from None
        log.info("fedmf: final model in %s", final)
        outcome = RunOutcome(run.run_id, run.next_round, _stopped(strategy), public_url(run.ledger_url))
        try:
            write_outcome(config.run_dir, outcome)
        except OSError as e:
            raise CheckpointError(f"cannot write the run outcome in {config.run_dir!r}: {e.strerror or e}") from None
        return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    if not log.handlers:  # our progress lines only, not every library's INFO logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    _quiet_flower_tracebacks()
    try:
        run_server(grid, dict(context.run_config))
    except FedmfError as e:
        log.error("fedmf: error: %s", e)  # the one line (on stderr through the handler above)
        # an exception (not SystemExit) so that the simulation engine too reports the run as failed
        raise ServerAppError(f"fedmf: error: {e}") from None
