"""Server time per round: fedmf (correlated DP-MF noise) vs Flower's server-side DP, side by side.

    python benchmarks/round.py [--users 100,1000] [--rounds 3] [--mechanisms banded-toeplitz,blt]
                               [--pool 32] [--cache-dir DIR] [--quick]

Model: the StackOverflow next-word LSTM (4,053,428 float32 parameters: embedding 10004x96,
LSTM 96->670, dense 670->96, output 96->10004); mechanisms for n = 2052 rounds, MinSep(342, 6)
(banded-Toeplitz with p = 64 bands, and BLT), optimized once and cached (fedmf.mechanisms.io).
``--quick``: a small layout (13,368 parameters), n = 256, MinSep(64, 4), p = 16 bands, 8 and 16
users, 2 timed rounds after 16 fast-forwarded ones — a smoke test that finishes in seconds.

fedmf's round, timed step by step (the order of fedmf/run/federated.py's round):
  ledger     run.open_round(t), run.record_selection(t, users) (MinSep enforced), one
             run.record_contribution(...) per user, run.commit_round(t, noise_std=,
             epsilon_planned=, checkpoint_sha256=)
  clip       RoundPrivatizer.begin(t, selected) and .add(user, update) per user in str(user)
             order: check_update (names, shapes, dtype, finite), zero huge l-inf, clip l2 to
             zeta, sum into one flat buffer — exactly what privatize() does before the noise
  noise      RoundPrivatizer.finish(): the round's correlated noise (NoiseGenerator.next),
             added once, divided by the planned expected users
  step       the server optimizer (fedmf.round.server_optimizer, the mechanism's workload A)
  checkpoint CheckpointStore.save(t, {model, optimizer, privatizer, rng}) (fsync'd) and
             store.prune(keep=t) after the commit
Updates are handed to fedmf as dicts of float32 torch tensors (no conversion counted).

Flower's side reproduces DifferentialPrivacyServerSideFixedClipping.aggregate_train around
FedAvg (flwr.serverapp.strategy, flwr 1.42) on the same updates, as numpy arrays: each reply is
the client's model (current model + update, built before the timer starts, as a client would
send it); per reply Flower's own flwr.supercore.differential_privacy.compute_clip_model_update
(update = reply - current, flat l2 clip to zeta, reply = current + clipped update), then the
streaming weighted sum of flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords
(``agg += value * weight``, weight = num_examples / total, equal num_examples), then Flower's
own add_gaussian_noise_inplace(arrays, compute_stdv(z, zeta, K)) (np.random.normal, float64,
cast to float32). The noisy average *is* the new model (FedAvg of models), so there is no
optimizer step, no ledger and no checkpoint on Flower's side. NOT counted for Flower: the
ArrayRecord (npy bytes) deserialization of each reply, the re-serialization of each clipped reply
and of the aggregate that the shipped strategy does — a fedmf ServerApp receiving the same
Messages would pay the deserialization too; only arithmetic is compared.

Updates: a pool of --pool distinct random update dicts (norms spread geometrically over 0.3..3 zeta,
so about half are clipped) is cycled through; user i of round t gets pool[(t*K + i) % pool]. Every
round uses fresh user ids (a user may take part once per 342 rounds under MinSep).

Per cell: --start-round rounds (default p = 64) run first without users or checkpoints, so the
timed rounds see the steady state (banded C^-1 keeps, reads and checkpoints its p - 1 past noise
outputs only once t >= p - 1); then one warm-up round (untimed; also checks that fedmf's
pre-noise sum equals Flower's clipped average times K, and that both clip the same users), then
--rounds timed rounds, each
fedmf then Flower back to back; medians over rounds (the total's median is the median of the
per-round totals).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _models import make_model
from torch import nn

from fedmf import mechanisms
from fedmf.ledger import Ledger
from fedmf.mechanisms import io as mechanism_io
from fedmf.participation import MinSep
from fedmf.plan import RunPlan
from fedmf.round.privatize import RoundPrivatizer, layout_of
from fedmf.round.server_optimizer import server_optimizer
from fedmf.run.checkpoint import CheckpointStore

CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
DELTA = 1e-6
NUM_EXAMPLES = 10  # equal for every reply: FedAvg weights are then 1/K (uniform, like fedmf's 1/m)


# ---- model and layout ---------------------------------------------------------------------------


def make_pool(layout: dict[str, tuple[int, ...]], count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` distinct float32 updates; norms spread geometrically over 0.3..3 zeta."""
    gen = torch.Generator().manual_seed(seed)
    size = sum(int(np.prod(s)) for s in layout.values())
    pool = []
    for i in range(count):
        target = CLIP_NORM * 0.3 * 10.0 ** (i / max(count - 1, 1))
        update = {name: torch.randn(shape, generator=gen, dtype=torch.float32) for name, shape in layout.items()}
        scale = target / float(np.sqrt(size))  # E||randn(d)|| ~ sqrt(d)
        for t in update.values():
            t.mul_(scale)
        pool.append(update)
    return pool


# ---- mechanisms ---------------------------------------------------------------------------------
def load_mechanism(kind: str, n: int, schema: MinSep, bands: int, cache: Path):
    cache.mkdir(parents=True, exist_ok=True)
    suffix = f"-p{bands}" if kind == "banded-toeplitz" else ""
    path = cache / f"{kind}-n{n}-b{schema.min_sep}-k{schema.max_participations}{suffix}.json"
    if path.exists():
        return mechanism_io.load(path), f"cached {path}"
    started = time.perf_counter()
    options = {"num_bands": bands} if kind == "banded-toeplitz" else {}
    mechanism, _ = mechanisms.plan(kind, n, schema, **options)
    mechanism_io.save(mechanism, path, schema)
    return mechanism, f"optimized in {time.perf_counter() - started:.1f} s, saved to {path}"


# ---- Flower's arithmetic ------------------------------------------------------------------------
def flower_round(current: list[np.ndarray], replies: list[list[np.ndarray]], stdv: float,
                 add_noise: bool = True) -> tuple[list[np.ndarray], dict[str, float]]:
    """DifferentialPrivacyServerSideFixedClipping(FedAvg).aggregate_train's arithmetic on numpy
    replies (full models). Returns the new model and timings."""
    from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update

    started = time.perf_counter()
    total = NUM_EXAMPLES * len(replies)
    weight = NUM_EXAMPLES / total
    aggregated: list[np.ndarray] | None = None
    for reply in replies:
        arrays = list(reply)  # to_numpy_ndarrays() gives fresh arrays; the helper rebinds the list items
        compute_clip_model_update(param1=arrays, param2=current, clipping_norm=CLIP_NORM)
        # FedAvg: aggregate_arrayrecords — aggregated[key] = value * w, then += value * w
        if aggregated is None:
            aggregated = [value * weight for value in arrays]
        else:
            for acc, value in zip(aggregated, arrays):
                acc += value * weight
    clip_s = time.perf_counter() - started
    started = time.perf_counter()
    if add_noise:
        add_gaussian_noise_inplace(aggregated, stdv)  # np.random.normal(0, z*zeta/K, shape).astype(dtype)
    noise_s = time.perf_counter() - started
    return aggregated, {"clip": clip_s, "noise": noise_s, "total": clip_s + noise_s}


# ---- fedmf's round ------------------------------------------------------------------------------
class FedmfServer:
    def __init__(self, plan: RunPlan, model: nn.Module, directory: Path, seed: int,
                 device: str | torch.device = "cpu") -> None:
        """``device``: where the model, the sum and the noise live (benchmarks/so_paper_round.py: cuda);
        on a CUDA device every step's timer waits for the device's queued work (synchronize)."""
        self.device = torch.device(device)
        self.plan, self.model = plan, model.to(self.device)
        self.params = dict(model.named_parameters())
        self.privatizer = RoundPrivatizer(plan, layout_of(self.params), device=self.device, dtype=torch.float32,
                                          seed=seed.to_bytes(32, "big"))
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.optimizer = server_optimizer(self.params, plan.mechanism.workload, plan.rounds, lr=1.0)
        self.ledger = Ledger.open(directory / "ledger.sqlite", secret=os.urandom(32))
        self.run = self.ledger.create_run(plan.mechanism, noise_multiplier=plan.noise_multiplier,
                                          clip_norm=plan.clip_norm, delta=plan.delta, schema=plan.schema,
                                          plan=plan.to_dict(), plan_fingerprint=plan.fingerprint)
        self.store = CheckpointStore(directory / "checkpoints")
        self.t = 0

    def state(self) -> dict:
        return {"plan_fingerprint": self.plan.fingerprint, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "privatizer": self.privatizer.state_dict(),
                "rng": {"torch": torch.get_rng_state()}}

    def round(self, users: list[str], updates: dict[str, dict[str, torch.Tensor]], check=None) -> dict[str, float]:
        t, run, privatizer = self.t, self.run, self.privatizer
        times: dict[str, float] = {}
        sync = self._sync
        sync()
        c0 = time.perf_counter()
        run.open_round(t)
        accepted = run.record_selection(t, users)
        assert len(accepted) == len(users)
        c1 = time.perf_counter()
        privatizer.begin(t, users)  # == privatize(t, updates, selected=users), split to time the noise apart
        for user in sorted(updates, key=str):
            privatizer.add(user, updates[user])
        sync()
        c2 = time.perf_counter()
        if check is not None:
            check(privatizer._sum.clone(), privatizer._open)  # untimed warm-up check (private attributes)
        c2b = time.perf_counter()
        mean, report = privatizer.finish()
        sync()
        c3 = time.perf_counter()
        self.optimizer.step(mean)
        sync()
        c4 = time.perf_counter()
        for r in report.users:
            if r.status == "contributed":
                run.record_contribution(t, r.user, update_norm=r.norm, clipped=r.clipped)
            else:
                run.record_rejection(t, r.user, r.reason)
        c5 = time.perf_counter()
        state = self.state()
        sync()
        c5b = time.perf_counter()
        digest = self.store.save(t, state)
        del state
        c6 = time.perf_counter()
        run.commit_round(t, noise_std=self.plan.noise_std, epsilon_planned=self.plan.epsilon_after(t),
                         checkpoint_sha256=digest)
        c7 = time.perf_counter()
        self.store.prune(keep=t)
        c8 = time.perf_counter()
        times["clip"] = c2 - c1
        times["noise"] = c3 - c2b
        times["step"] = c4 - c3
        times["ledger"] = (c1 - c0) + (c5 - c4) + (c7 - c6)
        times["checkpoint"] = (c6 - c5) + (c8 - c7)
        times["state"], times["save"], times["prune"] = c5b - c5, c6 - c5b, c8 - c7
        times["total"] = sum(times[k] for k in ("clip", "noise", "step", "ledger", "checkpoint"))
        times["bytes"] = float(self.store.last_bytes)
        times["clipped"] = float(sum(r.clipped for r in report.users))
        self.t += 1
        return times

    def fast_forward(self, rounds: int) -> None:
        """Advance the noise, the optimizer and the ledger by ``rounds`` rounds with no users and
        no checkpoint (untimed), so the timed rounds see a full noise window (banded: p-1 past
        outputs kept, read and checkpointed every round), as in a long run's steady state."""
        for _ in range(rounds):
            t = self.t
            self.run.open_round(t)
            self.privatizer.begin(t, [])
            mean, _ = self.privatizer.finish()
            self.optimizer.step(mean)
            self.run.commit_round(t, noise_std=self.plan.noise_std)
            self.t += 1

    def close(self) -> None:
        self.ledger.close()


# ---- one cell -----------------------------------------------------------------------------------
def run_cell(kind: str, mechanism, schema: MinSep, users_per_round: int, rounds: int, pool, quick: bool,
             workdir: Path, start: int) -> dict:
    model = make_model(quick)
    plan = RunPlan.create(mechanism, schema, clip_norm=CLIP_NORM, delta=DELTA, expected_users=users_per_round,
                          noise_multiplier=NOISE_MULTIPLIER)
    directory = Path(tempfile.mkdtemp(prefix=f"{kind}-{users_per_round}-", dir=workdir))
    server = FedmfServer(plan, model, directory, seed=1234)
    server.fast_forward(start)
    names = list(server.params)
    # Flower's global model: its own numpy copy of the same initial weights
    current = [p.detach().numpy().copy() for p in server.params.values()]
    pool_np = [[u[name].numpy() for name in names] for u in pool]  # shares memory: no copy
    stdv = NOISE_MULTIPLIER * CLIP_NORM / users_per_round  # compute_stdv(z, zeta, K)
    fedmf_rows, flower_rows = [], []
    try:
        for r in range(rounds + 1):
            warm = r == 0
            t = server.t
            users = [f"r{t:04d}-u{i:05d}" for i in range(users_per_round)]
            index = {u: (t * users_per_round + i) % len(pool) for i, u in enumerate(users)}
            updates = {u: pool[index[u]] for u in users}
            # Flower's replies: the clients' models (current + update), built before the timer
            replies_by_pool = {j: [c + d for c, d in zip(current, pool_np[j])] for j in set(index.values())}
            replies = [replies_by_pool[index[u]] for u in users]
            checked = {}

            def check(total, report_open):
                checked["sum"] = total.numpy()  # noqa: B023 (check runs inside this iteration's server.round)
                checked["clipped"] = [u.clipped for u in report_open.users]  # noqa: B023 (check runs inside this iteration's server.round)

            gc.collect()
            fedmf_times = server.round(users, updates, check if warm else None)
            gc.collect()
            new_model, flower_times = flower_round(current, replies, stdv, add_noise=not warm)
            if warm:
                _check_same(checked, new_model, current, pool_np, index, users)
                # warm-up: Flower's noise not drawn above (to compare sums); draw it once untimed
                from flwr.supercore.differential_privacy import add_gaussian_noise_inplace

                add_gaussian_noise_inplace(new_model, stdv)
            current = new_model
            del replies, replies_by_pool
            if not warm:
                fedmf_rows.append(fedmf_times)
                flower_rows.append(flower_times)
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)
    med = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    out = {"kind": kind, "users": users_per_round, "rounds": rounds,
           "fedmf": {k: med(fedmf_rows, k) for k in fedmf_rows[0]},
           "flower": {k: med(flower_rows, k) for k in flower_rows[0]},
           "fedmf_totals": [row["total"] for row in fedmf_rows], "flower_totals": [row["total"] for row in flower_rows],
           "noise_std": plan.noise_std}
    out["ratio"] = out["fedmf"]["total"] / out["flower"]["total"]
    return out


def _check_same(checked, flower_avg, current, pool_np, index, users) -> None:
    """fedmf's pre-noise sum / K == Flower's pre-noise FedAvg of clipped updates; same users clipped."""
    from flwr.supercore.differential_privacy import get_norm

    k = len(users)
    flower_delta = np.concatenate([(a - c).reshape(-1) for a, c in zip(flower_avg, current)])
    fedmf_mean = checked["sum"] / k
    err = float(np.max(np.abs(fedmf_mean - flower_delta)))
    scale = float(np.max(np.abs(flower_delta)))
    # Flower averages models (current + update) in float32: its rounding is in units of the weights' ulp
    model_ulp = float(max(np.max(np.abs(c)) for c in current)) * np.finfo(np.float32).eps
    assert err <= 1e-4 * scale + 64 * model_ulp, (
        f"fedmf and Flower disagree before noise: max |diff| {err:.3g} (update scale {scale:.3g}, "
        f"model ulp {model_ulp:.3g})")
    print(f"#   check: fedmf sum/K vs Flower's clipped FedAvg - model: max |diff| {err:.2g} (update max {scale:.2g}, "
          f"model ulp {model_ulp:.2g}); same {sum(checked['clipped'])} of {k} users clipped", flush=True)
    flower_clipped = [get_norm(pool_np[index[u]]) > CLIP_NORM for u in sorted(users, key=str)]
    assert flower_clipped == checked["clipped"], "fedmf and Flower clip different users"


# ---- report -------------------------------------------------------------------------------------
LABELS = {"blt": "BLT"}


def table(results: list[dict], bands: int) -> str:
    head = ("| users | mechanism | fedmf total s | validate+clip+sum s | noise s | optimizer step s | ledger s | "
            "checkpoint s | checkpoint MB/round | Flower total s | Flower clip+avg s | Flower noise s | "
            "fedmf / Flower |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        f, w = r["fedmf"], r["flower"]
        label = f"banded-Toeplitz p={bands}" if r["kind"] == "banded-toeplitz" else LABELS.get(r["kind"], r["kind"])
        lines.append(f"| {r['users']} | {label} | {f['total']:.3f} | {f['clip']:.3f} | {f['noise']:.3f} | "
                     f"{f['step']:.3f} | {f['ledger']:.3f} | {f['checkpoint']:.3f} | {f['bytes'] / 1e6:.1f} | "
                     f"{w['total']:.3f} | {w['clip']:.3f} | {w['noise']:.3f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", default=None, help="users per round, comma-separated (default 100,1000)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per cell, after one warm-up (default 3)")
    parser.add_argument("--mechanisms", default="banded-toeplitz,blt")
    parser.add_argument("--pool", type=int, default=32, help="distinct update dicts cycled through (default 32)")
    parser.add_argument("--bands", type=int, default=64)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fedmf-bench-round"),
                        help="where optimized mechanisms are kept between runs")
    parser.add_argument("--workdir", default=None,
                        help="where ledgers and checkpoints are written (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small layout and n: a smoke test in seconds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--start-round", type=int, default=None,
                        help="rounds run (untimed, no users) before the warm-up, so banded noise has its full "
                             "window of p-1 past outputs (default: the number of bands)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    users = [int(x) for x in (args.users or ("8,16" if args.quick else "100,1000")).split(",")]
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 3)
    kinds = [k.strip() for k in args.mechanisms.split(",") if k.strip()]
    n, schema = (256, MinSep(64, 4)) if args.quick else (2052, MinSep(342, 6))
    bands = min(args.bands, 16) if args.quick else args.bands
    pool_size = min(args.pool, 8) if args.quick else args.pool
    start = bands if args.start_round is None else args.start_round

    import flwr

    load = os.getloadavg()
    print(f"# {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), numpy {np.__version__}, flwr {flwr.__version__}, "
          f"python {platform.python_version()}", flush=True)
    print(f"# load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; n={n} {schema}; "
          f"pool={pool_size}; timed rounds {start + 1}..{start + rounds} after {start} fast-forwarded rounds and "
          f"one warm-up", flush=True)
    layout = layout_of(dict(make_model(args.quick).named_parameters()))
    size = sum(int(np.prod(s)) for s in layout.values())
    print(f"# layout: {size:,} parameters in {len(layout)} tensors", flush=True)
    started = time.perf_counter()
    pool = make_pool(layout, pool_size, seed=7)
    print(f"# update pool: {pool_size} updates in {time.perf_counter() - started:.1f} s", flush=True)

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fedmf-bench-round-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for kind in kinds:
            mechanism, how = load_mechanism(kind, n, schema, bands, Path(args.cache_dir))
            print(f"# {kind}: {how}", flush=True)
            for k in users:
                started = time.perf_counter()
                result = run_cell(kind, mechanism, schema, k, rounds, pool, args.quick, workdir, start)
                results.append(result)
                f, w = result["fedmf"], result["flower"]
                per_round = ", ".join(f"{x:.3f}" for x in result["fedmf_totals"])
                flower_per_round = ", ".join(f"{x:.3f}" for x in result["flower_totals"])
                print(f"# {kind} K={k}: fedmf {f['total']:.3f} s (per round {per_round}; checkpoint: state_dict "
                      f"{f['state']:.3f} save {f['save']:.3f} prune {f['prune']:.3f}), Flower {w['total']:.3f} s "
                      f"({flower_per_round}), ratio {result['ratio']:.2f}x, clipped {f['clipped']:.0f}/{k}; "
                      f"cell took {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    load = os.getloadavg()
    print(f"# load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(table(results, bands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
