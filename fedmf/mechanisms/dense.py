"""Dense (optimal multi-epoch) factorization for fixed-epoch participation FixedEpoch(k, b).

Source: Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization
Mechanisms for Private Machine Learning" (arXiv 2211.06530), Sec. 3 and App. I.

The strategy Gram matrix X = C^T C solves  min tr(T X^{-1})  s.t.  u^T X u <= 1  for every
corner u of the neighbouring set (Eq. 18, T = A^T A). For FixedEpoch(k, b) the corners are
the +-1 sign vectors on each pattern {j, j+b, ..., j+(k-1)b}, 2^(k-1) per pattern up to a
global sign. The mechanism stores the dual variables v (one per corner) and derives
    U = sum_i v_i u_i u_i^T,   X(v) = U^{-1/2} (U^{1/2} T U^{1/2})^{1/2} U^{-1/2}   (Thm 3.1),
scaled to be feasible, then a lower-triangular C by reversed Cholesky (App. I / code).
For k > MAX_PARTICIPATIONS the corners are not enumerated: the dual runs over PSD pattern blocks
U_j with constant diagonal (the sensitivity for updates of any dimension), O(b k^2) variables,
and X is the structured (same-pattern-orthogonal) projection of X(U); see ``_BlockDual``.

Working order: rounds are permuted pattern-major (round e·b + j -> position j·k + e), so U
is block-diagonal with b blocks of size k x k and U^{+-1/2} costs O(b k^3).
The solvers that find the duals (``optimize_dense``: trust-region Newton-CG on the corner dual,
a barrier Newton-CG on the block dual) are in ``dense_optimize``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from scipy.linalg import solve_triangular

from ..errors import ConfigError
from ..participation import FixedEpoch
from ..workloads import Workload
from .base import OPTIMIZED, Mechanism, check_rounds
from .streaming import Dense

__all__ = ["DenseMechanism", "corner_signs", "MAX_PARTICIPATIONS"]

#: largest k whose 2^(k-1) sign corners per pattern are enumerated; beyond it the block dual
#: (``dense_optimize._optimize_blocks``) runs and the mechanism stores the (b, k, k) blocks U_j
MAX_PARTICIPATIONS = 12

#: up to this many rounds a CPU solve runs single-threaded with torch's eigh: at this size each
#: op takes microseconds and thread hand-offs (torch's OpenMP pool, scipy's BLAS pool) cost more
#: than they save (benchmarks/mechanisms.py, dense n=128)
SMALL_ROUNDS = 256

_DTYPE = torch.float64


# ---- problem structure --------------------------------------------------------------------
def corner_signs(k: int) -> np.ndarray:
    """The 2^(k-1) sign vectors s in {+-1}^k with s_0 = +1, shape (2^(k-1), k): the corners of
    one pattern up to global sign (Multi-Epoch MF, Sec. 3.2: |D| = |Pi|·2^k, halved by symmetry)."""
    return np.array([(1.0,) + tail for tail in itertools.product((1.0, -1.0), repeat=k - 1)])


def pattern_major(k: int, b: int) -> np.ndarray:
    """perm with perm[j·k + e] = e·b + j: position j·k + e of the working order is round e·b + j."""
    return np.array([e * b + j for j in range(b) for e in range(k)])


def _check_schema(rounds: int, schema: object) -> tuple[int, int]:
    """(k, b) of a FixedEpoch(k, b) schema that covers exactly ``rounds`` rounds, else ``ConfigError``."""
    if not isinstance(schema, FixedEpoch):
        raise ConfigError(f"the dense mechanism is optimized for FixedEpoch(k, b) only, got {type(schema).__name__}")
    k, b = schema.max_participations, schema.min_sep
    check_rounds(rounds)
    if k * b != rounds:
        raise ConfigError(f"fixed-epoch needs rounds = k x b, got {rounds} != {k} x {b}")
    return k, b


# ---- threads ---------------------------------------------------------------------------
def _small_cpu(rounds: int, device: torch.device) -> bool:
    """A CPU problem small enough to solve single-threaded with torch's eigh (SMALL_ROUNDS)."""
    return device.type == "cpu" and rounds <= SMALL_ROUNDS


@contextmanager
def _solve_threads(rounds: int, device: torch.device) -> Iterator[None]:
    """Run the block single-threaded (torch intra-op) for a small CPU problem, else unchanged.
    The setting is process-wide; it is restored on exit."""
    small = _small_cpu(rounds, device)
    before = torch.get_num_threads()
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if small:
            torch.set_num_threads(before)


# ---- the dual problem ---------------------------------------------------------------------
class _Singular(ArithmeticError):
    """U (or the inner matrix) is not positive definite at this v."""


@dataclass
class _Point:
    """Everything known at one dual point v (working order)."""

    v: torch.Tensor  # (b, m) dual variables
    trace_m: float  # tr((U^{1/2} T U^{1/2})^{1/2}) = tr(T X(v)^{-1})
    c: torch.Tensor  # (b, m) constraint values u_i^T X(v) u_i
    sigma: torch.Tensor  # (n,) eigenvalues of M = (U^{1/2} T U^{1/2})^{1/2}
    basis: torch.Tensor  # (b, k, n): V = U^{-1/2} Q, so X(v) = V diag(sigma) V^T

    @property
    def dual(self) -> float:
        """g(v) = 2 tr(M) - sum v (Thm 3.1, Eq. 7): a lower bound on the optimal loss."""
        return 2.0 * self.trace_m - float(self.v.sum())

    @property
    def violation(self) -> float:
        """max_i u_i^T X(v) u_i: X(v) / violation is feasible (sens = 1)."""
        return float(self.c.max())

    @property
    def primal(self) -> float:
        """tr(T X_feas^{-1}) with X_feas = X(v)/violation; tr(T X(v)^{-1}) = tr(M) since
        X(v)^{-1} = U^{1/2} M^{-1} U^{1/2} and U^{1/2} T U^{1/2} = M^2."""
        return self.violation * self.trace_m


class _Dual:
    """The Lagrange dual of Eq. 18 for FixedEpoch(k, b), in the pattern-major working order."""

    def __init__(self, workload_matrix: np.ndarray, k: int, b: int, device: torch.device) -> None:
        self.k, self.b, self.n = k, b, k * b
        self.device = device
        perm = pattern_major(k, b)
        a = torch.from_numpy(np.asarray(workload_matrix, dtype=np.float64)[:, perm]).to(device, _DTYPE)
        self.t = a.T @ a  # T = A^T A (Sec. 3, Eq. 6), rows and columns in the working order
        self.signs = torch.from_numpy(corner_signs(k)).to(device, _DTYPE)
        self.perm = perm
        self.scipy_eigh = device.type == "cpu" and not _small_cpu(self.n, device)

    @property
    def corners(self) -> int:
        return int(self.signs.shape[0])

    def blocks(self, v: torch.Tensor) -> torch.Tensor:
        """U_j = sum_s v_{j,s} s s^T = S^T diag(v_j) S for every pattern j, shape (b, k, k)."""
        return self.signs.T @ (v.unsqueeze(2) * self.signs)

    def quad(self, blocks: torch.Tensor) -> torch.Tensor:
        """s^T Y_j s for every pattern j and corner s, shape (b, m)."""
        return ((self.signs @ blocks) * self.signs).sum(2)

    def evaluate(self, v: torch.Tensor) -> _Point:
        """X(v) in factored form: one k x k eigh per pattern and one n x n eigh."""
        if not bool(torch.all(torch.isfinite(v))):
            raise _Singular("non-finite dual variables")
        sigma, basis = _geometric_mean(self.blocks(v), self.t, self.scipy_eigh)
        x_blocks = (basis * sigma) @ basis.transpose(1, 2)  # X(v)[pi_j, pi_j]
        c = self.quad(x_blocks)
        return _Point(v=v, trace_m=float(sigma.sum()), c=c, sigma=sigma, basis=basis)

    def hessian_vector(self, point: _Point, kernel: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """(d^2 g / dv^2) d. From X U X = T (Thm 3.1 stationarity): dX U X + X dU X + X U dX = 0;
        with X = V S V^T, XU = V S V^{-1}: dX = V Z V^T, Z = -(S Y S) / (s_a + s_b), Y = V^T dU V."""
        b, k, n = self.b, self.k, self.n
        basis = point.basis.reshape(n, n)
        y = basis.T @ (self.blocks(d) @ point.basis).reshape(n, n)
        vz = (basis @ (kernel * y)).reshape(b, k, n)
        return -self.quad(vz @ point.basis.transpose(1, 2))

    def hessian_diagonal(self, point: _Point, kernel: torch.Tensor, chunk: int = 64) -> torch.Tensor:
        """d^2 g / dv_i^2 for every corner, shape (b, m). With p_i = V^T u_i, the entry is
        -(p_i o p_i)^T K (p_i o p_i) (K = kernel); p_i o p_i = sum_{a<=c} w_ac (V_a o V_c) over the
        rows of the pattern's block of V, so one product K E with E = [V_a o V_c] serves all."""
        k = self.k
        rows, cols = np.triu_indices(k)
        weights = self.signs[:, rows] * self.signs[:, cols] * torch.where(
            torch.from_numpy(rows == cols).to(self.device), 1.0, 2.0
        )  # (m, pairs)
        out = []
        for start in range(0, self.b, chunk):
            basis = point.basis[start : start + chunk]  # (c, k, n)
            e = basis[:, rows, :] * basis[:, cols, :]  # (c, pairs, n)
            flat = e.reshape(-1, self.n)
            ke = (flat @ kernel).reshape(e.shape)
            g = e @ ke.transpose(1, 2)  # (c, pairs, pairs)
            out.append(-((weights @ g) * weights).sum(2))  # w_m^T G_j w_m
        return torch.cat(out)

    def pattern_blocks(self, point: _Point) -> np.ndarray:
        """X(v)[pi_j, pi_j] for every pattern j (unscaled), numpy (b, k, k)."""
        x = (point.basis * point.sigma) @ point.basis.transpose(1, 2)
        return (0.5 * (x + x.transpose(1, 2))).cpu().numpy()

    def gram(self, point: _Point, scale: float | None = None) -> np.ndarray:
        """Feasible X = X(v)/scale (default: the violation over this problem's corners) in the
        original round order (numpy, n x n)."""
        n = self.n
        basis = point.basis.reshape(n, n)
        x = ((basis * point.sigma) @ basis.T) / (point.violation if scale is None else scale)
        x = 0.5 * (x + x.T)
        out = np.empty((n, n))
        out[np.ix_(self.perm, self.perm)] = x.cpu().numpy()
        return out


def _geometric_mean(blocks: torch.Tensor, t: torch.Tensor, scipy_eigh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma, V) with X(U) = V diag(sigma) V^T = U^{-1/2} (U^{1/2} T U^{1/2})^{1/2} U^{-1/2}
    (Thm 3.1) for the block-diagonal U given by its (b, k, k) pattern blocks (working order):
    one k x k eigh per pattern and one n x n eigh; sigma are the eigenvalues of M."""
    b, k, _ = blocks.shape
    n = b * k
    try:
        w, q = torch.linalg.eigh(blocks)
    except torch.linalg.LinAlgError as exc:
        raise _Singular(str(exc)) from None
    if not bool(torch.all(w > 0)):
        raise _Singular("U is singular")
    root = (q * w.sqrt().unsqueeze(1)) @ q.transpose(1, 2)  # U^{1/2}, block-diagonal
    inv_root = (q / w.sqrt().unsqueeze(1)) @ q.transpose(1, 2)  # U^{-1/2}
    left = (root @ t.view(b, k, n)).reshape(n, n)  # U^{1/2} T
    inner = (root @ left.T.reshape(b, k, n)).reshape(n, n)  # U^{1/2} T U^{1/2}
    try:
        lam, vec = _eigh(0.5 * (inner + inner.T), scipy_eigh)
    except (torch.linalg.LinAlgError, np.linalg.LinAlgError, ValueError) as exc:
        raise _Singular(str(exc)) from None
    if not bool(torch.all(torch.isfinite(lam))) or float(lam[0]) <= 0.0:
        raise _Singular("U^{1/2} T U^{1/2} is not positive definite")
    return lam.sqrt(), inv_root @ vec.reshape(b, k, n)  # V = U^{-1/2} Q


def _eigh(a: torch.Tensor, scipy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric eigendecomposition, ascending: LAPACK's divide-and-conquer via scipy (large CPU
    problems) or torch (accelerators, small CPU problems)."""
    if not scipy:
        return torch.linalg.eigh(a)
    from scipy.linalg import eigh

    lam, vec = eigh(a.numpy(), driver="evd", check_finite=False, overwrite_a=True)
    return torch.from_numpy(lam), torch.from_numpy(vec)


# ---- many participations: the dual over PSD pattern blocks with constant diagonal --------------
# For k > MAX_PARTICIPATIONS the 2^(k-1) corners are not enumerated. The sensitivity fedmf
# reports holds for updates of every dimension d: sens^2 = max_j max tr(X_j Y) over Y PSD with
# unit diagonal (Multi-Epoch MF, Definition 1 with d >= k; App. H). Dualizing that constraint
# replaces sum_s v_s s s^T by any PSD U_j with constant diagonal t_j (the cone over that set), so
#     g(U) = 2 tr((U^{1/2} T U^{1/2})^{1/2}) - sum_j t_j        (Thm 3.1, Eq. 7, same derivation)
# lower-bounds the loss of every factorization under FixedEpoch(k, b) with that sensitivity.
# It is also the dual of the problem with same-pattern columns of C orthogonal and tr X_j <= 1
# (notes Sec. 5.5, jax_privacy's dense.optimize), so the two problems share their optimum, and the
# primal is X(U) projected onto that structure: sens^2 = max_j tr X_j exactly, for every d.
@dataclass
class _BlockPoint:
    """Everything known at one block dual point U (working order)."""

    u: torch.Tensor  # (b, k, k) pattern blocks U_j, constant diagonal
    sigma: torch.Tensor  # (n,) eigenvalues of M = (U^{1/2} T U^{1/2})^{1/2}
    basis: torch.Tensor  # (b, k, n): V = U^{-1/2} Q, so X(U) = V diag(sigma) V^T
    dual: float  # g(U), a lower bound on the optimal total loss (any-dimension sensitivity)
    primal: float  # tr(T X_s^{-1}) of the structured projection X_s of X(U) (inf: not PD)


class _BlockDual:
    """g(U) over block-diagonal U whose k x k pattern blocks are PSD with constant diagonal."""

    def __init__(self, workload_matrix: np.ndarray, k: int, b: int, device: torch.device) -> None:
        self.k, self.b, self.n = k, b, k * b
        self.perm = pattern_major(k, b)
        self.a = torch.from_numpy(np.asarray(workload_matrix, dtype=np.float64)[:, self.perm]).to(device, _DTYPE)
        self.t = self.a.T @ self.a  # T = A^T A (Sec. 3, Eq. 6), working order
        self.eye = torch.eye(k, device=device, dtype=_DTYPE)
        self.device = device
        self.scipy_eigh = device.type == "cpu" and not _small_cpu(self.n, device)

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """Orthogonal (Frobenius) projection of (b, k, k) blocks onto the symmetric blocks with
        constant diagonal: the directions U may move in."""
        g = 0.5 * (g + g.transpose(1, 2))
        d = torch.diagonal(g, dim1=1, dim2=2)
        return g - torch.diag_embed(d) + d.mean(1)[:, None, None] * self.eye

    def evaluate(self, u: torch.Tensor) -> _BlockPoint:
        if not bool(torch.all(torch.isfinite(u))):
            raise _Singular("non-finite dual variables")
        sigma, basis = _geometric_mean(u, self.t, self.scipy_eigh)
        dual = 2.0 * float(sigma.sum()) - float(torch.diagonal(u, dim1=1, dim2=2).mean(1).sum())
        _, primal = self.structured(sigma, basis)
        return _BlockPoint(u=u, sigma=sigma, basis=basis, dual=dual, primal=primal)

    def structured(self, sigma: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(X_s, tr(T X_s^{-1})): X(U) with same-pattern off-diagonal entries zeroed and each
        pattern scaled to trace 1, so u^T X_s,j u = tr X_s,j = 1 for every sign vector and
        ||sum_i C_i g_i||^2 = sum_i X_ii ||g_i||^2 <= 1 for unit g_i of any dimension (notes
        Sec. 5.5). tr(T X_s^{-1}) = ||L^{-1} A^T||_F^2 with X_s = L L^T; inf when X_s is not PD."""
        b, k, n = self.b, self.k, self.n
        flat = basis.reshape(n, n)
        x = (flat * sigma) @ flat.T
        x = 0.5 * (x + x.T)
        view = x.view(b, k, b, k)
        idx = torch.arange(b, device=x.device)
        diag = torch.diagonal(view[idx, :, idx, :], dim1=1, dim2=2).clone()  # (b, k)
        view[idx, :, idx, :] = torch.diag_embed(diag)
        traces = diag.sum(1)
        if not bool(torch.all(traces > 0)):
            return x, math.inf
        scale = traces.rsqrt().repeat_interleave(k)
        x = x * scale[:, None] * scale[None, :]
        lower, info = torch.linalg.cholesky_ex(x)
        if int(info) != 0:
            return x, math.inf
        y = torch.linalg.solve_triangular(lower, self.a.T, upper=False)
        return x, float((y * y).sum())

    def gradient(self, point: _BlockPoint) -> torch.Tensor:
        """dg/dU = X(U) - I/k per block (envelope theorem on Eq. 7; tr U_j = k t_j), projected."""
        x_blocks = (point.basis * point.sigma) @ point.basis.transpose(1, 2)
        return self.project(x_blocks) - self.eye / self.k

    def hessian_vector(self, point: _BlockPoint, kernel: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """(d^2 g / dU^2) d, projected: dX = V Z V^T with Z = -kernel o (V^T dU V) as in
        ``_Dual.hessian_vector`` (X U X = T differentiated)."""
        n = self.n
        basis = point.basis.reshape(n, n)
        y = basis.T @ (d @ point.basis).reshape(n, n)
        vz = (basis @ (kernel * y)).reshape(self.b, self.k, n)
        return -self.project(vz @ point.basis.transpose(1, 2))


# ---- the mechanism ------------------------------------------------------------------------
def _reversed_cholesky(x: np.ndarray) -> np.ndarray:
    """Lower-triangular C with C^T C = X: P = reversal, L = chol(P X P), C = P L^T P
    (Multi-Epoch MF code, strategy_from_X; notes Sec. 5.6). On CPU with torch, single-threaded
    for small n like the solve (numpy's BLAS pool would contend with torch's)."""
    cpu = torch.device("cpu")
    with _solve_threads(x.shape[0], cpu):
        lower = torch.linalg.cholesky(torch.from_numpy(np.ascontiguousarray(x[::-1, ::-1])))
        return np.ascontiguousarray(lower.numpy().T[::-1, ::-1])


@dataclass(frozen=True, eq=False)
class DenseMechanism(Mechanism):
    """Optimal multi-epoch factorization for FixedEpoch(k, b), described by its dual variables.

    ``duals`` of shape (b, 2^(k-1)), k <= MAX_PARTICIPATIONS: ``duals[j, s]`` is the multiplier of
    corner s (row s of ``corner_signs(k)``) on pattern {j, j+b, ...}. Of shape (b, k, k), any k:
    ``duals[j]`` is the pattern block U_j of the block dual (``_BlockDual``), symmetric positive
    definite with constant diagonal, and X is the structured projection of X(U) (same-pattern
    columns of C orthogonal). C is derived deterministically (on CPU) from the duals.
    """

    kind = "dense"
    made_by = OPTIMIZED
    planned_schema = FixedEpoch
    options = ("device", "tolerance", "max_steps", "progress")
    rounds: int
    max_participations: int
    min_sep: int
    duals: np.ndarray
    workload: Workload = Workload()

    def __post_init__(self) -> None:
        k, b = _check_schema(self.rounds, FixedEpoch(self.max_participations, self.min_sep))
        duals = np.array(self.duals, dtype=np.float64)
        if not np.all(np.isfinite(duals)):
            raise ConfigError("dense duals must be finite")
        if duals.ndim == 3 or k > MAX_PARTICIPATIONS:
            if duals.shape != (b, k, k):
                raise ConfigError(f"dense dual blocks must have shape (b, k, k) = {(b, k, k)}, got {duals.shape}")
            diag = np.diagonal(duals, axis1=1, axis2=2)
            if not np.array_equal(duals, duals.transpose(0, 2, 1)) or np.any(diag != diag[:, :1]):
                raise ConfigError("dense dual blocks must be symmetric with a constant diagonal")
            blocks = duals
        else:
            corners = corner_signs(k)
            if duals.shape != (b, corners.shape[0]):
                raise ConfigError(
                    f"dense duals must have shape (b, corners) = {(b, corners.shape[0])} (2^(k-1) corners) "
                    f"or (b, k, k), got {duals.shape}"
                )
            if np.any(duals < 0):
                raise ConfigError("dense duals must be non-negative")
            blocks = np.einsum("jm,ma,mc->jac", duals, corners, corners)
        if not np.all(np.linalg.eigvalsh(blocks) > 0):
            raise ConfigError("dense duals must span every pattern (U = sum v_i u_i u_i^T positive definite)")
        duals.setflags(write=False)
        object.__setattr__(self, "duals", duals)

    @property
    def schema(self) -> FixedEpoch:
        return FixedEpoch(self.max_participations, self.min_sep)

    def params(self) -> dict[str, Any]:
        return {"max_participations": self.max_participations, "min_sep": self.min_sep, "duals": self.duals.tolist()}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> DenseMechanism:
        return cls(
            rounds,
            int(params["max_participations"]),
            int(params["min_sep"]),
            np.asarray(params["duals"], dtype=np.float64),
            workload,
        )

    @cached_property
    def _solution(self) -> tuple[np.ndarray, float, float]:
        """(feasible X, primal value tr(T X^{-1}), dual value g) from the stored duals."""
        cpu = torch.device("cpu")
        k, b = self.max_participations, self.min_sep
        with _solve_threads(self.rounds, cpu):
            if self.duals.ndim == 3:
                blocked = _BlockDual(self.workload.matrix(self.rounds), k, b, cpu)
                try:
                    point = blocked.evaluate(torch.from_numpy(self.duals.copy()))
                except _Singular as exc:
                    raise ConfigError(f"dense duals give no positive definite X(U): {exc}") from None
                if not math.isfinite(point.primal):
                    raise ConfigError("dense duals give no positive definite structured X")
                x = blocked.structured(point.sigma, point.basis)[0].numpy()
                gram = np.empty_like(x)
                gram[np.ix_(blocked.perm, blocked.perm)] = x
                return gram, point.primal, point.dual
            problem = _Dual(self.workload.matrix(self.rounds), k, b, cpu)
            try:
                point = problem.evaluate(torch.from_numpy(self.duals.copy()))
            except _Singular as exc:
                raise ConfigError(f"dense duals give no positive definite X(v): {exc}") from None
            return problem.gram(point), point.primal, point.dual

    @property
    def gram_matrix(self) -> np.ndarray:
        """X = C^T C, feasible: max over sign corners of u^T X u is 1."""
        return self._solution[0]

    @property
    def primal_value(self) -> float:
        """tr(A^T A X^{-1}): the total squared error with sensitivity 1 (loss·n)."""
        return self._solution[1]

    @property
    def dual_value(self) -> float:
        """g: a lower bound on the loss·n of any factorization under FixedEpoch(k, b) (block duals:
        of any whose sensitivity holds for updates of every dimension, as fedmf reports it)."""
        return self._solution[2]

    @cached_property
    def _strategy(self) -> np.ndarray:
        c = _reversed_cholesky(self.gram_matrix)
        c.setflags(write=False)
        return c

    def strategy_matrix(self) -> np.ndarray:
        return self._strategy.copy()

    def strategy_columns(self, indices: Sequence[int]) -> np.ndarray:
        return self._strategy[:, list(indices)]

    def column_norms_sq(self) -> np.ndarray:
        return np.sum(self._strategy**2, axis=0)

    def streaming_inverse(self) -> Dense:
        return Dense(self.inverse_matrix())

    def inverse_matrix(self) -> np.ndarray:
        return solve_triangular(self._strategy, np.eye(self.rounds), lower=True)

    @cached_property
    def decoder_row_norms_sq(self) -> np.ndarray:
        # B = A C^{-1}: C^T B^T = A^T, one triangular solve
        bt = solve_triangular(self._strategy.T, self.workload.matrix(self.rounds).T, lower=False)
        return np.sum(bt**2, axis=0)
