"""The Monte Carlo accountant of b-min-sep sampling (App. A of arXiv 2602.09338).

It draws y ~ P and y ~ Q of the dominating pair of a ``bminsep.BMinSep`` scheme and
averages the hockey-stick estimand max(0, 1 - e^{eps - L}) (§4.1 / App. A), L = ln P/Q
(y ~ P) or ln Q/P (y ~ Q): both divergence directions. The privacy loss L is the dynamic
program of ``bminsep`` (log space or the scaled linear recursion), vectorized over samples
(chunks of (rounds, samples) arrays). Both directions share one Gaussian draw per sample
(y_Q = σz, y_P = Cx + σz): each direction's estimator is still an average of i.i.d.
samples, which is all the verifier's tail bound needs. A chunk's inputs to the recursion
are computed a block of rounds at a time, so that they stay in cache (``_pair_rows``;
b = 1: ``_poisson_blocked``). Chunks run in worker threads when ``workers`` > 1 (numpy
releases the GIL in the Gaussian fills and the array operations); chunk j always uses the
stream SFC64(SeedSequence(seed, key + (j,))).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .. import checks
from ..errors import ConfigError
from .bminsep import _EXP_LIMIT, BMinSep, _correlate, _dp_log, _poisson, _row_offsets, _scaled_ok, _scaled_rows

__all__ = [
    "LossSamples",
    "MonteCarloEstimate",
    "MonteCarloAccountant",
    "delta_estimate",
    "kl_upper_bound",
    "kl_lower_bound",
]


# ---------------------------------------------------------------------------------------
# sampling from the dominating pair
# ---------------------------------------------------------------------------------------
def _participations(scheme: BMinSep, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds and sample indices of the sensitive client's participations: the next
    participation is last + b - 1 + Geometric(p) (§3.2); warm start draws the virtual
    last participation from the stationary law (Alg. 2)."""
    n, b, p = scheme.rounds, scheme.min_sep, scheme.sampling_probability
    if scheme.warm_start and b > 1:
        probs = np.full(b, p / (1.0 + (b - 1) * p))
        probs[0] = 1.0 / (1.0 + (b - 1) * p)
        last = rng.choice(b, p=probs / probs.sum(), size=count) - b  # 0: available at round 0
    else:
        last = np.full(count, -b, dtype=np.int64)
    active = np.arange(count)
    rows, cols = [], []
    while active.size:
        last = last + (b - 1) + rng.geometric(p, size=active.size)
        keep = last < n
        active, last = active[keep], last[keep]
        rows.append(last)
        cols.append(active)
    return np.concatenate(rows), np.concatenate(cols)


class _Buffers:
    """Scratch arrays reused across the chunks of one worker (no re-allocation per chunk)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None or a.shape != shape:
            a = self._arrays[name] = np.empty(shape)
        return a


_BLOCK = 1 << 16  # elements of e' computed at a time (512 KiB: in cache for the recursion)


def _pair_rows(scheme: BMinSep, sigma: float, z: np.ndarray, t: np.ndarray, cols: np.ndarray, gram: np.ndarray,
               work: _Buffers, peak: np.ndarray) -> Iterator[np.ndarray]:
    """The rows e'_i = exp(a_i - b·ln(1-p)), i = n-1 … 0, of 2S samples: the Q-draws
    (a from z, as in ``_chunk_losses``) and then the P-draws (the same times
    exp((C^T C x)_i/σ²) at the participations' windows). Computed a block of rounds at a
    time, small enough to stay in cache for the recursion that consumes it. ``peak`` (S,)
    receives the running column maximum of ln e' over the Q-draws."""
    n, S = z.shape
    L, width = scheme.num_bands, 2 * S
    bands, toeplitz = scheme.bands / sigma, scheme.toeplitz is not None
    shift = _row_offsets(scheme, sigma) - scheme.min_sep * math.log1p(-scheme.sampling_probability)
    with np.errstate(over="ignore"):  # an infinite factor is caught by the bound on ``peak``
        patches = [(r, c + S, np.exp(v)) for r, c, v in _signal(scheme, t, cols, gram, sigma)]  # sorted by r
    block = max(4, _BLOCK // width)
    buf = work.get("block", (block, width))
    tmp = work.get("tmp", (block, S))
    flat = buf.reshape(-1)
    for hi in range(n, 0, -block):
        lo = max(0, hi - block)
        eq = buf[: hi - lo, :S]
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # inf·0 is caught by ``peak``
            np.multiply(z[lo:hi], bands[0, 0] if toeplitz else bands[0, lo:hi, None], out=eq)
            for k in range(1, L):  # a_i += c_k·z_{i+k}/σ for i + k < n
                top = min(hi, n - k)
                if top > lo:
                    part = tmp[: top - lo]
                    np.multiply(z[lo + k : top + k], bands[k, 0] if toeplitz else bands[k, lo:top, None], out=part)
                    np.add(eq[: top - lo], part, out=eq[: top - lo])
            eq += shift[lo:hi, None]
            np.maximum(peak, np.max(eq, axis=0), out=peak)
            np.exp(eq, out=eq)
            buf[: hi - lo, S:] = eq
            for r, c, f in patches:
                i0, i1 = np.searchsorted(r, (lo, hi))
                if i1 > i0:
                    flat[(r[i0:i1] - lo) * width + c[i0:i1]] *= f[i0:i1]
        for j in range(hi - lo - 1, -1, -1):
            yield buf[j]


def _signal(scheme: BMinSep, t: np.ndarray, cols: np.ndarray, gram: np.ndarray, sigma: float):
    """The P-draws' additions to a = ln(p·LR): (C^T C x)_r/σ² at r = t + d, |d| < L, one
    (rows, cols, values) triple per offset d (positions are distinct within one d; windows
    of two participations may overlap across offsets when b < 2L-1)."""
    n, L = scheme.rounds, scheme.num_bands
    inv = 1.0 / sigma**2
    for d in range(-(L - 1), L):
        r = t + d
        if d == 0:
            yield r, cols, gram[L - 1, t] * inv
            continue
        ok = (r >= 0) & (r < n)
        if np.any(ok):
            yield r[ok], cols[ok], gram[d + L - 1, t[ok]] * inv


def _poisson_blocked(scheme: BMinSep, sigma: float, z: np.ndarray, work: _Buffers) -> np.ndarray:
    """``_poisson`` of a = C z/σ + ln p - ||C e_i||²/(2σ²) for a diagonal C (b = 1), a
    block of rounds at a time (in cache): with a_i = s_i z_i + o_i,
    ln((1-p) + e^{a_i}) = o_i + ln((1-p)e^{-o_i} + e^{s_i z_i}), summed over a block as the
    log of the product (one log per block and sample instead of one per round). A
    non-finite product (an overflow) sends the sample to the guarded ``_poisson``; z is
    left intact."""
    n, S = z.shape
    p = scheme.sampling_probability
    scaled = scheme.bands[0] / sigma
    offsets = _row_offsets(scheme, sigma)
    if p >= 1.0:
        return scaled @ z + offsets.sum()
    with np.errstate(over="ignore"):
        lifted = (1.0 - p) * np.exp(-offsets)
    block = min(16, max(4, _BLOCK // S))  # 16 factors rarely overflow
    buf = work.get("block", (block, S))
    prod = work.get("product", (S,))
    out = np.full(S, float(np.sum(offsets)))
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        a = buf[: hi - lo]
        np.multiply(z[lo:hi], scaled[lo:hi, None], out=a)
        with np.errstate(over="ignore", invalid="ignore"):
            np.exp(a, out=a)
            a += lifted[lo:hi, None]
            np.multiply.reduce(a, axis=0, out=prod)
            np.log(prod, out=prod)
        out += prod
    bad = ~np.isfinite(out)
    if np.any(bad):
        out[bad] = _poisson(z[:, bad] * scaled[:, None] + offsets[:, None], p)
    return out


def _chunk_losses(scheme: BMinSep, sigma: float, rng: np.random.Generator, count: int, gram: np.ndarray,
                  method: str, work: _Buffers | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ln P/Q on ``count`` Q-draws and on ``count`` P-draws that share one Gaussian draw z
    (n, count): y_Q = σz gives a = ln(p·LR) = <C e_i, z>/σ - ||C e_i||²/(2σ²) + ln p
    directly; y_P = Cx + σz adds <C e_i, C x>/σ² = (C^T C x)_i/σ² to a_i, non-zero only
    within L-1 rounds of a participation (x from ``_participations``, drawn after z)."""
    work = _Buffers() if work is None else work
    n, L = scheme.rounds, scheme.num_bands
    b, p, warm = scheme.min_sep, scheme.sampling_probability, scheme.warm_start
    S = count
    z = work.get("z", (n, S))
    rng.standard_normal(out=z)
    t, cols = _participations(scheme, rng, S)
    offsets = _row_offsets(scheme, sigma)
    if b == 1:
        # Poisson: ln f_0 = sum_i ln((1-p) + e^{a_i}) is a sum over rounds, so the P-draws
        # differ from the Q-draws only in the rounds the signal touches (L = 1: one each):
        # by ln((1-p) + e^{a_i + v_i}) - ln((1-p) + e^{a_i}), v_i = ||C e_i||²/σ²
        loss_q = _poisson_blocked(scheme, sigma, z, work)
        old = z[t, cols] * (scheme.bands[0, t] / sigma) + offsets[t]
        vals = gram[0, t] / sigma**2
        with np.errstate(over="ignore", invalid="ignore"):
            change = np.log((np.exp(old + vals) + (1.0 - p)) / (np.exp(old) + (1.0 - p)))
        bad = ~np.isfinite(change)  # an overflow: the guarded form
        if np.any(bad):
            change[bad] = _poisson((old + vals)[None, bad], p) - _poisson(old[None, bad], p)
        return loss_q, loss_q + np.bincount(cols, weights=change, minlength=S)
    order = np.argsort(t.astype(np.uint16) if n < 1 << 16 else t, kind="stable")
    t, cols = t[order], cols[order]  # by round: the scattered updates below walk memory in order
    if method == "log" or not _scaled_ok(b, p):
        a = _correlate(scheme, z, 1.0 / sigma, inplace=True)
        a += offsets[:, None]
        ap = a.copy()
        for r, c, v in _signal(scheme, t, cols, gram, sigma):
            ap[r, c] += v
        return _dp_log(a, b, p, warm), _dp_log(ap, b, p, warm)
    # scaled recursion on 2S columns (Q-draws, then P-draws), fed block by block
    peak = np.full(S, -np.inf)
    out, bad = _scaled_rows(_pair_rows(scheme, sigma, z, t, cols, gram, work, peak), n, 2 * S, b, p, warm)
    # ln e' <= 600 for the Q-draws; a P-draw adds at most ceil((2L-1)/b) signal terms (from
    # participations >= b apart whose windows of 2L-1 rounds cover the round) to it
    hits = -(-(2 * L - 1) // b)
    lift = hits * float(np.max(gram)) / sigma**2 if t.size else 0.0
    bad[:S] |= ~(peak <= _EXP_LIMIT)
    bad[S:] |= ~(peak + lift <= _EXP_LIMIT)
    if np.any(bad):  # a (Q-draws) or a + signal (P-draws) in log space, for these samples only
        idx = np.flatnonzero(bad)
        j = np.where(idx < S, idx, idx - S)
        sub = _correlate(scheme, np.ascontiguousarray(z[:, j]), 1.0 / sigma)
        sub += offsets[:, None]
        where = np.full(S, -1)
        where[j[idx >= S]] = np.flatnonzero(idx >= S)
        for r, c, v in _signal(scheme, t, cols, gram, sigma):
            k = where[c]
            ok = k >= 0
            sub[r[ok], k[ok]] += v[ok]
        out[idx] = _dp_log(sub, b, p, warm)
    return out[:S], out[S:]


# ---------------------------------------------------------------------------------------
# estimates and confidence bounds
# ---------------------------------------------------------------------------------------
def _kl(a: float, b: float) -> float:
    """Bernoulli KL(a || b)."""
    from scipy.special import rel_entr

    return float(rel_entr(a, b) + rel_entr(1.0 - a, 1.0 - b))


def kl_upper_bound(mean: float, samples: int, confidence: float = 0.95) -> float:
    """Upper confidence bound for the mean of [0, 1]-valued i.i.d. samples: the largest d
    with exp(-s·KL(mean || d)) >= 1 - confidence (Chernoff bound, Fact 4.2 of
    arXiv 2412.16802)."""
    from scipy.optimize import brentq

    level = math.log(1.0 / (1.0 - confidence)) / samples
    if mean >= 1.0:
        return 1.0
    if _kl(mean, 1.0 - 1e-16) <= level:
        return 1.0
    return float(brentq(lambda d: _kl(mean, d) - level, mean, 1.0 - 1e-16, xtol=1e-300, rtol=1e-12))


def kl_lower_bound(mean: float, samples: int, confidence: float = 0.95) -> float:
    from scipy.optimize import brentq

    level = math.log(1.0 / (1.0 - confidence)) / samples
    if mean <= 0.0 or _kl(mean, 0.0) <= level:
        return 0.0
    return float(brentq(lambda d: _kl(mean, d) - level, 0.0, mean, xtol=1e-300, rtol=1e-12))


def delta_estimate(losses: np.ndarray, epsilon: float, count: int | None = None) -> float:
    """(1/s)·Σ max(0, 1 - e^{eps - L_i}) (App. A): unbiased for the hockey-stick divergence."""
    losses = np.asarray(losses, dtype=np.float64)
    count = losses.size if count is None else count
    hit = losses[losses > epsilon]
    return float(np.sum(-np.expm1(epsilon - hit)) / count) if count else 0.0


@dataclass
class LossSamples:
    """Privacy-loss samples of both directions at one noise multiplier: ``count`` samples
    each, of which only the largest (``positive``/``negative``, sorted descending) are kept,
    so delta(eps) is exact for eps >= ``floor`` (the largest loss dropped); ``exact`` holds
    the full-sample delta estimates at the epsilons requested up front."""

    noise_multiplier: float
    count: int
    positive: np.ndarray
    negative: np.ndarray
    floor: float
    exact: dict = field(default_factory=dict)
    seconds: float = 0.0
    seed: int | None = None
    key: tuple = ()

    def delta(self, epsilon: float) -> tuple[float, float]:
        """(delta(P||Q), delta(Q||P)) estimates at ``epsilon``."""
        if epsilon in self.exact:
            return self.exact[epsilon]
        if epsilon < self.floor:
            raise ConfigError(f"too few losses kept to estimate delta at epsilon={epsilon:g} (< {self.floor:g})")
        return delta_estimate(self.positive, epsilon, self.count), delta_estimate(self.negative, epsilon, self.count)

    def epsilon(self, delta: float) -> float:
        """The smallest eps >= 0 with max(delta(P||Q), delta(Q||P)) <= delta (both
        estimates are non-increasing in eps, so this is a bisection)."""
        lo = max(self.floor, 0.0)
        if max(self.delta(lo)) <= delta:
            if self.floor > 0.0:
                raise ConfigError("too few losses kept to find epsilon at this delta (raise keep)")
            return lo
        top = max(self.positive[0] if self.positive.size else -np.inf, self.negative[0] if self.negative.size else -np.inf)
        hi = max(float(top), lo)
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if max(self.delta(mid)) > delta:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * max(1.0, hi):
                break
        return hi


@dataclass
class MonteCarloEstimate:
    """delta at one epsilon in both directions, with (two-sided) confidence bounds."""

    epsilon: float
    noise_multiplier: float
    samples: int
    delta_positive: float
    delta_negative: float
    confidence: float
    upper: float
    lower: float
    seconds: float

    @property
    def delta(self) -> float:
        return max(self.delta_positive, self.delta_negative)

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon, "noise_multiplier": self.noise_multiplier, "samples": self.samples,
                "delta": self.delta, "delta_positive": self.delta_positive, "delta_negative": self.delta_negative,
                "confidence": self.confidence, "delta_upper": self.upper, "delta_lower": self.lower,
                "seconds": self.seconds}


# ---------------------------------------------------------------------------------------
# the accountant
# ---------------------------------------------------------------------------------------
def _chunk_size(n: int, requested: int | None) -> int:
    if requested is not None:
        return checks.positive_int("chunk_size", requested)
    return int(min(1 << 16, max(256, _CHUNK // max(n, 1))))


_CHUNK = 1 << 19  # default samples per chunk x rounds: the Gaussian draw z of a chunk is 4 MiB


def _run_chunks(scheme: BMinSep, sigma: float, seed_entropy: int, key: tuple, chunks: Iterator[tuple[int, int]],
                keep: int, method: str, epsilons: tuple[float, ...] = ()) -> tuple:
    """Worker: the losses of the (chunk index, size) pairs it takes from ``chunks`` (shared
    between workers). Returns the ``keep`` largest of each direction, the largest dropped
    loss, and per chunk index, for each eps in ``epsilons``, the exact sums of the estimand
    max(0, 1 - e^{eps - L}) in both directions (summed by the caller in chunk order, so the
    result does not depend on which worker took which chunk)."""
    gram = scheme.gram_band()
    work = _Buffers()
    pos_keep, neg_keep = _TopK(keep), _TopK(keep)
    sums: dict[int, np.ndarray] = {}
    for index, size in chunks:
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed_entropy, spawn_key=key + (index,))))
        loss_q, loss_p = _chunk_losses(scheme, sigma, rng, size, gram, method, work)
        np.negative(loss_q, out=loss_q)  # y ~ Q: the privacy loss of Q against P is -ln P/Q
        sums[index] = np.array([[delta_estimate(loss_p, eps, 1), delta_estimate(loss_q, eps, 1)] for eps in epsilons])
        neg_keep.add(loss_q)
        pos_keep.add(loss_p)
    return pos_keep.result(), neg_keep.result(), max(pos_keep.floor, neg_keep.floor), sums


class _Shared:
    """A thread-safe iterator over a list (the chunks, taken by the workers in turn)."""

    def __init__(self, items: list) -> None:
        self._items = iter(items)
        self._lock = threading.Lock()

    def __iter__(self) -> _Shared:
        return self

    def __next__(self):
        with self._lock:
            return next(self._items)


class _TopK:
    """The k largest values seen, and the largest value dropped."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.floor = -np.inf

    def add(self, values: np.ndarray) -> None:
        self.parts.append(np.asarray(values, dtype=np.float64).copy())
        self.size += values.size
        if self.size > 2 * self.k:
            self._shrink()

    def _shrink(self) -> None:
        if not self.parts:  # a worker that took no chunk
            return
        v = np.concatenate(self.parts)
        if v.size > self.k:
            cut = v.size - self.k
            v = np.partition(v, cut)
            self.floor = max(self.floor, float(np.max(v[:cut])))
            v = v[cut:]
        self.parts, self.size = [v], v.size

    def result(self) -> np.ndarray:
        self._shrink()
        return np.sort(self.parts[0])[::-1].copy() if self.parts else np.zeros(0)


class MonteCarloAccountant:
    """Monte Carlo privacy accounting of a ``BMinSep`` scheme (App. A of arXiv 2602.09338).

    ``workers`` > 1 spreads the chunks over threads; results do not depend on it, bit for bit:
    chunk j always uses the random stream (seed, key, j) and per-chunk sums are added in chunk
    order."""

    def __init__(self, scheme: BMinSep, *, workers: int | None = 1, chunk_size: int | None = None,
                 method: str = "auto", keep: int = 200_000) -> None:
        if method not in ("auto", "scaled", "log"):
            raise ConfigError(f"unknown method {method!r} (use 'auto', 'scaled' or 'log')")
        self.scheme = scheme
        self.workers = (os.cpu_count() or 1) if workers is None else checks.positive_int("workers", workers)
        self.chunk_size = _chunk_size(scheme.rounds, chunk_size)
        self.method = method
        self.keep = checks.positive_int("keep", keep)

    def losses(self, noise_multiplier: float, samples: int, seed: int | None = None,
               key: tuple[int, ...] = (), epsilons: Sequence[float] = ()) -> LossSamples:
        """``samples`` privacy-loss samples per direction at this noise multiplier (noise std
        in clip-norm units, not divided by any column norm). Chunk j uses the random stream
        SFC64(SeedSequence(seed, spawn_key=key + (j,))); ``epsilons``: delta estimates that must be
        exact whatever ``keep`` is."""
        import time

        sigma = checks.positive("noise multiplier", noise_multiplier)
        samples = checks.positive_int("samples", samples)
        epsilons = tuple(float(e) for e in epsilons)
        entropy = np.random.SeedSequence().entropy if seed is None else int(seed)
        started = time.perf_counter()
        sizes = [(j, min(self.chunk_size, samples - j * self.chunk_size))
                 for j in range(-(-samples // self.chunk_size))]
        workers = min(self.workers, len(sizes))
        args = (self.scheme, sigma, entropy, tuple(key))
        if workers <= 1:
            parts = [_run_chunks(*args, iter(sizes), self.keep, self.method, epsilons)]
        else:  # threads: numpy releases the GIL in the Gaussian fills and the array operations
            shared = _Shared(sizes)
            with ThreadPoolExecutor(workers, thread_name_prefix="fedmf-mc") as pool:
                futures = [pool.submit(_run_chunks, *args, shared, self.keep, self.method, epsilons)
                           for _ in range(workers)]
                parts = [f.result() for f in futures]
        pos_k, neg_k = _TopK(self.keep), _TopK(self.keep)
        floor = max(part[2] for part in parts)
        by_chunk: dict[int, np.ndarray] = {}
        for pos_part, neg_part, _, part_sums in parts:
            pos_k.add(pos_part)
            neg_k.add(neg_part)
            by_chunk.update(part_sums)
        sums = np.zeros((len(epsilons), 2))
        for index in sorted(by_chunk):
            sums += by_chunk[index].reshape(len(epsilons), 2)
        pos, neg = pos_k.result(), neg_k.result()
        floor = max(floor, pos_k.floor, neg_k.floor)
        exact = {eps: (float(sums[j, 0] / samples), float(sums[j, 1] / samples)) for j, eps in enumerate(epsilons)}
        return LossSamples(sigma, samples, pos, neg, floor, exact, time.perf_counter() - started, entropy, tuple(key))

    def estimate(self, noise_multiplier: float, epsilon: float, samples: int, seed: int | None = None,
                 confidence: float = 0.95) -> MonteCarloEstimate:
        """Estimate delta(epsilon) = max over both directions, with a two-sided
        ``confidence`` interval (each direction bounded at level 1 - (1-confidence)/4,
        union bound over 2 directions x 2 sides)."""
        epsilon = checks.number("epsilon", epsilon)
        if epsilon < 0:
            raise ConfigError(f"epsilon must be non-negative, got {epsilon!r}")
        if not 0.0 < confidence < 1.0:
            raise ConfigError(f"confidence must lie in (0, 1), got {confidence!r}")
        result = self.losses(noise_multiplier, samples, seed, epsilons=(epsilon,))
        dp, dn = result.delta(epsilon)
        level = 1.0 - (1.0 - confidence) / 4.0
        upper = max(kl_upper_bound(dp, samples, level), kl_upper_bound(dn, samples, level))
        lower = max(kl_lower_bound(dp, samples, level), kl_lower_bound(dn, samples, level))
        return MonteCarloEstimate(epsilon, result.noise_multiplier, samples, dp, dn, confidence, upper, lower,
                                  result.seconds)
