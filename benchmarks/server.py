"""Per-round server time inside real Flower strategies: fedmf's DPMFStrategy vs Flower's
DifferentialPrivacyServerSideFixedClipping(FedAvg), side by side in one run.

    python benchmarks/server.py [--clients 100,1000] [--rounds 3] [--fast-forward 63] [--pool 16] [--quick]

Both strategies are driven through their own hooks, as ``Strategy.start`` drives them:
``configure_train`` -> ``grid.send_and_receive`` -> ``aggregate_train``. The Grid (a
``server.local_grid.LocalGrid`` subclass, no SuperLink) answers with PREPARED replies, so client
training is excluded; only the strategy hooks are timed (and, for fedmf, the two per-round calls
its own ``start`` loop makes around them: ``run.guard()`` and ``ArrayRecord(model.state_dict())``).

  nodes       2 x clients per round; QUERY -> RecordDict({"identity": ConfigRecord({"user-id"})})
  fedmf TRAIN RecordDict({"arrays": <delta>, "config": {round, run-nonce, user-id echoed},
              "metrics": {"num-examples", "train-loss"}})
  Flower TRAIN RecordDict({"arrays": <current model + delta>, "metrics": {"num-examples"}})
  updates     a pool of --pool distinct ArrayRecords (float32 randn, l2 norms spread geometrically
              over 0.3..3 x the clip norm, so about half are clipped), reused across clients; the
              Flower pool (model + delta) is rebuilt from the current global model before each
              round, untimed. Building a reply is a new RecordDict around a pooled ArrayRecord.

Model: the StackOverflow next-word LSTM (4,053,428 float32 parameters, asserted). fedmf plan:
MinSep(2, ceil(n/2)), clients-per-round m, population 2m, z = 1, clip 1, delta 1e-6, mechanism
``bsr`` with 64 bands over n = 2052 rounds (banded-toeplitz refuses p = 64 > min-sep 2; bsr is
the same streaming structure, banded C with p - 1 = 63 past noise outputs, so its per-round
noise and checkpoint cost are those of banded-Toeplitz p = 64). Built with
``fedmf.mechanisms.plan``, ``RunPlan.create``, ``PrivateRun.open(model, plan, tmpdir,
population=users)`` and ``ServerConfig.from_mapping``.

Per cell: --fast-forward rounds run first through the same hooks with no replies (users are
selected and recorded as dropped; noise, step, checkpoint, commit as usual) so the timed rounds
see banded C's full window of 63 past outputs; then one warm-up round with replies (untimed),
then --rounds timed rounds, each fedmf then Flower back to back; medians over rounds.

fedmf's breakdown comes from PrivateRun's ``on_event`` hook ("updates", "noised", "stepped",
"checkpointed", "committed") plus timers wrapped around four instance methods (privatizer.finish,
store.save, store.prune, run.observed_epsilon); Flower's from timers around the inner FedAvg's
aggregate_train and the wrapper's _add_noise_to_aggregated_arrays. Flower's INFO logging (one line
per reply) is turned off (logger "flwr" at WARNING) so that neither side pays for console output.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# this file is named server.py: run as a script, its folder would shadow the repository's `server` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from benchmarks._models import make_model
from fedmf import mechanisms
from fedmf.participation import MinSep
from fedmf.plan import RunPlan
from fedmf.run.private_run import PrivateRun
from server.config import ServerConfig
from server.local_grid import LocalGrid
from server.strategy import DPMFStrategy

CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
DELTA = 1e-6
NUM_EXAMPLES = 10
MIN_SEP = 2


# ---- model ------------------------------------------------------------------------------------------


def make_pool(model: nn.Module, count: int, seed: int) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """``count`` distinct float32 updates (numpy, by name); l2 norms geometric over 0.3..3 zeta."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    pool, norms = [], []
    for i in range(count):
        target = CLIP_NORM * 0.3 * 10.0 ** (i / max(count - 1, 1))
        update = {n: torch.randn(s, generator=gen, dtype=torch.float32) for n, s in shapes.items()}
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in update.values()))
        pool.append({n: (t * (target / norm)).numpy() for n, t in update.items()})
        norms.append(target)
    return pool, norms


# ---- the grid ---------------------------------------------------------------------------------------
class PreparedGrid(LocalGrid):
    """LocalGrid whose nodes answer QUERY with their identity and TRAIN with ``self.answer``
    (node, message) -> RecordDict | None. Sent messages are not kept (memory stays bounded)."""

    def __init__(self, users: dict[int, str]) -> None:
        self.users = users
        self.answer: Callable[[int, Message], RecordDict | None] = lambda node, message: None
        super().__init__({node: self._node(node) for node in users})

    def _node(self, node: int):
        def respond(message: Message) -> Message | None:
            if message.metadata.message_type == MessageType.QUERY:
                content = RecordDict({"identity": ConfigRecord({"user-id": self.users[node]})})
            else:
                content = self.answer(node, message)
            return None if content is None else Message(content, reply_to=message)

        return respond

    def send_and_receive(self, messages, *, timeout=None):
        return list(self.pull_messages(self.push_messages(list(messages))))


class Timer:
    """Wraps an instance's method, adding its wall time to ``self.seconds``."""

    def __init__(self, obj, name: str) -> None:
        self.seconds = 0.0
        self.last = None  # the last call's result
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                self.last = inner(*args, **kwargs)
                return self.last
            finally:
                self.seconds += time.perf_counter() - started

        setattr(obj, name, timed)

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


# ---- fedmf ------------------------------------------------------------------------------------------
class FedmfSide:
    def __init__(self, model: nn.Module, mechanism, n: int, m: int, users: dict[int, str], directory: Path,
                 pool: list[ArrayRecord]) -> None:
        schema = MinSep(MIN_SEP, -(-n // MIN_SEP))
        plan = RunPlan.create(mechanism, schema, clip_norm=CLIP_NORM, delta=DELTA, expected_users=m,
                              noise_multiplier=NOISE_MULTIPLIER)
        config = ServerConfig.from_mapping({
            "mechanism": "bsr", "num-bands": 64, "rounds": n, "schema": "min-sep", "min-sep": MIN_SEP,
            "clients-per-round": m, "clip-norm": CLIP_NORM, "noise-multiplier": NOISE_MULTIPLIER, "delta": DELTA,
            "run-dir": str(directory), "reply-timeout": 60.0})
        assert config.participation_schema() == schema
        self.events: dict[str, float] = {}
        self.run = PrivateRun.open(model, plan, directory, population=sorted(users.values()),
                                   on_event=lambda name, t: self.events.__setitem__(name, time.perf_counter()))
        self.strategy = DPMFStrategy(self.run, config, min_available=m)
        self.noise = Timer(self.run.privatizer, "finish")
        self.save = Timer(self.run.store, "save")
        self.prune = Timer(self.run.store, "prune")
        self.observed = Timer(self.run, "observed_epsilon")
        self.pool, self.users = pool, users
        self.arrays: ArrayRecord | None = None
        self.replies = True

    def answer(self, node: int, message: Message) -> RecordDict | None:
        if not self.replies:
            return None
        config = message.content["config"]
        user = config["user-id"]
        return RecordDict({
            "arrays": self.pool[node % len(self.pool)],
            "config": ConfigRecord({"round": config["round"], "run-nonce": config["run-nonce"], "user-id": user}),
            "metrics": MetricRecord({"num-examples": NUM_EXAMPLES, "train-loss": 1.0})})

    def round(self, grid: PreparedGrid) -> dict[str, float]:
        run, strategy = self.run, self.strategy
        grid.answer = self.answer
        for timer in (self.noise, self.save, self.prune, self.observed):
            timer.take()
        self.events.clear()
        t = run.next_round
        c0 = time.perf_counter()
        run.guard(observed=False)  # what DPMFStrategy.start does first in each round
        arrays = ArrayRecord(run.model.state_dict())  # DPMFStrategy.start: the model to send
        c1 = time.perf_counter()
        messages = strategy.configure_train(t + 1, arrays, ConfigRecord(), grid)
        c2 = time.perf_counter()
        replies = grid.send_and_receive(messages, timeout=60.0)  # untimed: prepared replies
        del messages
        c3 = time.perf_counter()
        self.arrays, metrics = strategy.aggregate_train(t + 1, replies)
        c4 = time.perf_counter()
        run.released(t)
        del replies
        e = self.events
        noise, save, prune, observed = self.noise.take(), self.save.take(), self.prune.take(), self.observed.take()
        out = {
            "loop": c1 - c0, "configure": c2 - c1, "read": e["updates"] - c3,
            "clip": (e["noised"] - e["updates"]) - noise, "noise": noise, "step": e["stepped"] - e["noised"],
            "ledger": (e["checkpointed"] - e["stepped"] - save) + (e["committed"] - e["checkpointed"]),
            "checkpoint": save + prune, "observed": observed,
            "out": (c4 - e["committed"]) - prune - observed,
        }
        out["hooks"] = (c2 - c1) + (c4 - c3)
        out["total"] = out["hooks"] + out["loop"]
        out["bytes"] = float(run.store.last_bytes)
        out["received"] = float(metrics["received"])
        out["clipped"] = float(self.noise.last[1].counts()["clipped"])  # the round's own report (not released)
        out["rejected"] = float(metrics["rejected"])
        return out

    def close(self) -> None:
        self.run.close()


# ---- Flower -----------------------------------------------------------------------------------------
class FlowerSide:
    def __init__(self, model: nn.Module, m: int, pool: list[dict[str, np.ndarray]]) -> None:
        from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

        inner = FedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=m, min_evaluate_nodes=0,
                       min_available_nodes=2 * m)
        self.strategy = DifferentialPrivacyServerSideFixedClipping(inner, NOISE_MULTIPLIER, CLIP_NORM, m)
        self.fedavg = Timer(inner, "aggregate_train")
        self.noise_timer = Timer(self.strategy, "_add_noise_to_aggregated_arrays")
        self.arrays = ArrayRecord(model.state_dict())
        self.pool = pool
        self.models: list[ArrayRecord] = []
        self.server_round = 0

    def prepare(self) -> None:
        """Untimed: the clients' replies for this round, current model + each pooled delta."""
        self.models = []
        current = {k: v.numpy() for k, v in self.arrays.items()}
        for delta in self.pool:
            self.models.append(ArrayRecord({k: Array(np.asarray(current[k] + delta[k])) for k in current}))

    def answer(self, node: int, message: Message) -> RecordDict:
        return RecordDict({"arrays": self.models[node % len(self.models)],
                           "metrics": MetricRecord({"num-examples": NUM_EXAMPLES})})

    def round(self, grid: PreparedGrid) -> dict[str, float]:
        self.prepare()
        grid.answer = self.answer
        self.fedavg.take(), self.noise_timer.take()
        self.server_round += 1
        c1 = time.perf_counter()
        messages = self.strategy.configure_train(self.server_round, self.arrays, ConfigRecord(), grid)
        c2 = time.perf_counter()
        replies = grid.send_and_receive(messages, timeout=60.0)
        del messages
        received = len(replies)
        c3 = time.perf_counter()
        arrays, _ = self.strategy.aggregate_train(self.server_round, replies)
        c4 = time.perf_counter()
        del replies
        assert arrays is not None, "Flower's aggregate_train returned no model"
        self.arrays = arrays
        self.models = []
        fedavg, noise = self.fedavg.take(), self.noise_timer.take()
        out = {"configure": c2 - c1, "clip": (c4 - c3) - fedavg - noise, "fedavg": fedavg, "noise": noise}
        out["total"] = out["hooks"] = (c2 - c1) + (c4 - c3)
        out["received"] = float(received)
        return out


# ---- one cell ---------------------------------------------------------------------------------------
def run_cell(m: int, n: int, mechanism, rounds: int, fast_forward: int, pool_np, pool_norms, quick: bool,
             workdir: Path) -> dict:
    users = {node: f"user-{node:06d}" for node in range(1, 2 * m + 1)}
    grid = PreparedGrid(users)
    pool_fedmf = [ArrayRecord({k: Array(v) for k, v in delta.items()}) for delta in pool_np]
    directory = Path(tempfile.mkdtemp(prefix=f"server-{m}-", dir=workdir))
    fedmf = FedmfSide(make_model(quick), mechanism, n, m, users, directory / "run", pool_fedmf)
    flower = FlowerSide(make_model(quick), m, pool_np)
    random.seed(0)  # FedAvg's sample_nodes uses random.sample
    try:
        started = time.perf_counter()
        fedmf.replies = False
        for _ in range(fast_forward):
            fedmf.round(grid)
        if fast_forward:
            print(f"#   K={m}: {fast_forward} fast-forward rounds (no replies) in {time.perf_counter() - started:.1f} s",
                  flush=True)
        fedmf.replies = True
        fedmf_rows, flower_rows = [], []
        for r in range(rounds + 1):
            gc.collect()
            f = fedmf.round(grid)
            gc.collect()
            w = flower.round(grid)
            expected_clipped = sum(pool_norms[node % len(pool_norms)] > CLIP_NORM for node in users) / 2
            print(f"#   K={m} {'warm-up' if r == 0 else f'round {r}'}: fedmf {f['total']:.3f} s (received "
                  f"{f['received']:.0f}, clipped {f['clipped']:.0f}, rejected {f['rejected']:.0f}; about "
                  f"{expected_clipped:.0f} expected), Flower {w['total']:.3f} s (received {w['received']:.0f})",
                  flush=True)
            assert f["received"] == m and f["rejected"] == 0 and w["received"] == m
            if r:
                fedmf_rows.append(f)
                flower_rows.append(w)
    finally:
        fedmf.close()
        shutil.rmtree(directory, ignore_errors=True)
    med = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    out = {"clients": m, "fedmf": {k: med(fedmf_rows, k) for k in fedmf_rows[0]},
           "flower": {k: med(flower_rows, k) for k in flower_rows[0]},
           "fedmf_totals": [row["total"] for row in fedmf_rows], "flower_totals": [row["total"] for row in flower_rows]}
    out["ratio"] = out["fedmf"]["total"] / out["flower"]["total"]
    out["ratio_hooks"] = out["fedmf"]["hooks"] / out["flower"]["hooks"]
    return out


# ---- report -----------------------------------------------------------------------------------------
def table(results: list[dict]) -> str:
    head = ("| clients/round | fedmf total s | loop (guard + model→ArrayRecord) | configure_train | validate+convert | "
            "clip+sum | noise | optimizer step | ledger | checkpoint (save+prune) | observed ε | model→ArrayRecord + metrics | "
            "checkpoint MB/round | Flower total s | Flower configure_train | Flower clip (deser+clip+reser) | "
            "Flower FedAvg | Flower noise | fedmf / Flower | hooks only |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        f, w = r["fedmf"], r["flower"]
        lines.append(
            f"| {r['clients']} | {f['total']:.3f} | {f['loop']:.3f} | {f['configure']:.3f} | {f['read']:.3f} | "
            f"{f['clip']:.3f} | {f['noise']:.3f} | {f['step']:.3f} | {f['ledger']:.3f} | {f['checkpoint']:.3f} | "
            f"{f['observed']:.3f} | {f['out']:.3f} | {f['bytes'] / 1e6:.1f} | {w['total']:.3f} | "
            f"{w['configure']:.3f} | {w['clip']:.3f} | {w['fedavg']:.3f} | {w['noise']:.3f} | {r['ratio']:.2f}x | "
            f"{r['ratio_hooks']:.2f}x |")
    return "\n".join(lines)


def uptime() -> str:
    try:
        import subprocess

        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # pragma: no cover
        load = os.getloadavg()
        return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=None, help="clients per round, comma-separated (default 100,1000)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per cell, after one warm-up (default 3)")
    parser.add_argument("--plan-rounds", type=int, default=None, help="the mechanism's n (default 2052; quick 64)")
    parser.add_argument("--bands", type=int, default=64)
    parser.add_argument("--fast-forward", type=int, default=None,
                        help="fedmf rounds without replies before the warm-up (default bands - 1: full noise window)")
    parser.add_argument("--pool", type=int, default=16, help="distinct update ArrayRecords (default 16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where run directories are written (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small layout, n = 64, 8 bands, 8 and 16 clients")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    clients = [int(x) for x in (args.clients or ("8,16" if args.quick else "100,1000")).split(",")]
    n = args.plan_rounds or (64 if args.quick else 2052)
    bands = min(args.bands, 8) if args.quick else args.bands
    fast_forward = bands - 1 if args.fast_forward is None else args.fast_forward
    assert fast_forward + args.rounds + 1 <= n, "more rounds than the plan's horizon"

    import flwr

    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numpy {np.__version__}, flwr {flwr.__version__}, python {platform.python_version()}", flush=True)
    print(f"# uptime at start: {uptime()}", flush=True)
    model = make_model(args.quick)
    size = sum(p.numel() for p in model.parameters())
    schema = MinSep(MIN_SEP, -(-n // MIN_SEP))
    started = time.perf_counter()
    mechanism, _ = mechanisms.plan("bsr", n, schema, num_bands=bands)
    print(f"# model: {size:,} parameters; mechanism bsr, {bands} bands, n={n}, {schema} "
          f"(built in {time.perf_counter() - started:.2f} s); fast-forward {fast_forward}, warm-up 1, timed "
          f"{args.rounds}", flush=True)
    started = time.perf_counter()
    pool_np, pool_norms = make_pool(model, args.pool, seed=7)
    print(f"# update pool: {args.pool} updates, norms {min(pool_norms):.2f}..{max(pool_norms):.2f} x clip, "
          f"{sum(x > CLIP_NORM for x in pool_norms)} above the clip norm ({time.perf_counter() - started:.1f} s)",
          flush=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fedmf-bench-server-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for m in clients:
            started = time.perf_counter()
            result = run_cell(m, n, mechanism, args.rounds, fast_forward, pool_np, pool_norms, args.quick, workdir)
            results.append(result)
            print(f"# K={m}: fedmf {result['fedmf']['total']:.3f} s per round "
                  f"({', '.join(f'{x:.3f}' for x in result['fedmf_totals'])}), Flower {result['flower']['total']:.3f} s "
                  f"({', '.join(f'{x:.3f}' for x in result['flower_totals'])}), ratio {result['ratio']:.2f}x; "
                  f"cell took {time.perf_counter() - started:.0f} s; uptime: {uptime()}", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"# uptime at end: {uptime()}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
