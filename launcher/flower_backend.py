"""``fedmf simulate --backend flower``: the same configuration as the Flower app on the Flower
simulation engine (Ray), one simulated SuperNode per user, every Flower process killed afterwards
(:mod:`launcher.flower_cli`), the result read back from the run directory into the same
``SimulationResult`` as the in-process backend.

Registered in pyproject.toml as the entry point ``flower`` of the group ``fedmf.simulate_backends``;
the CLI (fedmf/cli/simulate.py) finds it there, so the engine never imports this package. How the
run ended comes from the ServerApp's ``<run-dir>/outcome.json`` (:mod:`fedmf.run.outcome`), never from its
log lines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from fedmf import checks
from fedmf.config import RunConfig
from fedmf.errors import ConfigError, FedmfError, OutcomeError
from fedmf.files import atomic_write
from fedmf.ledger.db import public_url
from fedmf.run.cohort import counts as cohort_counts
from fedmf.run.cohort import resolve_min_cohort
from fedmf.run.outcome import OUTCOME_FILE, clear_outcome, read_outcome
from fedmf.run.simulate import SimulationResult, chain_head, learning_check, rho_spent, run_history, write_outputs
from fedmf.tasks import Task
from server.config import APP_DEFAULTS, ServerConfig

from . import flower_cli, processes, ray_cluster

__all__ = ["simulate_flower", "flower_run_config", "flower_population", "flower_result"]


def flower_run_config(values: Mapping[str, Any], config: RunConfig) -> dict[str, Any]:
    """The complete run configuration for ``flwr run --run-config``: every key of the app's defaults table
    (``server.config.APP_DEFAULTS``: the engine's keys, then the Flower adapter's), so that the app's own
    ``[tool.flwr.app.config]`` defaults (which differ from a preset's) fill in nothing, with the paths the
    ServerApp must see absolute (it runs in another directory)."""
    out = {**APP_DEFAULTS, **values}
    if any(v is None for v in out.values()):
        raise ConfigError(f"configuration keys without a value: {sorted(k for k, v in out.items() if v is None)}")
    if isinstance(out["task-options"], Mapping):
        out["task-options"] = json.dumps(out["task-options"], sort_keys=True)
    out["run-dir"] = config.run_dir
    out["mechanism"] = config.mechanism  # a mechanism file, resolved from the working directory
    out["budget-key"] = config.budget_key or ""
    out["witness"] = config.witness or ""  # resolved: the ServerApp runs in another directory
    return out


def flower_population(task_name: str, users: list[str]) -> int:
    """The number of simulated SuperNodes for a task whose users are ``users``: one per user. The
    ClientApp of partition i is user ``str(i)`` for tasks whose users are "0".."N-1", else the
    task's i-th user (``client.app.simulation_user``); ConfigError (one line) for no users or
    users that are not distinct."""
    n = len(users)
    if n == 0 or len(set(users)) != n:
        raise ConfigError(f"task {task_name!r} has {'no users' if n == 0 else 'users that are not distinct'}: "
                          "the Flower simulation needs one distinct user per SuperNode")
    return n


def flower_result(config: RunConfig, *, model, evaluate, seconds: float = 0.0, plot: bool = True) -> SimulationResult:
    """Read a finished Flower run of ``config`` back from its run directory into a SimulationResult
    and write ``results.json`` (and ``progress.png``), as ``simulate`` does: the run and how it
    stopped from ``outcome.json``, the whole run's rounds from the ledger and the round log the
    ServerApp appended (``run_history``), epsilon from the plan, accuracy from ``evaluate`` of
    ``final-model.pt`` loaded into ``model``. ``config`` may be the app's ``ServerConfig``: with
    secure aggregation the plan is the one the ServerApp ran (``RunPlan.with_secure_aggregation``)."""
    import torch

    directory = Path(config.run_dir)
    try:
        outcome = read_outcome(directory)
    except OutcomeError as e:
        raise ConfigError(f"the Flower run left no complete result: {e}") from None
    if outcome.error is not None or outcome.run_id is None:
        raise FedmfError(f"the Flower run in {str(directory)!r} stopped on an error: {outcome.error}")
    state = checks.load_tensors(directory / "final-model.pt", f"the Flower run's final model in {str(directory)!r}",
                                error=ConfigError)
    run_id = outcome.run_id
    plan = config.build_plan()
    secagg = getattr(config, "secagg", None)  # a ServerConfig's SecAgg+ parameters
    if secagg is not None:  # the plan the ServerApp ran (server/app.py): its fingerprint records SecAgg+
        plan = plan.with_secure_aggregation(secagg, sum(p.numel() for p in model.parameters()))
    ledger = config.ledger_url or str(directory / "ledger.db")
    history = run_history(config, plan, run_id)
    done = len(history)
    model.load_state_dict(state)
    with torch.no_grad():
        scores = {k: float(v) for k, v in evaluate(model).items()}
    if history:
        # the final model is the last round's: its evaluation, also where that round's log line is missing
        history[-1]["metrics"] = {**history[-1]["metrics"], **scores}
    check = learning_check(config, flag="")  # the initial loss the ServerApp kept; the final model's finiteness
    check.start(directory, max(done, 1), None, model.parameters())
    out = SimulationResult(str(directory), public_url(ledger), run_id, done, outcome.stopped,
                           plan.epsilon_after(done - 1) if done else 0.0, plan.delta, plan.noise_multiplier,
                           scores.get("accuracy"), seconds, history, rho=rho_spent(plan, done),
                           chain_head=chain_head(config, run_id),
                           cohorts=cohort_counts(history, plan, resolve_min_cohort(plan, config.min_clients_per_round)),
                           learning=check.replay(history).to_dict())
    return write_outputs(out, config.run_dir, plot)


def simulate_flower(config: RunConfig, values: Mapping[str, Any], task: Task, *, timeout: float,
                    echo: TextIO | None = None, plot: bool = True, ray_address: str | None = None,
                    client_cpus: int = 1, client_gpus: float | None = None) -> SimulationResult:
    """Run ``config`` (built from the preset ``values``) as the Flower app on the Flower simulation
    engine, one SuperNode per user of ``task``, stopped after ``timeout`` seconds; the Flower
    processes' output to ``echo``; the result read back from the run directory (its log in
    ``flower.log``). A failed run is a one-line FedmfError with the run's status.

    ``ray_address``: the GCS ``HOST:PORT`` of an existing Ray cluster that runs the ClientApp actors
    (None: a fresh local Ray); ``client_cpus`` (whole CPUs) and ``client_gpus`` (a fraction of a GPU,
    None: none) are each virtual client's Ray resources (:mod:`launcher.ray_cluster`)."""
    num_supernodes = flower_population(config.task, list(task.users()))
    run_config = flower_run_config(values, config)
    server_config = ServerConfig.from_mapping(run_config)  # what the ServerApp will read (secure aggregation too)
    # a plan that cannot be built, or that no round can reach, fails here in one line before any Flower process
    plan = config.build_plan()
    plan.check_population(num_supernodes)
    if server_config.secagg is not None:  # as the ServerApp checks it: the threshold, no wrap
        from server.secagg_round import run_quantization

        run_quantization(server_config.secagg, plan, sum(p.numel() for p in task.model().parameters()),
                         num_supernodes)
    if ray_address is not None:
        ray_cluster.check_reachable(ray_address)
    try:
        root = flower_cli.app_dir()
    except flower_cli.AppDirError as e:
        raise ConfigError(str(e)) from None
    run_dir = Path(config.run_dir)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = run_dir / "final-model.pt"
    before = final.stat().st_mtime_ns if final.exists() else None
    clear_outcome(run_dir)  # an earlier launch's outcome is not this one's
    started = time.perf_counter()
    try:
        res = flower_cli.run_simulation(root, num_supernodes=num_supernodes,
                                       run_config=run_config, timeout=timeout, echo=echo,
                                       ray_address=ray_address, client_num_cpus=client_cpus,
                                       client_num_gpus=client_gpus)
    except processes.LeftoverProcessesError as e:
        raise FedmfError(f"the Flower run's processes could not all be stopped: {e}") from None
    except (RuntimeError, TimeoutError) as e:  # the SuperLink did not start
        raise FedmfError(f"the Flower simulation could not start: {e}") from None
    seconds = time.perf_counter() - started
    log = run_dir / "flower.log"
    text = (f"$ {' '.join(res.args)}\n{res.output}\n--- flwr ls ---\n{json.dumps(res.run_info, indent=1)}\n"
            f"--- superlink ---\n{res.logs.get('superlink', '')}")
    atomic_write(log, lambda f: f.write(text), text=True, mode=0o600)
    try:
        outcome = read_outcome(run_dir)
    except OutcomeError:
        outcome = None
    said = outcome.error if outcome is not None else None
    wrote = final.exists() and final.stat().st_mtime_ns != before
    if res.rc != 0 or outcome is None or said is not None or not wrote:
        # under the simulation engine a ServerApp that exits (SystemExit) still ends "finished:completed":
        # the error in its outcome.json, or no outcome and no final model, tell
        why = res.failure() or (f"Flower run {res.run_id} ended {res.status} but its ServerApp failed" if said else
                                f"Flower run {res.run_id} ended {res.status} without writing "
                                f"{final if not wrote else run_dir / OUTCOME_FILE}")
        raise FedmfError(why + (f"; the ServerApp said: {said}" if said else "") + f" (log: {log})")
    return flower_result(server_config, model=task.model(), evaluate=task.evaluate, seconds=seconds, plot=plot)
