"""Client updates per second: fedmf in process (sequential and vectorized), fedmf on the Flower
simulation engine, Flower's own FedAvg simulation and Apple's pfl simulator, side by side in one run.

    python benchmarks/simulate.py [--sizes small,lstm] [--repeats 1] [--pfl-python /tmp/pflvenv/bin/python]
                                  [--skip SIDES] [--json PATH] [--quick]

pfl 0.6.0 cannot join the ``bench`` extra: it requires dp-accounting>=0.4,<0.6 (and with it absl-py~=1.0),
fedmf pins dp-accounting==0.6.0. Its own interpreter, sharing everything else (torch, numpy, fedmf):

    python -m venv --system-site-packages /tmp/pflvenv
    /tmp/pflvenv/bin/pip install --no-deps pfl==0.6.0 prv-accountant==0.2.0 multiprocess==0.70.19 dill==0.4.1

Cases (the same task, options, hyperparameters, population and users per round on every side):
  small  the ``so-tiny`` preset (so-synthetic, vocab 2,000, 32 sentences per user, ``model_size: small``:
         the small WordLSTM), 40 of 800 users per round, 3 local epochs, batch 16; rounds 6 (min-sep 6)
  lstm   the ``so-paper`` model (WordLSTM "paper", 4,053,428 parameters) on so-synthetic with 16 sentences
         per user (one batch of 16), 10 of 100 users per round, 1 local epoch; rounds 4, min-sep 1, bsr
  Both with noise multiplier 1 (no calibration); ``--quick``: 3 rounds small, 2 rounds lstm with 4 of 20 users.

Sides (all measured on steady-state rounds: round 0 is a warm-up and is not counted; the rate is the
median round's updates / its wall time; "start-up" is what comes before round 0):
  inprocess      ``fedmf.run.federated.train`` with ``task.as_local_updates(workers=<the CPUs>)`` (what
                 ``fedmf simulate`` runs by default, minus the per-round held-out evaluation): the whole
                 private round (select, local updates, clip, noise, optimizer, checkpoint, ledger commit);
                 "client s" = time inside the clients' hook
  sequential     client work only: ``task.local_updates(params, users, t, hyper)`` (one after another)
  parallel       client work only: ``task.local_updates(..., workers=<the CPUs>)`` (threads, the same bits)
  vectorized     client work only: ``task.local_updates(..., vectorized=True)`` on the same users and
                 params, alternating with the two above round by round
  pfl            pfl 0.6.0's ``FederatedAveraging`` on its ``SimulatedBackend`` (no DP), the same PyTorch
                 model (the task's WordLSTM with the task's plain ``criterion`` as pfl's ``loss``: what a pfl
                 user writes) and data (the task's ``user_data``), SGD with the same lr / epochs / batch;
                 users cycled by pfl's ``MinimizeReuseUserSampler``; one intra-op thread; run in
                 ``--pfl-python`` (pfl pins dp-accounting<0.6, fedmf pins 0.6.0)
  pfl-2threads   the same on two intra-op threads (targets compare with the faster of the two)
  pfl-masked     pfl differentiating fedmf's pad-skipping ``task.train_loss`` (one thread): the same model
                 code on both sides, so what is left of the ratio is the frameworks'
  flower-fedmf   ``fedmf simulate --backend flower``'s path (``launcher.flower_cli.run_simulation`` of the repo's
                 app with ``launcher.flower_backend.flower_run_config``), one SuperNode per user, 1 CPU per ClientApp
                 actor (2 actors on 2 cores); round window = the ledger's opened_at → closed_at
  flower-fedavg  Flower's FedAvg ServerApp (benchmarks/flower_fedavg_app) on the same task, same launcher;
                 round window = configure_train start → aggregate_train end
Threads: fedmf's ``local_update`` runs entirely on one intra-op thread (``fedmf.threads.one_thread``,
model loading included) and reuses one model per thread. Flower: two ClientApp actors of 1 CPU each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(_HERE)]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

for _name, _value in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"),
                      ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ[_name] = _value

SIDES = ("inprocess", "sequential", "parallel", "vectorized", "pfl", "pfl-2threads", "pfl-masked", "flower-fedmf",
         "flower-fedavg")
#: pfl sides: (intra-op threads, loss) — "criterion" is the task's plain loss (what a pfl user writes),
#: "masked" fedmf's pad-skipping training loss (``task.train_loss``)
PFL_SIDES = {"pfl": (1, "criterion"), "pfl-2threads": (2, "criterion"), "pfl-masked": (1, "masked")}
#: the pfl sides a target compares against (the best of them): pfl as its users would run it
PFL_PLAIN = ("pfl", "pfl-2threads")
ANCHOR_APP = _HERE / "flower_fedavg_app"


@dataclass
class Case:
    """One model size: a preset with overrides, and the population it runs on."""

    name: str
    preset: str
    overrides: dict[str, Any]
    population: int
    users_per_round: int
    rounds: int

    def values(self, run_dir: Path) -> dict[str, Any]:
        from fedmf.run.simulate import preset_values

        return preset_values(self.preset, {**self.overrides, "run-dir": str(run_dir)})


def make_cases(quick: bool) -> dict[str, Case]:
    small_rounds = 3 if quick else 6
    lstm_rounds, lstm_users, lstm_population = (2, 4, 20) if quick else (4, 10, 100)
    return {
        "small": Case("small", "so-tiny", {"rounds": small_rounds, "min-sep": small_rounds, "noise-multiplier": 1.0},
                      800, 40, small_rounds),
        "lstm": Case("lstm", "so-paper", {
            "task-options": {"num_users": lstm_population, "max_sentences": 16, "eval_users": 1},
            "clients-per-round": lstm_users, "rounds": lstm_rounds, "min-sep": 1, "max-participations": 0,
            "mechanism": "bsr", "num-bands": 0, "noise-multiplier": 1.0}, lstm_population, lstm_users, lstm_rounds),
    }


@dataclass
class SideResult:
    """Per-round wall times (s) and updates of one side; round 0 is the warm-up."""

    side: str
    round_s: list[float] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    startup_s: float | None = None
    client_s: list[float] = field(default_factory=list)
    error: str | None = None

    def steady(self) -> list[tuple[float, int, float | None]]:
        """(seconds, updates, client seconds or None) of every round after the warm-up."""
        client = self.client_s or [None] * len(self.round_s)
        return [(s, u, c) for s, u, c in list(zip(self.round_s, self.updates, client))[1:] if u > 0]

    def rate(self) -> float | None:
        """Updates per second of the median steady round (by seconds per update)."""
        rows = self.steady()
        return 1.0 / statistics.median(s / u for s, u, _ in rows) if rows else None

    def summary(self) -> dict[str, Any]:
        rate = self.rate()
        per_update = sorted(s / u for s, u, _ in self.steady())
        client = [c / u for _, u, c in self.steady() if c is not None]
        return {"updates_per_s": rate, "ms_per_update": None if rate is None else 1000.0 / rate,
                "ms_per_update_min": 1000 * per_update[0] if per_update else None,
                "ms_per_update_max": 1000 * per_update[-1] if per_update else None,
                "client_ms_per_update": 1000 * statistics.median(client) if client else None,
                "startup_s": self.startup_s, "timed_rounds": len(per_update), "error": self.error}


def _task(values: dict[str, Any]):
    from fedmf.config import RunConfig
    from fedmf.tasks import ClientHyper, get_task

    config = RunConfig.from_mapping(values)
    task = get_task(config.task, **config.task_options)
    return config, task, ClientHyper(config.client_lr, config.local_epochs, config.batch_size)


def _cohort(users: list[str], t: int, m: int) -> list[str]:
    start = (t * m) % len(users)
    return [users[(start + i) % len(users)] for i in range(m)]


# ---- in process ---------------------------------------------------------------------------------------
def run_inprocess(case: Case, work: Path) -> SideResult:
    """``fedmf.run.federated.train`` as ``fedmf simulate`` runs it (no evaluation): whole rounds."""
    from fedmf.run.federated import train
    from fedmf.tasks.base import default_workers

    out = SideResult("inprocess")
    values = case.values(work / "inprocess")
    config, task, hyper = _task(values)
    workers = default_workers()
    inner = task.as_local_updates(hyper, vectorized=False, workers=workers)  # fedmf simulate's default
    client_s: dict[int, float] = {}

    def local_updates(params, users, t):
        started = time.perf_counter()
        try:
            return inner(params, users, t)
        finally:
            client_s[t] = client_s.get(t, 0.0) + time.perf_counter() - started

    stamps: list[float] = []

    def on_round(record) -> None:
        stamps.append(time.perf_counter())
        out.updates.append(record.contributed)

    started = time.perf_counter()
    plan = config.build_plan()
    model = task.model()
    train(model, task.users(), plan, None, local_updates=local_updates, server_lr=config.server_lr,
          checkpoint_dir=config.run_dir,
          on_round=on_round, on_event=lambda name, t: stamps.append(time.perf_counter())
          if (name, t) == ("guarded", 0) else None)
    out.startup_s = stamps[0] - started
    ends = stamps[1:]
    out.round_s = [b - a for a, b in zip(stamps[:1] + ends[:-1], ends)]
    out.client_s = [client_s.get(t, 0.0) for t in range(len(ends))]
    return out


def run_client_loops(case: Case, work: Path) -> tuple[SideResult, SideResult, SideResult]:
    """Client work only, round by round on the same users and params: sequential, parallel
    (``workers`` = the CPUs), vectorized."""
    from fedmf.tasks.base import default_workers

    values = case.values(work / "loops")
    _, task, hyper = _task(values)
    users = task.users()
    params = task.model().state_dict()
    seq, par, vec = SideResult("sequential"), SideResult("parallel"), SideResult("vectorized")
    for t in range(case.rounds):
        cohort = _cohort(users, t, case.users_per_round)
        for side, options in ((seq, {}), (par, {"workers": default_workers()}), (vec, {"vectorized": True})):
            started = time.perf_counter()
            results = task.local_updates(params, cohort, t, hyper, **options)
            side.round_s.append(time.perf_counter() - started)
            side.updates.append(len(results))
    return seq, par, vec


# ---- pfl ----------------------------------------------------------------------------------------------
def pfl_worker(case: Case, threads: int, loss_kind: str) -> dict[str, Any]:
    """pfl's FedAvg simulation of ``case`` (run inside an interpreter that has pfl) on ``threads``
    intra-op threads, differentiating the task's ``criterion`` or its ``train_loss`` (``masked``)."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(threads)
    work = Path(tempfile.mkdtemp(prefix="fedmf-bench-pfl-"))
    try:
        _, task, hyper = _task(case.values(work / "pfl"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    class PflModule(torch.nn.Module):
        """The task's model with pfl's ``loss`` / ``metrics`` methods (the task's own criterion)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = task.model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
            self.eval() if eval else self.train()
            if loss_kind == "masked":
                return task.train_loss(self.net, x, y)
            return task.criterion(self.net(x), y)

        @torch.no_grad()
        def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict[str, Any]:
            return {"loss": Weighted(float(self.loss(x, y, eval=True)) * len(y), len(y))}

    stamps: list[float] = []
    updates: list[int] = []

    class RoundClock(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.perf_counter())
            updates.append(case.users_per_round)  # pfl's cohort: exactly train_cohort_size (no overshoot)
            return False, Metrics()

    def make_dataset(user: str) -> Dataset:
        x, y = task.user_data(user)
        return Dataset(raw_data=[x, y], user_id=user)

    started = time.perf_counter()
    module = PflModule()
    model = PyTorchModel(module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    data = FederatedDataset(make_dataset, MinimizeReuseUserSampler(task.users()))
    backend = SimulatedBackend(training_data=data, val_data=data)
    params = NNAlgorithmParams(central_num_iterations=case.rounds, evaluation_frequency=case.rounds + 1,
                               train_cohort_size=case.users_per_round, val_cohort_size=None)
    train_params = NNTrainHyperParams(local_num_epochs=hyper.local_epochs, local_learning_rate=hyper.client_lr,
                                      local_batch_size=hyper.batch_size)
    FederatedAveraging().run(params, backend, model, train_params, NNEvalHyperParams(local_batch_size=hyper.batch_size),
                             callbacks=[RoundClock()])
    import pfl

    return {"round_s": [b - a for a, b in zip([started] + stamps[:-1], stamps)], "updates": updates,
            "version": getattr(pfl, "__version__", "?")}


def run_pfl(case: Case, quick: bool, python: str, side: str = "pfl") -> SideResult:
    out = SideResult(side)
    threads, loss = PFL_SIDES[side]
    command = [python, str(Path(__file__).resolve()), "--pfl-worker", case.name, "--pfl-threads", str(threads),
               "--pfl-loss", loss] + (["--quick"] if quick else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        out.error = (done.stderr.strip().splitlines() or ["pfl worker failed"])[-1][:300]
        return out
    data = json.loads(done.stdout.strip().splitlines()[-1])
    out.round_s, out.updates = data["round_s"], data["updates"]
    out.startup_s = None
    return out


def pfl_available(python: str) -> str | None:
    """pfl's version in ``python``, or None."""
    try:
        done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('pfl'))"],
                              capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# ---- Flower -------------------------------------------------------------------------------------------
def _utc(text: str) -> float:
    stamp = datetime.fromisoformat(text)
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def run_flower_fedmf(case: Case, work: Path, timeout_s: float) -> SideResult:
    """The path of ``fedmf simulate --backend flower``; round windows from the run's ledger."""
    from launcher.flower_backend import flower_population, flower_run_config
    from launcher.flower_cli import app_dir, run_simulation

    out = SideResult("flower-fedmf")
    values = case.values(work / "flower-fedmf")
    config, task, _ = _task(values)
    config.build_plan()
    launched = time.time()
    res = run_simulation(app_dir(), num_supernodes=flower_population(config.task, task.users()),
                         run_config=flower_run_config(values, config), timeout=timeout_s,
                         tmp_path=work / "flwr-fedmf")
    if res.rc != 0:
        out.error = res.failure()
        return out
    with sqlite3.connect(Path(config.run_dir) / "ledger.db") as db:
        rows = db.execute("SELECT opened_at, closed_at, contributed FROM rounds WHERE status = 'committed' "
                          "ORDER BY round_index").fetchall()
    out.round_s = [_utc(b) - _utc(a) for a, b, _ in rows]
    out.updates = [int(c) for _, _, c in rows]
    out.startup_s = _utc(rows[0][0]) - launched if rows else None
    return out


_ANCHOR_ROUND = re.compile(r"fedavg-anchor round (\d+) start_s (\S+) end_s (\S+) received (\d+)")


def run_flower_fedavg(case: Case, work: Path, timeout_s: float) -> SideResult:
    """Flower's FedAvg ServerApp (benchmarks/flower_fedavg_app) on the same task and population."""
    from launcher.flower_cli import run_simulation

    out = SideResult("flower-fedavg")
    values = case.values(work / "flower-fedavg")
    config, _, hyper = _task(values)
    run_config = {"task": config.task, "task-options": values["task-options"], "rounds": case.rounds,
                  "clients-per-round": case.users_per_round, "population": case.population,
                  "client-lr": hyper.client_lr, "local-epochs": hyper.local_epochs, "batch-size": hyper.batch_size}
    launched = time.time()
    res = run_simulation(ANCHOR_APP, num_supernodes=case.population, run_config=run_config, timeout=timeout_s,
                         tmp_path=work / "flwr-fedavg")
    rounds = [(float(a), float(b), int(n)) for _, a, b, n in _ANCHOR_ROUND.findall(res.output)]
    if res.rc != 0 or len(rounds) != case.rounds:
        out.error = res.failure() or f"{len(rounds)} of {case.rounds} rounds logged"
        return out
    out.round_s = [b - a for a, b, _ in rounds]
    out.updates = [n for _, _, n in rounds]
    out.startup_s = rounds[0][0] - launched
    return out


# ---- report -------------------------------------------------------------------------------------------
def model_size(case: Case) -> int:
    work = Path(tempfile.mkdtemp(prefix="fedmf-bench-size-"))
    try:
        _, task, _ = _task(case.values(work))
        return sum(p.numel() for p in task.model().parameters())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict[str, Any]]) -> str:
    head = ("| case | parameters | users/round | side | updates/s | ms/update (median) | min–max | client ms/update | "
            "start-up s | vs pfl (best) | vs Flower FedAvg |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        sides = r["sides"]
        pfl = max((sides[k]["updates_per_s"] or 0.0 for k in PFL_PLAIN if k in sides and not sides[k]["error"]),
                  default=0.0) or None
        fedavg = sides.get("flower-fedavg", {}).get("updates_per_s")
        for name, s in sides.items():
            rate = s["updates_per_s"]
            if s["error"]:
                lines.append(f"| {r['case']} | {r['parameters']:,} | {r['users_per_round']} | {name} | failed: "
                             f"{s['error'][:120]} | | | | | | |")
                continue
            vs_pfl = f"{rate / pfl:.2f}x" if rate and pfl else "-"
            vs_fedavg = f"{rate / fedavg:.2f}x" if rate and fedavg else "-"
            spread = f"{_fmt(s['ms_per_update_min'], '.1f')}–{_fmt(s['ms_per_update_max'], '.1f')}"
            lines.append(f"| {r['case']} | {r['parameters']:,} | {r['users_per_round']} | {name} | "
                         f"{_fmt(rate, '.1f')} | {_fmt(s['ms_per_update'], '.1f')} | {spread} | "
                         f"{_fmt(s['client_ms_per_update'], '.1f')} | {_fmt(s['startup_s'], '.1f')} | {vs_pfl} | "
                         f"{vs_fedavg} |")
    return "\n".join(lines)


#: issue 12's targets: in process >= this x pfl's updates/s (by case); Flower backend >= 1/1.5 x Flower FedAvg
PFL_TARGET = {"small": 3.0, "lstm": 1.0}
FEDAVG_TARGET = 1 / 1.5


def targets(results: list[dict[str, Any]]) -> list[str]:
    """One line per target: the measured ratio and whether it is met."""
    lines = []
    for r in results:
        sides = r["sides"]
        rate = {k: v["updates_per_s"] for k, v in sides.items() if not v["error"] and v["updates_per_s"]}
        local = {k: rate[k] for k in ("inprocess", "sequential", "parallel", "vectorized") if k in rate}
        plain = {k: rate[k] for k in PFL_PLAIN if k in rate}
        if local and plain and r["case"] in PFL_TARGET:
            best, pfl = max(local, key=local.get), max(plain, key=plain.get)
            ratio = local[best] / plain[pfl]
            lines.append(f"{r['case']}: in process ({best}) / pfl ({pfl}, the faster) = {ratio:.2f}x, target >= "
                         f"{PFL_TARGET[r['case']]:g}x: {'met' if ratio >= PFL_TARGET[r['case']] else 'NOT met'}")
            if "inprocess" in local and "pfl-masked" in rate:
                lines.append(f"{r['case']}: whole private rounds (inprocess) / pfl with fedmf's masked loss = "
                             f"{local['inprocess'] / rate['pfl-masked']:.2f}x (same model code on both sides)")
        if "flower-fedmf" in rate and "flower-fedavg" in rate:
            ratio = rate["flower-fedavg"] / rate["flower-fedmf"]
            lines.append(f"{r['case']}: fedmf's Flower backend takes {ratio:.2f}x Flower FedAvg's time per update, "
                         f"target <= 1.5x: {'met' if ratio <= 1 / FEDAVG_TARGET else 'NOT met'}")
    return lines


def _guarded(sides: tuple[str, ...], measure) -> tuple[SideResult, ...]:
    """``measure()`` (one SideResult per name in ``sides``), printed as it ends; an exception becomes
    every side's error."""
    try:
        out = measure()
        out = out if isinstance(out, tuple) else (out,)
    except Exception as e:  # one side failing must not lose the others' numbers
        out = tuple(SideResult(side, error=f"{type(e).__name__}: {e}"[:300]) for side in sides)
    for r in out:
        s = r.summary()
        print(f"#   {r.side:14s} {_fmt(s['updates_per_s'], '8.1f')} updates/s; rounds s "
              f"{[round(x, 3) for x in r.round_s]}; start-up {_fmt(s['startup_s'], '.1f')} s"
              f"{'  ERROR ' + s['error'] if s['error'] else ''}  ({uptime()})", flush=True)
    return out


def uptime() -> str:
    load = os.getloadavg()
    return f"load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


def merge(runs: list[SideResult]) -> SideResult:
    """Repeats of one side: their steady rounds pooled (each repeat's round 0 dropped), median start-up."""
    ok = [r for r in runs if not r.error]
    if not ok:
        return runs[-1]
    startups = [r.startup_s for r in ok if r.startup_s is not None]
    out = SideResult(ok[0].side, [0.0], [0], statistics.median(startups) if startups else None,
                     [0.0] if all(r.client_s for r in ok) else [])
    for r in ok:
        out.round_s += r.round_s[1:]
        out.updates += r.updates[1:]
        if out.client_s:
            out.client_s += r.client_s[1:]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,lstm", help="cases, comma-separated (small, lstm)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every side per case (steady rounds pooled)")
    parser.add_argument("--skip", default="", help=f"sides to leave out, comma-separated ({', '.join(SIDES)})")
    parser.add_argument("--pfl-python", default=None,
                        help="an interpreter with pfl 0.6.0 and fedmf importable (default: this one if it has pfl, "
                             "else /tmp/pflvenv/bin/python)")
    parser.add_argument("--flower-timeout", type=float, default=1800.0, help="seconds per Flower run")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and users: a validation run")
    parser.add_argument("--pfl-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pfl-threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pfl-loss", default="criterion", choices=("criterion", "masked"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = make_cases(args.quick)
    if args.pfl_worker:
        print(json.dumps(pfl_worker(cases[args.pfl_worker], args.pfl_threads, args.pfl_loss)))
        return 0
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}")
    python = args.pfl_python or (sys.executable if pfl_available(sys.executable) else "/tmp/pflvenv/bin/python")
    pfl_skipped = set(PFL_SIDES) <= skip
    pfl_version = None if pfl_skipped else pfl_available(python)
    pfl_label = pfl_version or ("skipped" if pfl_skipped else "not available")
    import flwr

    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, flwr {flwr.__version__}, "
          f"pfl {pfl_label} ({python}), python {platform.python_version()}", flush=True)
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {uptime()}", flush=True)
    results = []
    work_root = Path(tempfile.mkdtemp(prefix="fedmf-bench-simulate-"))
    try:
        for name in args.sizes.split(","):
            case = cases[name]
            runs: dict[str, list[SideResult]] = {s: [] for s in SIDES if s not in skip}
            for repeat in range(args.repeats):
                work = work_root / f"{name}-{repeat}"
                work.mkdir()
                measured: list[SideResult] = []
                if "inprocess" in runs:
                    measured += _guarded(("inprocess",), lambda: run_inprocess(case, work))  # noqa: B023 (_guarded calls it at once)
                if {"sequential", "parallel", "vectorized"} & set(runs):
                    measured += _guarded(("sequential", "parallel", "vectorized"),
                                         lambda: run_client_loops(case, work))  # noqa: B023 (_guarded calls it at once)
                for side in PFL_SIDES:
                    if side in runs:
                        measured += _guarded((side,), lambda side=side: run_pfl(case, args.quick, python, side)  # noqa: B023 (_guarded calls it at once)
                                             if pfl_version else
                                             SideResult(side, error=f"pfl not importable in {python}"))
                if "flower-fedmf" in runs:
                    measured += _guarded(("flower-fedmf",), lambda: run_flower_fedmf(case, work, args.flower_timeout))  # noqa: B023 (_guarded calls it at once)
                if "flower-fedavg" in runs:
                    measured += _guarded(("flower-fedavg",),
                                         lambda: run_flower_fedavg(case, work, args.flower_timeout))  # noqa: B023 (_guarded calls it at once)
                shutil.rmtree(work, ignore_errors=True)
                for result in measured:
                    if result.side in runs:
                        runs[result.side].append(result)
            results.append({"case": name, "preset": case.preset, "parameters": model_size(case),
                            "users_per_round": case.users_per_round, "population": case.population,
                            "rounds": case.rounds, "overrides": case.overrides,
                            "sides": {s: merge(r).summary() for s, r in runs.items()},
                            "raw": {s: [asdict(x) for x in r] for s, r in runs.items()}})
            print(f"# {name} done, {uptime()}", flush=True)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    print(table(results))
    print("\n".join(targets(results)))
    if args.json:
        Path(args.json).write_text(json.dumps({"quick": args.quick, "pfl": pfl_version, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
