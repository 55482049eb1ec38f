"""Noise generation per round vs. the device's memory bandwidth, in one run.

    python benchmarks/noise.py [--sizes 1e6,1e7] [--device cpu|cuda] [--rounds 6]

For each structure the bound is (bytes the structure must touch per round) / (copy
bandwidth), where the copy bandwidth is (2·bytes) / (time of dst.copy_(src)) for a
tensor of the same size. Bytes touched per round (float32, d parameters):
  banded C^{-1}, p bands, buffered:  write z, read z and p-1 past draws, write output  -> (p + 2)·4d
  BLT, m buffers:                    write z, read/write m buffers, write output         -> (2m + 3)·4d
Generating Gaussians is compute, not memory traffic; the ratio shows what it costs.
"draws floor" = filling d values with the generator's own sampler (fedmf.round.normal, all CPU
threads), which every structure pays each round; "one-thread randn" = one bare torch.randn call
(float32 on CPU: tails cut at 5.77σ, see fedmf/round/normal.py) for reference.
"into buffer" passes ``out=`` (one reused output tensor); "fresh tensor" allocates the
output every round (on CPU a large fresh tensor costs its page faults).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fedmf.mechanisms.blt import BufferedLinearToeplitz
from fedmf.mechanisms.toeplitz import BandedInverseFractionalRoot, BandedSquareRoot
from fedmf.round.draws import CHUNK_SIZE, Draws
from fedmf.round.noise import NoiseGenerator


def jax_per_round(kind: str, mech, d: int, rounds: int) -> float | None:
    """Median time per round of jax_privacy's matrix_factorization_privatizer on the same
    noising matrix (CPU, float32), or None when jax_privacy is not installed."""
    try:
        import jax
        import jax.numpy as jnp
        from jax_privacy import noise_addition
        from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz
    except ImportError:
        return None
    jax.config.update("jax_enable_x64", True)
    if kind == "iir":
        matrix = toeplitz.inverse_as_streaming_matrix(jnp.asarray(mech.coefficients / np.linalg.norm(mech.coefficients)))
    else:
        blt = buffered_toeplitz.BufferedToeplitz.build(buf_decay=mech.buf_decay, output_scale=mech.output_scale)
        matrix = blt.inverse_as_streaming_matrix()
    privatizer = noise_addition.matrix_factorization_privatizer(matrix, stddev=1.0, prng_key=0, dtype=jnp.float32)
    grads = jnp.zeros(d, dtype=jnp.float32)
    state = privatizer.init(grads)
    update = jax.jit(privatizer.update)
    out, state = update(grads, state)
    out.block_until_ready()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out, state = update(grads, state)
        out.block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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
    """One torch.randn call over all d values (one generator: one thread on CPU)."""
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


def draws_time(d: int, device: torch.device, repeats: int = 5) -> float:
    """Filling d fresh values with the generator's own sampler (all CPU threads): the floor
    of every structure, which must draw d new values per round."""
    draws = Draws(b"bench", d, 0, d, torch.float32, device, CHUNK_SIZE)
    out = torch.empty(d, device=device)
    times = []
    for row in range(repeats):
        _sync(device)
        t = time.perf_counter()
        draws.fill(row, out)
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def per_round(gen: NoiseGenerator, rounds: int, warmup: int, into_buffer: bool) -> float:
    buffer = torch.empty(gen.hi - gen.lo, dtype=gen.dtype, device=gen.device) if into_buffer else None
    for _ in range(warmup):
        gen.next(out=buffer)
    times = []
    for _ in range(rounds):
        _sync(gen.device)
        t = time.perf_counter()
        gen.next(out=buffer)
        _sync(gen.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1e6,1e7")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-gb", type=float, default=12.0,
                        help="skip structures whose state and output would exceed this many GB")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| d | structure | s/round into buffer (median) | s/round fresh tensor | bytes/round | copy GB/s | bound s "
          "| ratio (buffer) | draws floor s | one-thread randn s | jax_privacy s/round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for d in (int(float(x)) for x in args.sizes.split(",")):
        bw = copy_bandwidth(max(d, 1 << 25), device)
        floor = randn_time(d, device)
        draws_floor = draws_time(d, device)
        cases = []
        for p in (1, 8, 64):
            mech = BandedInverseFractionalRoot(max(p + 2 * args.rounds, 256), p, 0.6)
            cases.append((f"banded C^-1, p={p}", mech, (p + 2) * 4 * d, p + args.rounds))
        for p in (8, 64):
            mech = BandedSquareRoot(max(p + 2 * args.rounds, 256), p)
            cases.append((f"banded C, p={p}", mech, (p + 2) * 4 * d, p + args.rounds))
        blt = BufferedLinearToeplitz.from_decays(1024, np.array([0.99, 0.9, 0.6, 0.2]), np.array([0.95, 0.8, 0.4, 0.1]))
        cases.append(("BLT, 4 buffers", blt, (2 * 4 + 3) * 4 * d, 2))
        for name, mech, nbytes, warmup in cases:
            if nbytes > args.max_gb * 1e9:
                print(f"| {d:.0e} | {name} | skipped: needs about {nbytes / 1e9:.0f} GB (--max-gb {args.max_gb:g}) "
                      "| | | | | | | | |", flush=True)
                continue
            gen = NoiseGenerator(mech, d, 1.0, dtype=torch.float32, device=device, seed=b"bench")
            t = per_round(gen, args.rounds, warmup, into_buffer=True)
            gen = NoiseGenerator(mech, d, 1.0, dtype=torch.float32, device=device, seed=b"bench")
            t_fresh = per_round(gen, args.rounds, warmup, into_buffer=False)
            bound = nbytes / bw
            jax_kind = "iir" if name.startswith("banded C,") else "blt" if name.startswith("BLT") else None
            jt = jax_per_round(jax_kind, mech, d, args.rounds) if (jax_kind and device.type == "cpu") else None
            jcell = "-" if jt is None else f"{jt:.4f} ({jt / t:.1f}x ours)"
            print(f"| {d:.0e} | {name} | {t:.4f} | {t_fresh:.4f} | {nbytes / 1e6:.0f} MB | {bw / 1e9:.1f} | {bound:.4f} | "
                  f"{t / bound:.1f}x | {draws_floor:.4f} | {floor:.4f} | {jcell} |", flush=True)


if __name__ == "__main__":
    main()
