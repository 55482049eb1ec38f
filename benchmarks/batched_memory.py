"""Peak memory per user of the batched LSTM clients (fedmf/tasks/batched_lstm.py), measured on the
CPU against the formula ``bytes_per_user``, for the so-paper geometry (the 4,053,428-parameter LSTM,
batch 16, one epoch, users from the synthetic generator's size distribution).

    python benchmarks/batched_memory.py --chunks 2,6 --json batched_memory.json

Each chunk size runs in its own process with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``), so that every tensor larger than that is its own mapping, returned
to the system when freed: the resident set then tracks the live tensors. The process generates its
users' data, loads the parameters, then resets its peak resident set (``/proc/self/clear_refs``,
``5``: Linux ≥ 4.0) and runs one ``batched_local_updates`` call over ``chunk`` users in one chunk;
the peak (``VmHWM``) minus the resident set before the call is that chunk's memory. The slope
between two chunk sizes is the memory one more user costs (the constant part cancels). On CUDA,
``--device cuda`` reads ``torch.cuda.max_memory_allocated`` instead (no subprocess trick needed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(chunk: int, seed: int, device: str) -> dict:
    import torch

    from fedmf.config import RunConfig
    from fedmf.run.simulate import preset_values
    from fedmf.tasks import ClientHyper, get_task
    from fedmf.tasks.batched_lstm import batched_local_updates

    config = RunConfig.from_mapping(preset_values("so-paper", {"run-dir": "unused"}))
    task = get_task(config.task, **config.task_options)
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    params = {k: v.detach().clone().to(device) for k, v in task.model().state_dict().items()}
    users = random.Random(seed).sample(task.users(), chunk)
    sizes = [len(task.user_data(u)[1]) for u in users]
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = batched_local_updates(task, params, users, 0, hyper, chunk_users=chunk, device=device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        out = batched_local_updates(task, params, users, 0, hyper, chunk_users=chunk, device=device)
        peak = _status("VmHWM") - before
    assert len(out) == chunk
    return {"chunk": chunk, "peak_bytes": peak, "sentences": sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="2,6", help="two or more chunk sizes, each in its own process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.seed, args.device)))
        return 0

    from fedmf.tasks.batched_lstm import bytes_per_user
    from fedmf.tasks.models import MODEL_SIZES

    embed, hidden = MODEL_SIZES["paper"]
    formula = bytes_per_user(10_004, embed, hidden, 16)
    params_bytes = 4 * 4_053_428
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        done = subprocess.run([sys.executable, __file__, "--child", str(chunk), "--seed", str(args.seed),
                               "--device", args.device], capture_output=True, text=True, env=env, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"# chunk {chunk}: peak {row['peak_bytes'] / 2**20:.1f} MiB above the start "
              f"({row['peak_bytes'] / chunk / 2**20:.1f} MiB/user); sentences {row['sentences']}", flush=True)
    (a, b) = rows[0], rows[-1]
    slope = (b["peak_bytes"] - a["peak_bytes"]) / (b["chunk"] - a["chunk"])
    out = {"device": args.device, "rows": rows, "measured_bytes_per_user": slope, "formula_bytes_per_user": formula,
           "measured_over_formula": slope / formula, "params_bytes_per_user": params_bytes,
           "chunk_in_80e9_bytes_formula": 80 * 10**9 // formula,
           "chunk_in_80GiB_formula": 80 * 2**30 // formula}
    print(f"# per user: measured {slope / 1e6:.1f} MB (slope between chunks {a['chunk']} and {b['chunk']}), "
          f"formula {formula / 1e6:.1f} MB (ratio {slope / formula:.2f}); weights alone {params_bytes / 1e6:.1f} MB; "
          f"chunk in 80 GB by the formula: {out['chunk_in_80e9_bytes_formula']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
