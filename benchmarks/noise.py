"""Noise generation per round vs. the device's memory bandwidth, in one run.

    python benchmarks/noise.py [--sizes 1e6,1e7] [--device cpu|cuda] [--rounds 6]

For each structure the bound is (bytes the structure must touch per round) / (copy
bandwidth), where the copy bandwidth is (2·bytes) / (time of dst.copy_(src)) for a
tensor of the same size. Bytes touched per round (float32, d parameters):
  banded C^{-1}, p bands, buffered:  write z, read z and p-1 past draws, write output  -> (p + 2)·4d
  BLT, m buffers:                    write z, read/write m buffers, write output         -> (2m + 3)·4d
Generating Gaussians is compute, not memory traffic; the ratio shows what it costs.
Also times bare torch.randn (the generation floor) for reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fedmf.mechanisms.blt import BufferedLinearToeplitz
from fedmf.mechanisms.toeplitz import BandedInverseFractionalRoot
from fedmf.noise import NoiseGenerator


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(d: int, device: torch.device, repeats: int = 7) -> float:
    src = torch.randn(d, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * 4 * d / statistics.median(times)


def randn_time(d: int, device: torch.device, repeats: int = 5) -> float:
    out = torch.empty(d, device=device)
    g = torch.Generator(device=device)
    times = []
    for _ in range(repeats):
        g.manual_seed(1)
        _sync(device)
        t = time.perf_counter()
        torch.randn(d, generator=g, out=out)
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def per_round(gen: NoiseGenerator, rounds: int, warmup: int) -> float:
    for _ in range(warmup):
        gen.next()
    times = []
    for _ in range(rounds):
        _sync(gen.device)
        t = time.perf_counter()
        gen.next()
        _sync(gen.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1e6,1e7")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| d | structure | s/round (median) | bytes/round | copy GB/s | bound s | ratio | randn s (floor) |")
    print("|---|---|---|---|---|---|---|---|")
    for d in (int(float(x)) for x in args.sizes.split(",")):
        bw = copy_bandwidth(d, device)
        floor = randn_time(d, device)
        cases = []
        for p in (1, 8, 64):
            mech = BandedInverseFractionalRoot(max(p + 2 * args.rounds, 256), p, 0.6)
            cases.append((f"banded C^-1, p={p}", mech, (p + 2) * 4 * d, p + args.rounds))
        blt = BufferedLinearToeplitz.from_decays(1024, np.array([0.99, 0.9, 0.6, 0.2]), np.array([0.95, 0.8, 0.4, 0.1]))
        cases.append(("BLT, 4 buffers", blt, (2 * 4 + 3) * 4 * d, 2))
        for name, mech, nbytes, warmup in cases:
            gen = NoiseGenerator(mech, d, 1.0, dtype=torch.float32, device=device, seed=b"bench")
            t = per_round(gen, args.rounds, warmup)
            bound = nbytes / bw
            print(f"| {d:.0e} | {name} | {t:.4f} | {nbytes / 1e6:.0f} MB | {bw / 1e9:.1f} | {bound:.4f} | "
                  f"{t / bound:.1f}x | {floor:.4f} |", flush=True)


if __name__ == "__main__":
    main()
