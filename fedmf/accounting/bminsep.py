"""b-min-sep Poisson sampling of clients: the sampled mechanism and its privacy loss.

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

The dynamic program is float64 and overflow-safe: it runs either in log space
(``method="log"``, the reference) or, by default, as an equivalent linear recursion with a
per-sample log-scale (``_scaled_rows``: only additions of non-negative terms, renormalized
every few rounds; samples that come near float64 under/overflow are redone in log space) —
the same numbers (tested to 1e-9) at a fraction of the cost of logaddexp.

The Monte Carlo accountant that samples this privacy loss lives in ``montecarlo``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .. import checks
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism

__all__ = [
    "BMinSep",
    "bands_from_coefficients",
    "bands_from_matrix",
    "log_likelihood_ratio",
    "privacy_loss",
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
        raise ConfigError(f"b-min-sep accounting needs a square strategy matrix, got shape {c.shape}")
    out = np.zeros((num_bands, n))
    for k in range(num_bands):
        out[k, : n - k] = np.diagonal(c, -k)
    rebuilt = sum(np.diag(out[k, : n - k], -k) for k in range(num_bands))
    if not np.allclose(rebuilt, c, rtol=0, atol=1e-12 * max(1.0, float(np.max(np.abs(c))))):
        raise ConfigError(f"the strategy matrix is not lower-triangular with {num_bands} bands")
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
            raise ConfigError("bands must be a non-empty (num_bands, rounds) array")
        if not np.all(np.isfinite(bands)):
            raise ConfigError("strategy coefficients must be finite")
        if np.any(bands < 0):
            raise ConfigError("b-min-sep amplification needs a non-negative strategy matrix C")
        b = checks.positive_int("min_sep", self.min_sep)
        # trailing all-zero bands do not count
        nz = np.flatnonzero(np.any(bands != 0, axis=1))
        if nz.size == 0:
            raise ConfigError("the strategy matrix is zero")
        bands = bands[: nz[-1] + 1]
        if bands.shape[0] > b:
            raise ConfigError(f"b-min-sep accounting needs bands L <= min_sep b, got L={bands.shape[0]} > b={b}")
        object.__setattr__(self, "bands", _readonly(bands))
        object.__setattr__(self, "min_sep", b)
        object.__setattr__(self, "sampling_probability",
                           checks.probability("sampling probability", self.sampling_probability))
        object.__setattr__(self, "warm_start", bool(self.warm_start))
        if self.toeplitz is not None:
            object.__setattr__(self, "toeplitz", _readonly(np.asarray(self.toeplitz)[: bands.shape[0]]))

    @classmethod
    def from_coefficients(cls, coefficients: Sequence[float], rounds: int, min_sep: int,
                          sampling_probability: float, warm_start: bool = False) -> BMinSep:
        rounds = checks.positive_int("rounds", rounds)
        c = np.asarray(coefficients, dtype=np.float64)
        if c.ndim != 1 or c.size == 0:
            raise ConfigError("coefficients must be a non-empty 1-D array")
        if not np.all(np.isfinite(c)):
            raise ConfigError("coefficients must be finite")
        if np.any(c < 0):
            raise ConfigError("b-min-sep amplification needs non-negative coefficients")
        nz = np.flatnonzero(c)
        if nz.size == 0:
            raise ConfigError("coefficients are all zero")
        c = c[: nz[-1] + 1]
        if c.size > checks.positive_int("min_sep", min_sep):
            raise ConfigError(f"b-min-sep accounting needs bands L <= min_sep b, got L={c.size} > b={min_sep}")
        return cls(bands_from_coefficients(c, rounds), min_sep, sampling_probability, warm_start, toeplitz=c[:rounds])

    @classmethod
    def from_mechanism(cls, mechanism: Mechanism, min_sep: int, sampling_probability: float,
                       warm_start: bool = False) -> BMinSep:
        """From a fedmf mechanism whose strategy C is banded with L <= b bands."""
        bands = mechanism.strategy_bands
        if bands is None:
            raise ConfigError(f"b-min-sep amplification needs a banded strategy C; {mechanism.kind} is not banded")
        coef = mechanism.strategy_toeplitz
        if coef is not None:
            return cls.from_coefficients(np.asarray(coef)[:bands], mechanism.rounds, min_sep, sampling_probability, warm_start)
        if getattr(mechanism, "noise_rows", mechanism.rounds) != mechanism.rounds:
            raise ConfigError(f"b-min-sep amplification needs a square strategy C ({mechanism.kind} is not)")
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
    sigma = checks.positive("noise multiplier", noise_multiplier)
    if method not in ("auto", "scaled", "log"):
        raise ConfigError(f"unknown method {method!r} (use 'auto', 'scaled' or 'log')")
    y = np.asarray(y, dtype=np.float64)
    one = y.ndim == 1
    y2 = y[:, None] if one else y
    if y2.ndim != 2 or y2.shape[0] != scheme.rounds:
        raise ConfigError(f"y must have {scheme.rounds} rows (one per round), got shape {y.shape}")
    if not np.all(np.isfinite(y2)):
        raise ConfigError("y must be finite")
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
        raise ConfigError("y must be a non-empty 1-D array")
    scheme = BMinSep.from_coefficients(coefficients, y.size, min_sep, sampling_probability, warm_start)
    return float(privacy_loss(scheme, y, noise_multiplier, method="log"))
