"""The ``so-paper`` round on one device: client training by the paths that exist, and the server's side.

    python benchmarks/so_paper_round.py --device cuda --json so_paper_round.json
    python benchmarks/so_paper_round.py --device cpu --users 8 --one-users 2 --paths check,batched,vmap,one-module,sequential,server
    python benchmarks/so_paper_round.py --device cpu --users 2 --one-users 1 --server-users 2 --quick-server  # smoke

``so-paper`` is the paper's geometry (1,000 users per round, the 4,053,428-parameter LSTM, batch 16,
one local epoch; the users' sizes from the synthetic generator, a seeded sample of its users).
Timed on ``--device``, medians over ``--repeats`` (after one untimed warm-up of each path):

  check       not timed: the batched path on ``--device`` against the engine's sequential
              ``local_update`` (CPU) for ``--check-users`` users: the largest absolute and
              relative differences of their updates (the two must agree within float tolerance)
  batched     ``batched_local_updates(..., chunk_users=chunk, device=)`` over ``--users`` users
              (fedmf/tasks/batched_lstm.py: what ``--vectorized`` runs for the text tasks): the
              first chunk tried is ``--max-chunk``; on ``torch.cuda.OutOfMemoryError`` it halves
  one-vmap    ``vectorized_local_updates(task, params, [user], device=)``, one user per call (what
              ``task.local_updates([user], vectorized=True)`` ran before the batched path)
  one-module  the task's own ``nn.Module`` (cuDNN ``nn.LSTM`` on CUDA) moved to the device, trained
              user after user by the same local SGD as ``SupervisedTask.local_update`` (same batch
              schedule, ``task.train_loss``, ``torch.optim.SGD``): this benchmark's loop, not an
              engine path — the one-at-a-time reference on the device
  vmap        ``vectorized_local_updates(..., max_users=chunk, device=)`` over ``--users`` users
              (``torch.func.vmap`` over an unrolled LSTM: ``--vectorized`` before the batched path),
              chunks as for batched
  server      benchmarks/round.py's ``FedmfServer`` on the device for ``--server-users`` users:
              clip + sum (RoundPrivatizer.add), noise (banded-Toeplitz p = 64, n = 2052,
              MinSep(342, 6), on the device), optimizer step, ledger (SQLite) and checkpoint commit

The users' data is generated (CPU, synthetic) once before the timings and cached by the task: its
cost per user is reported apart (``data_s_per_user``). Each client path reports seconds per user,
the projection to 1,000 users, and the peak device memory (``torch.cuda.max_memory_allocated``
above what was allocated before; per user for the chunked paths). ``--tf32`` lets CUDA matmuls
use TF32 (off by default: the figures are float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

USERS_PER_ROUND = 1000
OOM = (torch.cuda.OutOfMemoryError, torch.OutOfMemoryError) if hasattr(torch, "OutOfMemoryError") \
    else (torch.cuda.OutOfMemoryError,)


class Meter:
    """Wall time and peak device memory of one block of device work."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Meter:
        self.sync()
        if self.cuda:
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.started
        self.peak_bytes = (torch.cuda.max_memory_allocated(self.device) - self.base) if self.cuda else None


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def one_module_updates(task, model: torch.nn.Module, params: dict, users: list[str], hyper, device) -> None:
    """Each user's local SGD on ``model`` (already on ``device``), as SupervisedTask.local_update does it."""
    from fedmf.tasks.vectorized import batch_schedule

    for user in users:
        x, y = task.user_data(user)
        x, y = x.to(device), y.to(device)
        model.load_state_dict(params)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=hyper.client_lr)
        with torch.enable_grad():
            for batch in batch_schedule(task, user, len(y), 0, hyper):
                batch = batch.to(device)
                optimizer.zero_grad(set_to_none=True)
                task.train_loss(model, x[batch], y[batch]).backward()
                optimizer.step()
        new = model.state_dict()
        _ = {name: new[name].detach() - old for name, old in params.items()}


def time_one(name: str, run, users: list[str], warm: list[str], repeats: int, meter: Meter) -> dict:
    run(warm)
    seconds, peaks = [], []
    for r in range(repeats):
        with meter:
            run(users)
        seconds.append(meter.seconds / len(users))
        peaks.append(meter.peak_bytes)
        print(f"# {name} repeat {r}: {len(users)} users, {seconds[-1]:.4f} s/user"
              + (f", peak {peaks[-1] / 2**20:.0f} MiB" if peaks[-1] is not None else ""), flush=True)
    s = statistics.median(seconds)
    return {"users": len(users), "repeats": repeats, "s_per_user": s, "s_per_user_all": seconds,
            "s_per_1000_users": s * USERS_PER_ROUND, "peak_bytes": max(peaks) if peaks[0] is not None else None}


def time_chunked(name: str, call, users: list[str], warm: list[str], device, max_chunk: int, repeats: int,
                 meter: Meter) -> dict:
    """``call(users, chunk)`` timed over ``users``, halving ``chunk`` on a device OOM."""
    call(warm, 1)
    free(device)
    chunk, attempts, seconds, peaks = max(1, min(max_chunk, len(users))), [], [], []
    while True:
        try:
            with meter:
                out = call(users, chunk)
            del out
        except OOM as e:
            attempts.append({"chunk": chunk, "result": "oom", "error": str(e).splitlines()[0][:200]})
            print(f"# {name} chunk {chunk}: out of memory; halving", flush=True)
            free(device)
            if chunk == 1:
                return {"users": len(users), "attempts": attempts, "chunk": None, "error": "oom at chunk 1"}
            chunk = max(1, chunk // 2)
            continue
        attempts.append({"chunk": chunk, "result": "ok", "seconds": meter.seconds, "peak_bytes": meter.peak_bytes})
        seconds.append(meter.seconds / len(users))
        peaks.append(meter.peak_bytes)
        print(f"# {name} chunk {chunk} repeat {len(seconds) - 1}: {len(users)} users, {seconds[-1]:.4f} s/user"
              + (f", peak {peaks[-1] / 2**20:.0f} MiB ({peaks[-1] / chunk / 2**20:.1f} MiB/user)"
                 if peaks[-1] is not None else ""), flush=True)
        free(device)
        if len(seconds) >= repeats:
            break
    s = statistics.median(seconds)
    peak = max(peaks) if peaks[0] is not None else None
    return {"users": len(users), "chunk": chunk, "attempts": attempts, "repeats": len(seconds), "s_per_user": s,
            "s_per_user_all": seconds, "s_per_1000_users": s * USERS_PER_ROUND, "peak_bytes": peak,
            "peak_bytes_per_user": peak / chunk if peak is not None else None}


def check_batched(task, params: dict, users: list[str], hyper, device) -> dict:
    """The batched path on ``device`` against the sequential path on the CPU, for ``users``."""
    from fedmf.tasks.batched_lstm import batched_local_updates

    cpu = {k: v.detach().cpu() for k, v in params.items()}
    seq = task.local_updates(cpu, users, 0, hyper)
    bat = batched_local_updates(task, cpu, users, 0, hyper, device=device)
    abs_err = max(float((bat[u].update[k] - seq[u].update[k]).abs().max()) for u in users for k in cpu)
    scale = max(float(seq[u].update[k].abs().max()) for u in users for k in cpu)
    loss_err = max(abs(bat[u].metrics["train-loss"] - seq[u].metrics["train-loss"]) for u in users)
    print(f"# check: batched on {device} vs sequential on the CPU, {len(users)} users: max |Δupdate| {abs_err:.3g} "
          f"(largest update entry {scale:.3g}), max |Δtrain-loss| {loss_err:.3g}", flush=True)
    return {"users": len(users), "max_abs_diff": abs_err, "max_abs_update": scale, "max_loss_diff": loss_err,
            "ok": abs_err <= 1e-4 * max(scale, 1.0) and loss_err <= 1e-4}


def time_server(device: torch.device, users_per_round: int, rounds: int, quick: bool, start: int | None,
                cache: Path, pool_size: int) -> dict:
    from _models import make_model
    from round import FedmfServer, load_mechanism, make_pool

    from fedmf.participation import MinSep
    from fedmf.plan import RunPlan
    from fedmf.round.privatize import layout_of

    n, schema, bands = (256, MinSep(64, 4), 16) if quick else (2052, MinSep(342, 6), 64)
    started = time.perf_counter()
    mechanism, how = load_mechanism("banded-toeplitz", n, schema, bands, cache)
    print(f"# server: banded-toeplitz n={n} p={bands} {schema}: {how} ({time.perf_counter() - started:.1f} s)",
          flush=True)
    model = make_model(quick)
    plan = RunPlan.create(mechanism, schema, clip_norm=1.0, delta=1e-6, expected_users=users_per_round,
                          noise_multiplier=1.0)
    layout = layout_of(dict(model.named_parameters()))
    pool = [{k: v.to(device) for k, v in u.items()} for u in make_pool(layout, pool_size, seed=7)]
    workdir = Path(tempfile.mkdtemp(prefix="fedmf-so-paper-round-"))
    server = FedmfServer(plan, model, workdir, seed=1234, device=device)
    rows = []
    try:
        server.fast_forward(bands if start is None else start)
        for r in range(rounds + 1):  # the first: warm-up
            t = server.t
            users = [f"r{t:04d}-u{i:05d}" for i in range(users_per_round)]
            updates = {u: pool[(t * users_per_round + i) % len(pool)] for i, u in enumerate(users)}
            gc.collect()
            times = server.round(users, updates)
            print(f"# server round {t}{' (warm-up)' if r == 0 else ''}: total {times['total']:.3f} s (clip+sum "
                  f"{times['clip']:.3f}, noise {times['noise']:.3f}, step {times['step']:.3f}, ledger "
                  f"{times['ledger']:.3f}, checkpoint {times['checkpoint']:.3f})", flush=True)
            if r:
                rows.append(times)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        server.close()
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"users": users_per_round, "rounds": rounds, "mechanism": f"banded-toeplitz n={n} p={bands}",
            "median_s": med, "totals": [row["total"] for row in rows], "peak_bytes_process": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--paths", default="check,batched,vmap,one-module,server,one-vmap",
                        help="in this order (the slowest, one-vmap, last); also: sequential (CPU)")
    parser.add_argument("--one-users", type=int, default=8, help="users per repeat, one-at-a-time paths")
    parser.add_argument("--users", type=int, default=512, help="users per repeat, batched and vmap paths")
    parser.add_argument("--batched-users", type=int, default=None,
                        help="users per repeat, batched path (default --users; 1000 for a whole so-paper round)")
    parser.add_argument("--max-chunk", type=int, default=None,
                        help="first chunk tried, batched and vmap (default: all their users)")
    parser.add_argument("--check-users", type=int, default=2, help="users of the check path")
    parser.add_argument("--tf32", action="store_true", help="let CUDA matmuls use TF32 (default: float32)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--server-users", type=int, default=USERS_PER_ROUND)
    parser.add_argument("--server-rounds", type=int, default=3, help="timed, after one warm-up")
    parser.add_argument("--server-start", type=int, default=None, help="rounds fast-forwarded first (default p)")
    parser.add_argument("--pool", type=int, default=32, help="distinct server updates cycled through")
    parser.add_argument("--quick-server", action="store_true", help="small model and mechanism (smoke test)")
    parser.add_argument("--mechanism-cache", default=str(Path(tempfile.gettempdir()) / "fedmf-bench-round"))
    parser.add_argument("--seed", type=int, default=0, help="which users are sampled")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    batched_users = args.batched_users or args.users
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    out: dict = {"device": str(device), "device_name": name, "torch": torch.__version__,
                 "python": platform.python_version(), "tf32": args.tf32, "argv": sys.argv[1:], "paths": {}}
    if device.type == "cuda":
        out["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    print(f"# device {device} ({name}), torch {torch.__version__}, python {platform.python_version()}", flush=True)
    meter = Meter(device)
    started_all = time.perf_counter()

    if any(p != "server" for p in paths):
        from fedmf.config import RunConfig
        from fedmf.run.simulate import preset_values
        from fedmf.tasks import ClientHyper, get_task

        config = RunConfig.from_mapping(preset_values("so-paper", {"run-dir": "unused"}))
        task = get_task(config.task, **config.task_options)
        hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
        torch.manual_seed(0)
        model = task.model()
        out["parameters"] = sum(p.numel() for p in model.parameters())
        params = {k: v.detach().clone().to(device) for k, v in model.state_dict().items()}
        everyone = task.users()
        sample = random.Random(args.seed).sample(everyone, 1 + max(args.users, batched_users, args.one_users,
                                                                   args.check_users))
        warm, cohort = sample[:1], sample[1:]
        loaded = time.perf_counter()
        sizes = sorted(len(task.user_data(u)[1]) for u in sample)  # generated once, then cached by the task
        out["data_s_per_user"] = (time.perf_counter() - loaded) / len(sample)
        sizes = sorted(len(task.user_data(u)[1]) for u in cohort[:max(args.users, batched_users)])
        out["cohort_sentences"] = {"min": sizes[0], "median": statistics.median(sizes), "max": sizes[-1],
                                   "mean": statistics.fmean(sizes)}
        print(f"# so-paper: {out['parameters']:,} parameters, {len(everyone):,} users, batch {hyper.batch_size}, "
              f"{hyper.local_epochs} epoch; sampled users' sentences {out['cohort_sentences']}; their data generated in "
              f"{out['data_s_per_user'] * 1e3:.1f} ms/user on the CPU (cached: not in the timings below)", flush=True)

    for path in paths:
        started = time.perf_counter()
        try:
            if path == "one-vmap":
                from fedmf.tasks.vectorized import vectorized_local_updates

                def run(users):
                    for user in users:
                        vectorized_local_updates(task, params, [user], 0, hyper, device=device)
                result = time_one(path, run, cohort[:args.one_users], warm, args.repeats, meter)
            elif path == "one-module":
                work = task.model().to(device)
                result = time_one(path, lambda users: one_module_updates(task, work, params, users, hyper, device),  # noqa: B023 (timed at once)
                                  cohort[:args.one_users], warm, args.repeats, meter)
                del work
            elif path == "check":
                result = check_batched(task, params, cohort[:args.check_users], hyper, device)
            elif path == "batched":
                from fedmf.tasks.batched_lstm import batched_local_updates

                result = time_chunked(path, lambda users, chunk: batched_local_updates(
                    task, params, users, 0, hyper, chunk_users=chunk, device=device), cohort[:batched_users], warm,
                    device, args.max_chunk or batched_users, args.repeats, meter)
            elif path == "vmap":
                from fedmf.tasks.vectorized import vectorized_local_updates

                result = time_chunked(path, lambda users, chunk: vectorized_local_updates(
                    task, params, users, 0, hyper, max_users=chunk, device=device), cohort[:args.users], warm,
                    device, args.max_chunk or args.users, args.repeats, meter)
            elif path == "sequential":
                cpu_params = {k: v.detach().cpu() for k, v in params.items()}
                result = time_one(path, lambda users: task.local_updates(cpu_params, users, 0, hyper),  # noqa: B023 (timed at once)
                                  cohort[:args.one_users], warm, args.repeats, Meter(torch.device("cpu")))
            elif path == "server":
                result = time_server(device, args.server_users, args.server_rounds, args.quick_server,
                                     args.server_start, Path(args.mechanism_cache), args.pool)
            else:
                raise SystemExit(f"unknown path {path!r}")
        except SystemExit:
            raise
        except Exception as e:  # report and go on with the other paths
            result = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"# {path} FAILED: {result['error']}", flush=True)
        result["wall_s"] = time.perf_counter() - started
        out["paths"][path] = result
        free(device)
        print(f"# {path}: done in {result['wall_s']:.1f} s", flush=True)
        if args.json:  # written after each path: a timeout keeps what was measured
            Path(args.json).write_text(json.dumps(out, indent=1))

    server = out["paths"].get("server", {}).get("median_s", {}).get("total")
    summary = {}
    batched = out["paths"].get("batched", {}).get("s_per_user")
    for path in ("batched", "vmap", "one-module", "sequential", "one-vmap"):
        row = out["paths"].get(path, {})
        client = row.get("s_per_1000_users")
        if client is not None:
            summary[path] = {"s_per_user": row["s_per_user"], "client_s_per_round": client,
                             "round_s": client + server if server is not None else None,
                             "x_batched": row["s_per_user"] / batched if batched else None,
                             "peak_bytes_per_user": row.get("peak_bytes_per_user")}
    out["summary_per_1000_user_round"] = summary
    out["server_s_per_round"] = server
    out["server_split_s"] = out["paths"].get("server", {}).get("median_s")
    out["wall_s"] = time.perf_counter() - started_all
    print(json.dumps({"device_name": name, "summary": summary, "server_split_s": out["server_split_s"],
                      "check": out["paths"].get("check"),
                      "chunks": {p: out["paths"].get(p, {}).get("chunk") for p in ("batched", "vmap")},
                      "wall_s": out["wall_s"]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
