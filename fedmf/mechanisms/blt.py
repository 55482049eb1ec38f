"""Buffered linear Toeplitz (BLT) mechanisms and their closed forms (the optimizer is
``blt_optimize``).

C is lower-triangular Toeplitz with c_0 = 1 and c_t = sum_i w_i theta_i^(t-1) (t >= 1): m
buffers with decays theta_i in (0, 1) and output scales w_i. Its generating function is
rational, c(x) = p(x)/q(x) with q = prod_i (1 - theta_i x) and p = prod_j (1 - that_j x), so
C^{-1} (generating function q/p) is a BLT too, with decays that_j and scales what_j.

A BLT is stored as the pair of *decay rates* (a, ahat) = (-log theta, -log that): every
difference of decays and every geometric sum is then evaluated with expm1 and the
phi-functions below, accurately as theta -> 1. Scales follow in closed form.

Sources (cited as):
  [DMPST24] Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and near-optimal
            noise generation for streaming differential privacy", arXiv 2404.16706.
  [MXZ24]   McMahan, Xu, Zhang, "A hassle-free algorithm for private learning in practice:
            don't use tree aggregation, use BLTs", arXiv 2408.08868.
  [MP25]    McMahan, Pillutla, "An inversion theorem for buffered linear Toeplitz (BLT)
            matrices and applications to streaming differential privacy", arXiv 2504.21413.
  [BSR]     "Beyond Square Roots", Theorem 1 (Toeplitz MinSep sensitivity).
Formulas marked [derived] are elementary consequences spelled out in the comment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .. import sensitivity as _sens
from ..errors import ConfigError
from ..participation import MinSep, Schema
from ..workloads import Workload
from .base import OPTIMIZED, Mechanism, check_rounds
from .streaming import Blt

__all__ = [
    "BufferedLinearToeplitz",
    "output_scales",
    "blt_coefficients",
    "geometric_sums",
    "MAX_BUFFERS",
]

#: more buffers than this is refused (the closed forms lose precision; 3-7 is typical)
MAX_BUFFERS = 15
#: non-Toeplitz (cooldown) workloads are optimized through a dense n x n matrix up to here
DENSE_LIMIT = 4096

_F64 = torch.float64
_SWITCH = 0.5  # below: Taylor series of the phi-functions; above: direct expm1 form
_TERMS = 16  # series terms: 0.5^16/17! < 1e-19, below double rounding


# ---------------------------------------------------------------------------------------
# stable elementary functions (torch, any device, float64)
# ---------------------------------------------------------------------------------------


def _tensor(values: Any, device: torch.device | str | None = None) -> torch.Tensor:
    if torch.is_tensor(values):
        return values.to(dtype=_F64, device=device)
    return torch.tensor(np.array(values, dtype=np.float64), dtype=_F64, device=device)


_SERIES = torch.tensor([[1.0 / math.factorial(j + k) for k in (1, 2)] for j in range(_TERMS)], dtype=_F64)


def _phis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi_1(x), phi_2(x)) for x >= 0, the phi-functions of exponential integrators:
    phi_1(x) = (1 - e^-x)/x, phi_2(x) = (e^-x - 1 + x)/x^2, phi_k(x) = sum_j (-x)^j/(j+k)!.
    Taylor series below the switch, expm1 above; both branches are gradient-safe."""
    small = x < _SWITCH
    xs = torch.where(small, -x, torch.zeros_like(x))
    xd = torch.where(small, torch.full_like(x, _SWITCH), x)
    series = (xs.unsqueeze(-1) ** torch.arange(_TERMS, dtype=_F64, device=x.device)) @ _SERIES.to(x.device)
    em1 = torch.expm1(-xd)
    return torch.where(small, series[..., 0], -em1 / xd), torch.where(small, series[..., 1], (em1 + xd) / xd**2)


def geometric_sums(rate: Any, count: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, W) = (sum_{t<N} r^t, sum_{t<N} (N - t) r^t) with r = e^-rate, elementwise, accurate
    (with gradients) for every rate >= 0 including rate -> 0 [derived]:
      S = (1 - r^N)/(1 - r) = N phi_1(N a)/phi_1(a)     (1 - e^-x = x phi_1(x));
      W = [N(1-r) - r(1-r^N)]/(1-r)^2, whose numerator (1-r)(1-r^N) + f(Na) - N f(a) with
          f(x) = e^-x - 1 + x = x^2 phi_2(x) is a sum of non-negative terms, so
      W = N [phi_1(a) phi_1(Na) + N phi_2(Na) - phi_2(a)] / phi_1(a)^2."""
    rate = _tensor(rate)
    count = torch.as_tensor(count, dtype=_F64, device=rate.device).expand_as(rate)
    p1, p2 = _phis(torch.cat([rate.reshape(-1), (count * rate).reshape(-1)]))
    (p1a, p1n), (p2a, p2n) = p1.reshape((2,) + rate.shape), p2.reshape((2,) + rate.shape)
    return count * p1n / p1a, count * (p1a * p1n + count * p2n - p2a) / p1a**2


_EXP_CAP = 350.0  # e^-350 ~ 1e-152: products of two such stay normal (subnormals are slow)


def _decay(x: torch.Tensor) -> torch.Tensor:
    """e^-x with x capped at 350: never below 1e-152, so sums of products of two decays
    avoid subnormal arithmetic. It can only *raise* tiny values, which keeps sensitivities
    computed from non-negative terms sound (off by < 1e-150 absolute)."""
    return torch.exp(-torch.clamp(x, max=_EXP_CAP))


def _exp_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """e^-x - e^-y, accurate when x ~ y: e^-min(x,y) (1 - e^-|x-y|) sign(y - x) [derived]."""
    return torch.exp(-torch.minimum(x, y)) * -torch.expm1(-torch.abs(x - y)) * torch.sign(y - x)


# ---------------------------------------------------------------------------------------
# BLT algebra
# ---------------------------------------------------------------------------------------


def output_scales(rates: torch.Tensor, other_rates: torch.Tensor) -> torch.Tensor:
    """Scales w of the BLT with decays theta = e^-rates whose generating function is
    p/q, p = prod(1 - that_j x), q = prod(1 - theta_i x), that = e^-other_rates:
        w_i = prod_j (theta_i - that_j) / prod_{l != i} (theta_i - theta_l)
    (partial fractions of p/q; [MP25] Theorem 2, [DMPST24] Lemma 5.2 / Prop. 5.6).
    Swapping the arguments gives the inverse's scales."""
    rates, other_rates = _tensor(rates), _tensor(other_rates)
    num = _exp_diff(rates[:, None], other_rates[None, :]).prod(dim=1)
    diff = _exp_diff(rates[:, None], rates[None, :])
    eye = torch.eye(rates.numel(), dtype=torch.bool, device=rates.device)
    den = torch.where(eye, torch.ones_like(diff), diff).prod(dim=1)
    return num / den


def blt_coefficients(scale: torch.Tensor, rates: torch.Tensor, n: int) -> torch.Tensor:
    """Toeplitz coefficients 1, sum_i w_i theta_i^(t-1) (t = 1..n-1) ([MXZ24] Sec. 2), O(n m)."""
    scale, rates = _tensor(scale), _tensor(rates, scale.device)
    t = torch.arange(max(n - 1, 0), dtype=_F64, device=scale.device)
    tail = torch.exp(-t[:, None] * rates[None, :]) @ scale
    return torch.cat([torch.ones(1, dtype=_F64, device=scale.device), tail])[:n]


def _decoder_terms(rates: torch.Tensor, inv_rates: torch.Tensor, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, v) with d_t = K + sum_j v_j that_j^t the coefficients of A C^{-1} for the prefix
    workload A = 1/(1 - x) [derived: d_t = 1 + sum_j what_j (1 - that_j^t)/(1 - that_j)]:
    K = c(1)^{-1} = prod(1 - theta_i)/prod(1 - that_j) (the residue at x = 1, a product with
    no cancellation) and v_j = -what_j/(1 - that_j) (> 0 when what < 0, so d_t is then a
    sum of positive terms)."""
    k = torch.prod(-torch.expm1(-rates)) / torch.prod(-torch.expm1(-inv_rates))
    return k, inv_scale / torch.expm1(-inv_rates)


def single_sensitivity_sq(scale: torch.Tensor, rates: torch.Tensor, n: int) -> torch.Tensor:
    """||C e_0||^2 = 1 + sum_{i,l} w_i w_l sum_{t<n-1} (theta_i theta_l)^t, the single-
    participation sensitivity^2 ([DMPST24] Lemma 5.3), O(m^2)."""
    pair = rates[:, None] + rates[None, :]
    return 1.0 + (scale[:, None] * scale[None, :] * geometric_sums(pair, n - 1)[0]).sum()


def prefix_error_sq(
    rates: torch.Tensor, inv_rates: torch.Tensor, inv_scale: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, max) over rounds of ||(A C^{-1})_i||^2 for the prefix workload, O(m^2).
    Row i holds d_0..d_i, so max = sum_{t<n} d_t^2 (the last row; cf. [DMPST24] Lemma 5.4)
    and mean = (1/n) sum_{t<n} (n - t) d_t^2 [derived]; expanding d_t = K + sum v_j that_j^t
    turns both into geometric and weighted geometric sums."""
    k, v = _decoder_terms(rates, inv_rates, inv_scale)
    # coefficient of each geometric term in d_t^2 = K^2 + 2K sum_j v_j r_j^t + sum_jl v_j v_l (r_j r_l)^t
    coef = torch.cat([2 * k * v, (v[:, None] * v[None, :]).reshape(-1)])
    rate = torch.cat([inv_rates, (inv_rates[:, None] + inv_rates[None, :]).reshape(-1)])
    plain, weighted = geometric_sums(rate, n)
    largest = n * k**2 + (coef * plain).sum()
    mean = (k**2 * (n * (n + 1) / 2) + (coef * weighted).sum()) / n
    return mean, largest


class _ResidueGrid:
    """Index arrays for Theorem 1 by residue mod b (see ``minsep_sensitivity_sq``)."""

    def __init__(self, n: int, min_sep: int, k: int, device: torch.device | str | None = None) -> None:
        b = min_sep
        q = torch.arange(-(-n // b), dtype=_F64, device=device)
        first0 = torch.clamp(q - k + 1, min=1.0)  # rho = 0: shifts l >= 1 (l = 0 is c_0 = 1)
        first1 = torch.clamp(q - k + 1, min=0.0)
        self.b = b
        self.rho = torch.arange(b, dtype=_F64, device=device)
        self.start0, self.count0 = first0 * b, (q - first0 + 1) * b
        self.start1, self.count1 = first1 * b, (q - first1 + 1) * b
        self.delta = (q <= k - 1).to(_F64)
        self.full_rows, self.tail = n // b, n % b  # complete rows; columns of the partial last row


def minsep_sensitivity_sq(scale: torch.Tensor, rates: torch.Tensor, grid: _ResidueGrid) -> torch.Tensor:
    """||sum_{i<k} shift(c, i b)||^2 truncated to n rows: the exact MinSep(b, k) sensitivity^2
    of a Toeplitz C with non-negative non-increasing coefficients ([BSR] Theorem 1).

    For t = q b + rho, s_t = [rho = 0, q < k] + sum_j w_j sum_{l=l0}^{q} theta_j^{rho + l b - 1}
    with l0 = max(q - k + 1, [rho = 0]) [derived], a geometric sum in theta_j^b, so
    s[q, rho] = delta + sum_j P[rho, j] R[q, j] with P = w theta^{rho-1}/(1 - theta^b) and
    R = theta^{l0 b}(1 - theta^{(q - l0 + 1) b}). The columns rho >= 1 of the complete rows
    form the rank-m product R P^T, whose squared Frobenius norm is <R^T R, P^T P> [derived]:
    O((n/b + b) m^2) work and memory, however large n and k are."""
    ab = rates * grid.b
    p = scale * _decay((grid.rho - 1)[:, None] * rates[None, :]) / -torch.expm1(-ab)  # (b, m)

    def r(start: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return _decay(start[:, None] * rates[None, :]) * -torch.expm1(-count[:, None] * rates[None, :])

    r1, full = r(grid.start1, grid.count1), grid.full_rows
    total = ((r1[:full].T @ r1[:full]) * (p[1:].T @ p[1:])).sum()
    if grid.tail > 1:  # the partial last row, columns 1 .. tail-1
        total = total + ((p[1 : grid.tail] @ r1[full]) ** 2).sum()
    col0 = grid.delta + r(grid.start0, grid.count0) @ p[0]
    return total + (col0**2).sum()


def _momentum_noise(inv_scale: torch.Tensor, inv_rates: torch.Tensor, beta: float, n: int) -> torch.Tensor:
    """Coefficients u of M_beta C^{-1} (M_beta = 1/(1 - beta x), the momentum filter):
    u_t = beta^t + sum_j what_j (that_j^t - beta^t)/(that_j - beta) [derived by partial
    fractions of x/((1 - that x)(1 - beta x))], the divided difference evaluated as
    e^{-lo (t-1)} (1 - e^{-d t})/(1 - e^{-d}) with lo = min rate and d = |rate gap|."""
    if beta == 0.0:
        return blt_coefficients(inv_scale, inv_rates, n)
    t = torch.arange(n, dtype=_F64, device=inv_scale.device)
    rb = torch.tensor(-math.log(beta), dtype=_F64, device=t.device)
    lo, gap = torch.minimum(inv_rates, rb), torch.abs(inv_rates - rb)
    same = gap == 0
    safe = torch.where(same, torch.ones_like(gap), gap)
    ratio = -torch.expm1(-t[:, None] * safe[None, :]) / -torch.expm1(-safe[None, :])
    ratio = torch.where(same[None, :], t[:, None].expand_as(ratio), ratio)
    dd = torch.exp(-(t[:, None] - 1) * lo[None, :]) * ratio
    return torch.exp(-rb * t) + dd @ inv_scale


def workload_error_sq(
    inv_scale: torch.Tensor, inv_rates: torch.Tensor, workload: Workload, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, max) over rounds of ||(A C^{-1})_i||^2 for any workload, from the coefficients
    u of M_beta C^{-1}: (A C^{-1})[i, j] = sum_{s=j}^{i} lr_s u_{s-j} (workloads.py). Toeplitz A
    (no cooldown): the coefficients d = cumsum(u), rows nested, O(n m). Otherwise a dense
    n x n product (n <= DENSE_LIMIT)."""
    u = _momentum_noise(inv_scale, inv_rates, workload.momentum, n)
    if workload.is_toeplitz:
        d2 = torch.cumsum(u, 0) ** 2
        weights = torch.arange(n, 0, -1, dtype=_F64, device=u.device)
        return (weights * d2).sum() / n, d2.sum()
    if n > DENSE_LIMIT:
        raise ConfigError(f"a cooldown workload is optimized densely, up to n={DENSE_LIMIT} rounds (got {n})")
    i = torch.arange(n, device=u.device)
    lag = i[:, None] - i[None, :]
    dense = torch.where(lag >= 0, u[lag.clamp(min=0)], torch.zeros((), dtype=_F64, device=u.device))
    lr = torch.as_tensor(workload.learning_rates(n), dtype=_F64, device=u.device)
    rows = (torch.cumsum(lr[:, None] * dense, 0) ** 2).sum(1)
    return rows.mean(), rows.max()


# ---------------------------------------------------------------------------------------
# the mechanism
# ---------------------------------------------------------------------------------------


def _frozen(values: Any) -> np.ndarray:
    arr = np.array(values, dtype=np.float64).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class BufferedLinearToeplitz(Mechanism):
    """BLT strategy C ([MXZ24], [DMPST24]) given by decay rates a = -log theta (C's buffers)
    and ahat = -log that (C^{-1}'s buffers); scales follow in closed form (``output_scales``).

    Rates are kept sorted increasingly (decays decreasing). C has non-negative,
    non-increasing coefficients (so [BSR] Theorem 1 gives its exact MinSep sensitivity)
    whenever the decays interlace, theta_1 > that_1 > theta_2 > ... > theta_m > that_m
    (then w > 0, what < 0 and c_1 = sum w < 1; [MP25] Theorem 1) — ``blt_optimize.optimize_blt`` only
    produces such BLTs.
    """

    kind = "blt"
    made_by = OPTIMIZED
    options = ("num_buffers", "error", "tolerance", "max_steps", "progress")
    rounds: int
    decay_rates: np.ndarray
    inverse_decay_rates: np.ndarray
    workload: Workload = Workload()

    def __post_init__(self) -> None:
        check_rounds(self.rounds)
        a, ahat = _frozen(np.sort(self.decay_rates)), _frozen(np.sort(self.inverse_decay_rates))
        if a.size == 0 or a.size != ahat.size:
            raise ConfigError(f"a BLT needs m >= 1 decay rates for C and m for C^-1, got {a.size} and {ahat.size}")
        if a.size > MAX_BUFFERS:
            raise ConfigError(f"at most {MAX_BUFFERS} buffers are supported, got {a.size}")
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(ahat)) and np.all(a > 0) and np.all(ahat > 0)):
            raise ConfigError("BLT decay rates must be finite and > 0 (decays in (0, 1))")
        if np.any(np.diff(a) == 0) or np.any(np.diff(ahat) == 0):
            raise ConfigError("BLT decay rates must be distinct")
        object.__setattr__(self, "decay_rates", a)
        object.__setattr__(self, "inverse_decay_rates", ahat)
        if not (np.all(np.isfinite(self.output_scale)) and np.all(np.isfinite(self.inverse_output_scale))):
            raise ConfigError("BLT decay rates too close to each other: the output scales overflow")

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_decays(cls, rounds: int, buf_decay: Any, inverse_buf_decay: Any, workload: Workload = Workload()) -> BufferedLinearToeplitz:
        """From the decay pair (theta, that). Near theta = 1 prefer the constructor with rates:
        a float theta holds 1 - theta only to ~1e-16 absolute."""
        return cls(rounds, -np.log(np.asarray(buf_decay, float)), -np.log(np.asarray(inverse_buf_decay, float)), workload)

    @classmethod
    def from_output_scale(cls, rounds: int, output_scale: Any, buf_decay: Any, workload: Workload = Workload()) -> BufferedLinearToeplitz:
        """From C's (w, theta) (the jax_privacy ``BufferedToeplitz`` parameters). The inverse
        decays are the eigenvalues of diag(theta) - w 1^T, the transition matrix of the recursion
        x_t = y_t - sum_i w_i buf_i, buf_i <- theta_i buf_i + x_t ([MXZ24] Alg. 3; [DMPST24] Lemma 5.2)."""
        w, theta = np.asarray(output_scale, float).reshape(-1), np.asarray(buf_decay, float).reshape(-1)
        if w.shape != theta.shape or not np.all((theta > 0) & (theta < 1)):
            raise ConfigError("output_scale and buf_decay need equal lengths and decays in (0, 1)")
        eig = np.linalg.eigvals(np.diag(theta) - np.outer(w, np.ones_like(w)))
        if np.any(np.abs(eig.imag) > 1e-12) or not np.all((eig.real > 0) & (eig.real < 1)):
            raise ConfigError(f"the inverse of this BLT is not a BLT with decays in (0, 1): {eig}")
        return cls.from_decays(rounds, theta, eig.real, workload)

    def params(self) -> dict[str, Any]:
        return {"decay_rates": self.decay_rates.tolist(), "inverse_decay_rates": self.inverse_decay_rates.tolist()}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> BufferedLinearToeplitz:
        """Accepts our ``params()`` or jax_privacy's {"output_scale", "buf_decay"}."""
        if "decay_rates" in params:
            return cls(rounds, params["decay_rates"], params["inverse_decay_rates"], workload)
        return cls.from_output_scale(rounds, params["output_scale"], params["buf_decay"], workload)

    # ---- parameters --------------------------------------------------------------------
    @property
    def num_buffers(self) -> int:
        return int(self.decay_rates.size)

    @cached_property
    def buf_decay(self) -> np.ndarray:
        return _frozen(np.exp(-self.decay_rates))

    @cached_property
    def inverse_buf_decay(self) -> np.ndarray:
        return _frozen(np.exp(-self.inverse_decay_rates))

    @cached_property
    def output_scale(self) -> np.ndarray:
        return _frozen(output_scales(self.decay_rates, self.inverse_decay_rates).numpy())

    @cached_property
    def inverse_output_scale(self) -> np.ndarray:
        return _frozen(output_scales(self.inverse_decay_rates, self.decay_rates).numpy())

    @property
    def is_monotone(self) -> bool:
        """w > 0 and sum w <= 1: then c_t >= 0 is non-increasing for every t [derived:
        c_1 = sum w <= c_0 = 1 and for t >= 1 c_t is a positive mix of decreasing theta^(t-1)]."""
        w = self.output_scale
        return bool(np.all(w > 0) and np.sum(w) <= 1.0)

    # ---- strategy and inverse ----------------------------------------------------------
    def coefficients(self, n: int | None = None, inverse: bool = False, device: Any = None) -> torch.Tensor:
        """First n Toeplitz coefficients of C (or C^{-1}) as a float64 tensor on ``device``."""
        n = self.rounds if n is None else n
        scale = self.inverse_output_scale if inverse else self.output_scale
        rates = self.inverse_decay_rates if inverse else self.decay_rates
        return blt_coefficients(_tensor(scale, device), _tensor(rates, device), n)

    @cached_property
    def strategy_toeplitz(self) -> np.ndarray:
        return _frozen(self.coefficients().numpy())

    @cached_property
    def inverse_toeplitz(self) -> np.ndarray:
        return _frozen(self.coefficients(inverse=True).numpy())

    def strategy_matrix(self) -> np.ndarray:
        return self.strategy_columns(range(self.rounds))

    def streaming_inverse(self) -> Blt:
        """C^{-1} is itself a BLT with C^{-1}'s own buffers ([MXZ24] Alg. 2)."""
        return Blt(self.inverse_buf_decay, self.inverse_output_scale)

    # ---- closed forms --------------------------------------------------------------------
    def _torch_params(self) -> tuple[torch.Tensor, ...]:
        return tuple(_tensor(v) for v in (self.output_scale, self.decay_rates, self.inverse_output_scale, self.inverse_decay_rates))

    def single_participation_sensitivity(self) -> float:
        """Largest column norm of C without materializing it ([DMPST24] Lemma 5.3)."""
        w, a, _, _ = self._torch_params()
        return float(torch.sqrt(single_sensitivity_sq(w, a, self.rounds)))

    def prefix_errors_sq(self) -> tuple[float, float]:
        """(mean, max) of ||(A C^{-1})_i||^2 for the prefix workload, O(m^2), any n."""
        _, a, what, ahat = self._torch_params()
        mean, largest = prefix_error_sq(a, ahat, what, self.rounds)
        return float(mean), float(largest)

    def sensitivity(self, schema: Schema) -> _sens.Sensitivity:
        """MinSep in closed form when C is monotone (k = 1: [DMPST24] Lemma 5.3, O(m^2);
        k > 1: [BSR] Theorem 1 by residues, O((n/b + b) m^2)); else fedmf.sensitivity."""
        if not isinstance(schema, MinSep) or not self.is_monotone:
            return _sens.sensitivity(self, schema)
        n = self.rounds
        schema.validate(n)
        k = schema.participations(n)
        if k == 1:
            return _sens.Sensitivity(self.single_participation_sensitivity(), "single-participation", True)
        w, a, _, _ = self._torch_params()
        value = minsep_sensitivity_sq(w, a, _ResidueGrid(n, schema.min_sep, k))
        return _sens.Sensitivity(float(torch.sqrt(value)), "toeplitz-closed-form", True)

    def evaluate(self, schema: Schema) -> dict[str, Any]:
        """As ``Mechanism.evaluate``; the prefix workload's errors come from the closed forms."""
        if not self.workload.is_prefix:
            return super().evaluate(schema)
        sens = self.sensitivity(schema)
        mean, largest = self.prefix_errors_sq()
        loss = mean * sens.value**2
        return {"loss": loss, "rmse": math.sqrt(loss), "max_error": math.sqrt(largest) * sens.value, **sens.to_dict()}
