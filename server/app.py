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

from fedmf.config import RunConfig
from fedmf.errors import CheckpointError, FedmfError
from fedmf.files import atomic_write
from fedmf.run import REPEATABLE_NOISE_WARNING, PrivateRun, repeatable_noise_from_env

from .identity import identity_policy
from .strategy import DPMFStrategy

__all__ = ["app", "run_server", "ServerAppError"]

log = logging.getLogger("fedmf.server")
app = ServerApp()


class ServerAppError(RuntimeError):
    """The ServerApp stopped on a user-facing error (already logged as one line)."""


def _fault_injection():
    """``FEDMF_KILL_AT=EVENT:ROUND`` (fault-injection tests only): SIGKILL this process at that
    point of that round (events: ``fedmf.run.EVENTS``)."""
    spec = os.environ.get("FEDMF_KILL_AT")
    if not spec:
        return None
    event, _, round_text = spec.partition(":")
    target = (event, int(round_text))

    def on_event(name: str, t: int) -> None:
        if (name, t) == target:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_event


def run_server(grid: Grid, run_config: dict) -> DPMFStrategy:
    """Validate the configuration (one-line errors before round 1), then run or resume; the
    final model is written to ``<run-dir>/final-model.pt`` (0600)."""
    from client.tasks import get_task

    config = RunConfig.from_mapping(run_config)
    task = get_task(config.task, **config.task_options)
    identity = identity_policy(grid, config, task.users())  # before the run opens: a deployment needs enrollment
    plan = config.build_plan()
    model = task.model()

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
                         ledger_diagnostics=config.ledger_diagnostics) as run:
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
        return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    if not log.handlers:  # our progress lines only, not every library's INFO logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        run_server(grid, dict(context.run_config))
    except FedmfError as e:
        log.error("fedmf: error: %s", e)  # the one line (on stderr through the handler above)
        # an exception (not SystemExit) so that the simulation engine too reports the run as failed
        raise ServerAppError(f"fedmf: error: {e}") from None
