"""b-min-sep Poisson sampling of clients and its Monte Carlo accountant.

Source: Dong & Ganesh, "Privacy Amplification for BandMF via b-Min-Sep Subsampling"
(arXiv 2602.09338; notes/bandmf_b_min_sep_subsampling.md).

Sampling (Alg. 1): in round i every client that was not *selected* in rounds
i-b+1 … i-1 is selected independently with probability p. Warm start (Alg. 2): each
client starts in state 0 ("available") with probability 1/(1+(b-1)p), else as if it had
been selected k = 1 … b-1 rounds before round 0 (probability p/(1+(b-1)p) each).

Dominating pair (§2.3, Lemma 4.5 of "Privacy Amplification for Matrix Mechanisms"):
P = Σ_x Pr[x]·N(C x, σ²I), Q = N(0, σ²I), x the 0/1 participation vector of one client,
C lower-triangular, entry-wise non-negative, with L <= b bands, σ the noise std in units
of the clip norm. The ratio is the backward dynamic program (Thm 5.1, Eq. 1):
    f_i = (1-p)·f_{i+1} + p·LR_i·f_{i+b},   f_i = 1 for i >= n,   P/Q = f_0 (cold),
    LR_i = exp((2<C e_i, y> - ||C e_i||²)/(2σ²))   (window i … i+L-1, truncated at n),
and with warm start (Cor. of Alg. 2) P/Q = [f_0 + p·Σ_{i=1}^{b-1} f_i]/(1+(b-1)p).
The truncated column norms ||C e_i||² are taken from the band array itself, so the last
L-1 columns are right for any L <= b (the reversed-cumsum bug of jax_privacy cannot occur).

The Monte Carlo accountant draws y ~ P and y ~ Q and averages the hockey-stick estimand
max(0, 1 - e^{eps - L}) (§4.1 / App. A), L = ln P/Q (y ~ P) or ln Q/P (y ~ Q): both
divergence directions. It is vectorized over samples (chunks of (rounds, samples) arrays),
float64 and overflow-safe: the dynamic program runs either in log space (``method="log"``,
the reference) or, by default, as an equivalent linear recursion with a per-sample
log-scale (``_scaled_rows``: only additions of non-negative terms, renormalized every few
rounds; samples that come near float64 under/overflow are redone in log space) — the same
numbers (tested to 1e-9) at a fraction of the cost of logaddexp. Both directions share one
Gaussian draw per sample (y_Q = σz, y_P = Cx + σz): each direction's estimator is still an
average of i.i.d. samples, which is all the verifier's tail bound needs. A chunk's inputs
to the recursion are computed a block of rounds at a time, so that they stay in cache
(``_pair_rows``; b = 1: ``_poisson_blocked``). Chunks run in
worker threads when ``workers`` > 1 (numpy releases the GIL in the Gaussian fills and the
array operations); chunk j always uses the stream SFC64(SeedSequence(seed, key + (j,))).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from . import _validate

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism

__all__ = [
    "BMinSep",
    "log_likelihood_ratio",
    "privacy_loss",
    "LossSamples",
    "MonteCarloEstimate",
    "MonteCarloAccountant",
    "delta_estimate",
    "kl_upper_bound",
    "kl_lower_bound",
]

_TINY = 1e-280
_HUGE = 1e280


# ---------------------------------------------------------------------------------------
# the sampled mechanism
# ---------------------------------------------------------------------------------------
def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float64)
    a.setflags(write=False)
    return a


def bands_from_coefficients(coefficients: Sequence[float], rounds: int) -> np.ndarray:
    """(L, n) band array of the banded Toeplitz C with first column ``coefficients``:
    bands[k, i] = C[i+k, i] = c_k when i + k < n, else 0."""
    c = np.asarray(coefficients, dtype=np.float64)[:rounds]
    out = np.zeros((c.size, rounds))
    for k, ck in enumerate(c):
        out[k, : rounds - k] = ck
    return out


def bands_from_matrix(strategy: np.ndarray, num_bands: int) -> np.ndarray:
    """(L, n) band array of a square lower-triangular C with ``num_bands`` bands."""
    c = np.asarray(strategy, dtype=np.float64)
    n = c.shape[1]
    if c.shape != (n, n):
        raise ValueError(f"b-min-sep accounting needs a square strategy matrix, got shape {c.shape}")
    out = np.zeros((num_bands, n))
    for k in range(num_bands):
        out[k, : n - k] = np.diagonal(c, -k)
    rebuilt = sum(np.diag(out[k, : n - k], -k) for k in range(num_bands))
    if not np.allclose(rebuilt, c, rtol=0, atol=1e-12 * max(1.0, float(np.max(np.abs(c))))):
        raise ValueError(f"the strategy matrix is not lower-triangular with {num_bands} bands")
    return out


@dataclass(frozen=True, eq=False)
class BMinSep:
    """A banded, non-negative, lower-triangular strategy C under b-min-sep sampling."""

    bands: np.ndarray  # (L, n): bands[k, i] = C[i+k, i]
    min_sep: int
    sampling_probability: float
    warm_start: bool = False
    toeplitz: np.ndarray | None = field(default=None)  # first column when C is Toeplitz

    def __post_init__(self) -> None:
        bands = np.asarray(self.bands, dtype=np.float64)
        if bands.ndim != 2 or bands.shape[0] < 1 or bands.shape[1] < 1:
            raise ValueError("bands must be a non-empty (num_bands, rounds) array")
        if not np.all(np.isfinite(bands)):
            raise ValueError("strategy coefficients must be finite")
        if np.any(bands < 0):
            raise ValueError("b-min-sep amplification needs a non-negative strategy matrix C")
        b = _validate.positive_int("min_sep", self.min_sep)
        # trailing all-zero bands do not count
        nz = np.flatnonzero(np.any(bands != 0, axis=1))
        if nz.size == 0:
            raise ValueError("the strategy matrix is zero")
        bands = bands[: nz[-1] + 1]
        if bands.shape[0] > b:
            raise ValueError(f"b-min-sep accounting needs bands L <= min_sep b, got L={bands.shape[0]} > b={b}")
        object.__setattr__(self, "bands", _readonly(bands))
        object.__setattr__(self, "min_sep", b)
        object.__setattr__(self, "sampling_probability", _validate.probability(self.sampling_probability))
        object.__setattr__(self, "warm_start", bool(self.warm_start))
        if self.toeplitz is not None:
            object.__setattr__(self, "toeplitz", _readonly(np.asarray(self.toeplitz)[: bands.shape[0]]))

    @classmethod
    def from_coefficients(cls, coefficients: Sequence[float], rounds: int, min_sep: int,
                          sampling_probability: float, warm_start: bool = False) -> "BMinSep":
        rounds = _validate.positive_int("rounds", rounds)
        c = np.asarray(coefficients, dtype=np.float64)
        if c.ndim != 1 or c.size == 0:
            raise ValueError("coefficients must be a non-empty 1-D array")
        if not np.all(np.isfinite(c)):
            raise ValueError("coefficients must be finite")
        if np.any(c < 0):
            raise ValueError("b-min-sep amplification needs non-negative coefficients")
        nz = np.flatnonzero(c)
        if nz.size == 0:
            raise ValueError("coefficients are all zero")
        c = c[: nz[-1] + 1]
        if c.size > _validate.positive_int("min_sep", min_sep):
            raise ValueError(f"b-min-sep accounting needs bands L <= min_sep b, got L={c.size} > b={min_sep}")
        return cls(bands_from_coefficients(c, rounds), min_sep, sampling_probability, warm_start, toeplitz=c[:rounds])

    @classmethod
    def from_mechanism(cls, mechanism: "Mechanism", min_sep: int, sampling_probability: float,
                       warm_start: bool = False) -> "BMinSep":
        """From a fedmf mechanism whose strategy C is banded with L <= b bands."""
        bands = mechanism.strategy_bands
        if bands is None:
            raise ValueError(f"b-min-sep amplification needs a banded strategy C; {mechanism.kind} is not banded")
        coef = mechanism.strategy_toeplitz
        if coef is not None:
            return cls.from_coefficients(np.asarray(coef)[:bands], mechanism.rounds, min_sep, sampling_probability, warm_start)
        if getattr(mechanism, "noise_rows", mechanism.rounds) != mechanism.rounds:
            raise ValueError(f"b-min-sep amplification needs a square strategy C ({mechanism.kind} is not)")
        return cls(bands_from_matrix(mechanism.strategy_matrix(), bands), min_sep, sampling_probability, warm_start)

    # ---- derived quantities --------------------------------------------------------
    @property
    def rounds(self) -> int:
        return int(self.bands.shape[1])

    @property
    def num_bands(self) -> int:
        return int(self.bands.shape[0])

    @property
    def column_norms_sq(self) -> np.ndarray:
        """||C e_i||² (truncated at the horizon for the last L-1 columns)."""
        return np.sum(self.bands**2, axis=0)

    def gram_band(self) -> np.ndarray:
        """(2L-1, n): G[d+L-1, t] = (C^T C)[t+d, t], zero where t+d is outside [0, n)."""
        L, n = self.bands.shape
        g = np.zeros((2 * L - 1, n))
        for d in range(L):  # (C^T C)[t+d, t] = sum_k C[t+d+k, t+d]·C[t+d+k, t] = sum_k bands[k, t+d]·bands[k+d, t]
            if d >= n:
                break
            v = np.sum(self.bands[: L - d, d:] * self.bands[d:, : n - d], axis=0)  # indexed by t
            g[L - 1 + d, : n - d] = v
            g[L - 1 - d, d:] = v  # (C^T C)[t-d, t] = (C^T C)[t, t-d]
        return g

    def to_dict(self) -> dict:
        out = {"rounds": self.rounds, "num_bands": self.num_bands, "min_sep": self.min_sep,
               "sampling_probability": self.sampling_probability, "warm_start": self.warm_start}
        if self.toeplitz is not None:
            out["coefficients"] = self.toeplitz.tolist()
        return out


# ---------------------------------------------------------------------------------------
# the dynamic program
# ---------------------------------------------------------------------------------------
def _correlate(scheme: BMinSep, z: np.ndarray, factor: float = 1.0, inplace: bool = False) -> np.ndarray:
    """out[i] = factor·<C e_i, z> = factor·sum_k bands[k, i]·z[i+k] for each column of
    z (n, S). With ``inplace`` z may be overwritten (and returned)."""
    L, n = scheme.bands.shape
    toeplitz = scheme.toeplitz is not None
    if toeplitz and L > 12:
        from scipy.signal import fftconvolve

        return fftconvolve(z, (factor * scheme.toeplitz[::-1])[:, None], mode="full", axes=0)[L - 1 :]
    first = factor * scheme.bands[0, 0] if toeplitz else factor * scheme.bands[0][:, None]
    if L == 1 and inplace:
        z *= first
        return z
    out = z * first
    if L == 1:
        return out
    if toeplitz and z.flags.c_contiguous:  # out[:n-k] += c_k·z[k:] as one BLAS axpy per band
        from scipy.linalg.blas import daxpy

        flat_out, flat_z, width = out.reshape(-1), z.reshape(-1), z.shape[1]
        for k in range(1, min(L, n)):
            m = (n - k) * width
            res = daxpy(flat_z[k * width:], flat_out[:m], n=m, a=factor * scheme.bands[k, 0])
            if not np.shares_memory(res, flat_out):
                flat_out[:m] = res
        return out
    tmp = np.empty_like(z)
    for k in range(1, L):
        m = n - k
        if m <= 0:
            break
        coef = factor * scheme.bands[k, 0] if toeplitz else factor * scheme.bands[k, :m, None]
        np.multiply(z[k:], coef, out=tmp[:m])
        out[:m] += tmp[:m]
    return out


def _row_offsets(scheme: BMinSep, sigma: float) -> np.ndarray:
    """ln p - ||C e_i||²/(2σ²): the per-round constant of ln(p·LR_i)."""
    return math.log(scheme.sampling_probability) - scheme.column_norms_sq / (2.0 * sigma**2)


def _log_p_ratios(scheme: BMinSep, y: np.ndarray, sigma: float) -> np.ndarray:
    """a[i] = ln p + (2<C e_i, y> - ||C e_i||²)/(2σ²) = ln(p·LR_i), for y of shape (n, S)."""
    a = _correlate(scheme, y, 1.0 / sigma**2)
    a += _row_offsets(scheme, sigma)[:, None]
    return a


def _finish_log(buf: np.ndarray, b: int, p: float, warm: bool) -> np.ndarray:
    if not warm or b == 1:
        return buf[0].copy()
    from scipy.special import logsumexp

    stacked = np.concatenate([buf[:1], buf[1:] + math.log(p)], axis=0)
    return logsumexp(stacked, axis=0) - math.log1p((b - 1) * p)


def _log_add(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = ln(e^x + e^y) for finite x, y (numpy's logaddexp is not SIMD-vectorized)."""
    m = np.maximum(x, y)
    d = np.subtract(x, y, out=out)
    np.abs(d, out=d)
    np.negative(d, out=d)
    np.exp(d, out=d)
    np.log1p(d, out=d)
    d += m
    return d


def _poisson(a: np.ndarray, p: float) -> np.ndarray:
    """b = 1 (Poisson sampling): ln f_0 = sum_i ln((1-p) + p·LR_i), a = ln(p·LR_i)."""
    if p >= 1.0:
        return np.sum(a, axis=0)
    with np.errstate(over="ignore"):
        v = np.exp(a)
    v += 1.0 - p
    np.log(v, out=v)
    out = np.sum(v, axis=0)
    bad = ~np.isfinite(out)  # some e^{a_i} overflowed: redo these columns with the guard
    if np.any(bad):
        sub = a[:, bad]
        v = np.exp(np.minimum(sub, 700.0))
        v += 1.0 - p
        np.log(v, out=v)
        big = sub > 700.0
        v[big] = sub[big]  # (1-p) is negligible against p·LR_i > e^700
        out[bad] = np.sum(v, axis=0)
    return out


def _dp_log(a: np.ndarray, b: int, p: float, warm: bool) -> np.ndarray:
    """ln f_0 (or the warm-start mixture) in log space, a = ln(p·LR_i) of shape (n, S):
    l_i = ln(e^{ln(1-p) + l_{i+1}} + e^{a_i + l_{i+b}}) with a circular buffer of b rows
    (slot i % b holds l_i, l_{i+1}, …; initial value ln 1 = 0 is the boundary)."""
    n, S = a.shape
    if b == 1:
        return _poisson(a, p)
    buf = np.zeros((b, S))
    if p >= 1.0:
        for i in range(n - 1, -1, -1):
            buf[i % b] += a[i]
        return _finish_log(buf, b, p, warm)
    lq = math.log1p(-p)
    t1 = np.empty(S)
    t2 = np.empty(S)
    for i in range(n - 1, -1, -1):
        s, s1 = i % b, (i + 1) % b
        np.add(buf[s1], lq, out=t1)
        buf[s] += a[i]
        _log_add(t1, buf[s], t2)
        buf[s] = t2
    return _finish_log(buf, b, p, warm)


_EXP_LIMIT = 600.0  # e'_i = exp(a_i - b·ln(1-p)) must stay below e^600 for the scaled recursion


def _scaled_ok(b: int, p: float) -> bool:
    """The scaled recursion is used for b > 1 and (1-p)^{-b} well inside float64."""
    return b > 1 and p < 1.0 and -b * math.log1p(-p) <= _EXP_LIMIT


def _scaled_core(e: np.ndarray, b: int, p: float, warm: bool) -> tuple[np.ndarray, np.ndarray]:
    """``_scaled_rows`` over the rows of e (n, S)."""
    n, width = e.shape
    return _scaled_rows((e[i] for i in range(n - 1, -1, -1)), n, width, b, p, warm)


def _scaled_rows(rows: Iterator[np.ndarray], n: int, width: int, b: int, p: float,
                 warm: bool) -> tuple[np.ndarray, np.ndarray]:
    """The recursion in linear space, in the form h_i = h_{i+1} + e'_i·h_{i+b}, with the
    rows e'_{n-1}, …, e'_0 (each of ``width`` samples) taken from ``rows`` in that order.

    With g_i = (1-p)^{n-i}·h_i the recursion f_i = (1-p)·f_{i+1} + p·LR_i·f_{i+b} becomes
    h_i = h_{i+1} + e'_i·h_{i+b}, e'_i = p·LR_i·(1-p)^{-b} (``e``, shape (n, S), all
    < e^600), h_i = (1-p)^{i-n} for i >= n, and f_0 = (1-p)^n·h_0. Only additions of
    non-negative terms: no cancellation. h is non-increasing in i, so the newest value is
    the buffer maximum; every ``period`` rounds the buffer is divided by it and its log is
    added to a per-sample scale. An older value that underflows is harmless: it enters as
    e'·h_{i+b} next to h_{i+1} >= 1 (the newest value is 1 right after a renormalization
    and only grows), a contribution below e^600·1e-308. Overflow between renormalizations
    shows as a non-finite newest value: such samples are flagged (returned mask) for the
    log-space recursion."""
    q = 1.0 - p
    lq = math.log(q)
    period = max(2 * b, 64)
    g = np.empty((b, width))
    for j in range(n, n + b):  # boundary h_j = q^{j-n}
        g[j % b] = q ** (j - n)
    scale = np.zeros(width)
    bad = np.zeros(width, dtype=bool)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        slots = list(g)  # row views, made once
        for step, (i, e_i) in enumerate(zip(range(n - 1, -1, -1), rows), 1):
            row = slots[i % b]
            row *= e_i
            row += slots[(i + 1) % b]
            if step % period == 0 or i == 0:
                top = row.copy()
                bad |= ~((top < _HUGE) & (top > _TINY))
                top[bad] = 1.0
                g /= top
                scale += np.log(top)
        if warm:  # [f_0 + p·sum_{j=1}^{b-1} f_j] with f_j = q^{n-j} h_j (slot j holds h_j, j < b)
            w = p * np.exp(-lq * np.arange(b))
            w[0] = 1.0
            out = np.log(np.tensordot(w, g, axes=1)) + scale + n * lq - math.log1p((b - 1) * p)
        else:
            out = np.log(g[0]) + scale + n * lq
    bad |= ~np.isfinite(out)
    return out, bad


def _scaled_exp(a: np.ndarray, b: int, p: float, out: np.ndarray | None = None) -> np.ndarray:
    """e' = exp(a - b·ln(1-p)) (written into ``out`` when given)."""
    with np.errstate(over="ignore", under="ignore"):
        out = np.subtract(a, b * math.log1p(-p), out=out)
        return np.exp(out, out=out)


def _too_big(e: np.ndarray) -> np.ndarray:
    """Samples (columns) with some e' above e^600 or not finite: log space for them."""
    return ~(e.max(axis=0) <= math.exp(_EXP_LIMIT))


def _dp_scaled(a: np.ndarray, b: int, p: float, warm: bool) -> np.ndarray:
    """ln f_0 from a = ln(p·LR_i) by the scaled linear recursion (``_scaled_core``),
    falling back to ``_dp_log`` where it is not safe."""
    if not _scaled_ok(b, p):
        return _dp_log(a, b, p, warm)
    e = _scaled_exp(a, b, p)
    big = _too_big(e)
    out, bad = _scaled_core(e, b, p, warm)
    bad |= big
    if np.any(bad):
        out[bad] = _dp_log(np.ascontiguousarray(a[:, bad]), b, p, warm)
    return out


def _dp(a: np.ndarray, b: int, p: float, warm: bool, method: str) -> np.ndarray:
    if method == "log":
        return _dp_log(a, b, p, warm)
    return _dp_scaled(a, b, p, warm)


def privacy_loss(scheme: BMinSep, y: np.ndarray, noise_multiplier: float, method: str = "auto") -> np.ndarray:
    """ln P(y)/Q(y) for each column of ``y`` (shape (n, S), or (n,) for one sample)."""
    sigma = _validate.noise(noise_multiplier)
    if method not in ("auto", "scaled", "log"):
        raise ValueError(f"unknown method {method!r} (use 'auto', 'scaled' or 'log')")
    y = np.asarray(y, dtype=np.float64)
    one = y.ndim == 1
    y2 = y[:, None] if one else y
    if y2.ndim != 2 or y2.shape[0] != scheme.rounds:
        raise ValueError(f"y must have {scheme.rounds} rows (one per round), got shape {y.shape}")
    if not np.all(np.isfinite(y2)):
        raise ValueError("y must be finite")
    out = _dp(_log_p_ratios(scheme, y2, sigma), scheme.min_sep, scheme.sampling_probability, scheme.warm_start, method)
    return out[0] if one else out


def log_likelihood_ratio(y, coefficients, min_sep: int, sampling_probability: float, noise_multiplier: float,
                         warm_start: bool = False) -> float:
    """ln P(y)/Q(y) of the dominating pair of b-min-sep sampling.

    P = Σ_x Pr[x]·N(C x, σ²I), Q = N(0, σ²I), C the n×n lower-triangular banded Toeplitz
    matrix with C[i+j, i] = coefficients[j] (not renormalized), n = len(y),
    σ = noise_multiplier, x the participation vector of b-min-sep sampling with
    probability p (cold start, or the warm start of Alg. 2)."""
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 1 or y.size == 0:
        raise ValueError("y must be a non-empty 1-D array")
    scheme = BMinSep.from_coefficients(coefficients, y.size, min_sep, sampling_probability, warm_start)
    return float(privacy_loss(scheme, y, noise_multiplier, method="log"))


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
            raise ValueError(f"too few losses kept to estimate delta at epsilon={epsilon:g} (< {self.floor:g})")
        return delta_estimate(self.positive, epsilon, self.count), delta_estimate(self.negative, epsilon, self.count)

    def epsilon(self, delta: float) -> float:
        """The smallest eps >= 0 with max(delta(P||Q), delta(Q||P)) <= delta (both
        estimates are non-increasing in eps, so this is a bisection)."""
        lo = max(self.floor, 0.0)
        if max(self.delta(lo)) <= delta:
            if self.floor > 0.0:
                raise ValueError("too few losses kept to find epsilon at this delta (raise keep)")
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
        return _validate.positive_int("chunk_size", requested)
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

    def __iter__(self) -> "_Shared":
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
            raise ValueError(f"unknown method {method!r} (use 'auto', 'scaled' or 'log')")
        self.scheme = scheme
        self.workers = (os.cpu_count() or 1) if workers is None else _validate.positive_int("workers", workers)
        self.chunk_size = _chunk_size(scheme.rounds, chunk_size)
        self.method = method
        self.keep = _validate.positive_int("keep", keep)

    def losses(self, noise_multiplier: float, samples: int, seed: int | None = None,
               key: tuple[int, ...] = (), epsilons: Sequence[float] = ()) -> LossSamples:
        """``samples`` privacy-loss samples per direction at this noise multiplier (noise std
        in clip-norm units, not divided by any column norm). Chunk j uses the random stream
        SFC64(SeedSequence(seed, spawn_key=key + (j,))); ``epsilons``: delta estimates that must be
        exact whatever ``keep`` is."""
        import time

        sigma = _validate.noise(noise_multiplier)
        samples = _validate.positive_int("samples", samples)
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
        epsilon = _validate.finite("epsilon", epsilon)
        if epsilon < 0:
            raise ValueError(f"epsilon must be non-negative, got {epsilon!r}")
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
        result = self.losses(noise_multiplier, samples, seed, epsilons=(epsilon,))
        dp, dn = result.delta(epsilon)
        level = 1.0 - (1.0 - confidence) / 4.0
        upper = max(kl_upper_bound(dp, samples, level), kl_upper_bound(dn, samples, level))
        lower = max(kl_lower_bound(dp, samples, level), kl_lower_bound(dn, samples, level))
        return MonteCarloEstimate(epsilon, result.noise_multiplier, samples, dp, dn, confidence, upper, lower,
                                  result.seconds)
