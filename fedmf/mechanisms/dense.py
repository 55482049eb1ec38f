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
"""

from __future__ import annotations

import itertools
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from scipy.linalg import solve_triangular

from ..participation import FixedEpoch
from ..workloads import Workload
from .base import Mechanism
from .optimize import OptimizationResult, Progress
from .streaming import Dense

__all__ = ["DenseMechanism", "optimize_dense", "corner_signs", "MAX_PARTICIPATIONS"]

#: largest k whose 2^(k-1) sign corners per pattern are enumerated; beyond it the block dual
#: (``_optimize_blocks``) runs and the mechanism stores the (b, k, k) blocks U_j
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
    if not isinstance(schema, FixedEpoch):
        raise ValueError(f"the dense mechanism is optimized for FixedEpoch(k, b) only, got {type(schema).__name__}")
    k, b = schema.max_participations, schema.min_sep
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if k * b != rounds:
        raise ValueError(f"fixed-epoch needs rounds = k x b, got {rounds} != {k} x {b}")
    return k, b


def _device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    rounds: int
    max_participations: int
    min_sep: int
    duals: np.ndarray
    workload: Workload = Workload()

    def __post_init__(self) -> None:
        k, b = _check_schema(self.rounds, FixedEpoch(self.max_participations, self.min_sep))
        duals = np.array(self.duals, dtype=np.float64)
        if not np.all(np.isfinite(duals)):
            raise ValueError("dense duals must be finite")
        if duals.ndim == 3 or k > MAX_PARTICIPATIONS:
            if duals.shape != (b, k, k):
                raise ValueError(f"dense dual blocks must have shape (b, k, k) = {(b, k, k)}, got {duals.shape}")
            diag = np.diagonal(duals, axis1=1, axis2=2)
            if not np.array_equal(duals, duals.transpose(0, 2, 1)) or np.any(diag != diag[:, :1]):
                raise ValueError("dense dual blocks must be symmetric with a constant diagonal")
            blocks = duals
        else:
            corners = corner_signs(k)
            if duals.shape != (b, corners.shape[0]):
                raise ValueError(
                    f"dense duals must have shape (b, corners) = {(b, corners.shape[0])} (2^(k-1) corners) "
                    f"or (b, k, k), got {duals.shape}"
                )
            if np.any(duals < 0):
                raise ValueError("dense duals must be non-negative")
            blocks = np.einsum("jm,ma,mc->jac", duals, corners, corners)
        if not np.all(np.linalg.eigvalsh(blocks) > 0):
            raise ValueError("dense duals must span every pattern (U = sum v_i u_i u_i^T positive definite)")
        duals.setflags(write=False)
        object.__setattr__(self, "duals", duals)

    @property
    def schema(self) -> FixedEpoch:
        return FixedEpoch(self.max_participations, self.min_sep)

    def params(self) -> dict[str, Any]:
        return {"max_participations": self.max_participations, "min_sep": self.min_sep, "duals": self.duals.tolist()}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> "DenseMechanism":
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
                    raise ValueError(f"dense duals give no positive definite X(U): {exc}") from None
                if not math.isfinite(point.primal):
                    raise ValueError("dense duals give no positive definite structured X")
                x = blocked.structured(point.sigma, point.basis)[0].numpy()
                gram = np.empty_like(x)
                gram[np.ix_(blocked.perm, blocked.perm)] = x
                return gram, point.primal, point.dual
            problem = _Dual(self.workload.matrix(self.rounds), k, b, cpu)
            try:
                point = problem.evaluate(torch.from_numpy(self.duals.copy()))
            except _Singular as exc:
                raise ValueError(f"dense duals give no positive definite X(v): {exc}") from None
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


# ---- the optimizer ------------------------------------------------------------------------
class _Tracker:
    """Best primal point and best dual bound over every evaluated v (both bounds stay valid)."""

    def __init__(self) -> None:
        self.best: _Point | None = None
        self.dual = -math.inf
        self.evaluations = 0

    def add(self, point: _Point) -> None:
        self.evaluations += 1
        if self.best is None or point.primal < self.best.primal:
            self.best = point
        self.dual = max(self.dual, point.dual)

    @property
    def gap(self) -> float:
        return self.best.primal - self.dual

    @property
    def relative_gap(self) -> float:
        return self.gap / self.best.primal


def _steihaug(
    grad: torch.Tensor, hessp, radius: float, tol: float, max_iter: int
) -> tuple[torch.Tensor, float, int]:
    """Truncated CG for min_z grad.z + z.Bz/2 s.t. ||z|| <= radius (Steihaug 1983; Nocedal &
    Wright, Alg. 7.2). Returns (z, model value, Hessian-vector products)."""
    z = torch.zeros_like(grad)
    r = grad.clone()
    d = -r
    rr = float(r.flatten() @ r.flatten())
    model = 0.0
    for i in range(max_iter):
        bd = hessp(d)
        dbd = float(d.flatten() @ bd.flatten())
        rd = float(r.flatten() @ d.flatten())
        if dbd <= 0:
            tau = _to_boundary(z, d, radius)
            return z + tau * d, model + tau * rd + 0.5 * tau * tau * dbd, i + 1
        alpha = rr / dbd
        step = z + alpha * d
        if float(step.norm()) >= radius:
            tau = _to_boundary(z, d, radius)
            return z + tau * d, model + tau * rd + 0.5 * tau * tau * dbd, i + 1
        # m(z + a d) = m(z) + a r.d + a^2 d.Bd / 2
        model += alpha * rd + 0.5 * alpha * alpha * dbd
        z = step
        r = r + alpha * bd
        rr_new = float(r.flatten() @ r.flatten())
        if math.sqrt(rr_new) <= tol:
            return z, model, i + 1
        d = -r + (rr_new / rr) * d
        rr = rr_new
    return z, model, max_iter


def _to_boundary(z: torch.Tensor, d: torch.Tensor, radius: float) -> float:
    """tau >= 0 with ||z + tau d|| = radius."""
    zz, zd, dd = float(z.flatten() @ z.flatten()), float(z.flatten() @ d.flatten()), float(d.flatten() @ d.flatten())
    return (-zd + math.sqrt(max(zd * zd + dd * (radius * radius - zz), 0.0))) / dd


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


def optimize_dense(
    rounds: int,
    schema: FixedEpoch,
    workload: Workload = Workload(),
    *,
    tolerance: float = 1e-3,
    max_steps: int = 10000,
    device: str | None = None,
    progress: Progress | None = None,
) -> tuple[DenseMechanism, OptimizationResult]:
    """The loss-optimal factorization for FixedEpoch(k, b) by maximizing the dual g(v).

    Trust-region Newton-CG on theta = log v. A step costs one n x n eigh (the point), a
    diagonal Hessian (about four n x n matmuls) and Hessian-vector products (two each).
    Stops when the relative duality gap (primal of the feasible-scaled X(v) minus the best
    dual, over the primal) is <= tolerance; ``steps`` counts evaluated points.
    """
    k, b = _check_schema(rounds, schema)
    if not (tolerance > 0):
        raise ValueError(f"tolerance must be positive, got {tolerance}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
    started = time.perf_counter()
    dev = _device(device)
    if k > MAX_PARTICIPATIONS:
        return _optimize_blocks(rounds, k, b, workload, tolerance, max_steps, dev, progress, started)
    with _solve_threads(rounds, dev):
        problem = _Dual(workload.matrix(rounds), k, b, dev)
        tracker, hvps, message = _trust_region(problem, tolerance, max_steps, progress)
        best = tracker.best
        gram = problem.gram(best) if dev.type == "cpu" else None
    duals = best.v.cpu().numpy().copy()
    mechanism = DenseMechanism(rounds, k, b, duals, workload)
    if gram is not None:  # same inputs, same code path: seed the cache instead of recomputing
        mechanism.__dict__["_solution"] = (gram, best.primal, best.dual)
    gap, rel = tracker.gap, tracker.relative_gap
    if rel < -1e-9:
        raise AssertionError(f"duality gap is negative ({gap}): primal {best.primal} < dual {tracker.dual}")
    converged = rel <= tolerance
    return mechanism, _result(converged, tracker.evaluations, best.primal, tracker.dual, gap, rel, rounds, tolerance,
                              message, started, hvps, dev, progress)


def _result(converged, steps, primal, dual, gap, rel, rounds, tolerance, message, started, hvps, dev, progress,
            **extra) -> OptimizationResult:
    """The optimizer's report (values per round); closes the progress line."""
    if progress is not None:
        progress.close(steps, primal / rounds, "converged" if converged else "NOT converged")
    return OptimizationResult(
        converged=converged, steps=steps, objective=primal / rounds, tolerance=tolerance, message=message,
        seconds=time.perf_counter() - started,
        details={"duality_gap": gap / rounds, "relative_duality_gap": rel, "primal_value": primal / rounds,
                 "dual_value": dual / rounds, "hessian_vector_products": hvps, "device": str(dev), **extra},
    )


def _newton_system(problem: _Dual, point: _Point):
    """Gradient and Hessian-vector product of f(theta) = -g(exp(theta)) at ``point``, in the
    diagonally scaled variables y with theta = theta_0 + scale * y.

    In theta the gradient of g is v (c - 1) (Cor. 3.1, chain rule) and its Hessian is
    D H D + diag(v (c - 1)) with D = diag(v), H = d^2 g / dv^2 (see ``hessian_vector``).
    scale^-2 is |diagonal| of that Hessian, floored at its mean so that no coordinate of
    theta moves much further than the trust region allows."""
    v = point.v
    slope = v * (point.c - 1.0)
    sig = point.sigma
    kernel = sig[:, None] * sig[None, :] / (sig[:, None] + sig[None, :])
    curvature = -(v * v) * problem.hessian_diagonal(point, kernel) + slope.abs()
    scale = curvature.clamp_min(float(curvature.mean())).rsqrt()

    def hessp(y: torch.Tensor) -> torch.Tensor:
        d = scale * y
        return -scale * (v * problem.hessian_vector(point, kernel, v * d) + slope * d)

    return -scale * slope, hessp, scale


def _trust_region(
    problem: _Dual,
    tolerance: float,
    max_steps: int,
    progress: Progress | None,
    start: torch.Tensor | None = None,
    evaluations: int = 0,
):
    """Minimize f(theta) = -g(exp(theta)) by trust-region Newton-CG (Nocedal & Wright,
    Alg. 4.1 with Steihaug's CG); one n x n eigh per step. Every evaluated point feeds the
    tracker, whose best primal and best dual are valid bounds whether or not the step is taken.
    ``start`` (positive, default all ones) is the first v; ``evaluations`` those already spent."""
    tracker = _Tracker()
    tracker.evaluations = evaluations
    v = torch.ones(problem.b, problem.corners, device=problem.device, dtype=_DTYPE) if start is None else start
    point = problem.evaluate(v)
    tracker.add(point)
    # g(a v) = 2 sqrt(a) tr M - a sum v is maximized at sqrt(a) = tr M / sum v (Eq. 7)
    theta = torch.log(v) + 2.0 * math.log(point.trace_m / float(v.sum()))
    point = problem.evaluate(torch.exp(theta))
    tracker.add(point)
    radius = first_radius = math.nan
    hvps = 0
    while True:
        if progress is not None:
            progress.update(tracker.evaluations, tracker.best.primal / problem.n, f"gap {tracker.relative_gap:.2e}")
        if tracker.relative_gap <= tolerance:
            return tracker, hvps, "relative duality gap below tolerance"
        if tracker.evaluations >= max_steps:
            return tracker, hvps, "maximum number of steps reached"
        grad, hessp, scale = _newton_system(problem, point)
        gnorm = float(grad.norm())
        if math.isnan(radius):  # the Newton step of a unit-Hessian model
            radius = first_radius = gnorm
        forcing = min(0.5, math.sqrt(max(tracker.relative_gap, 1e-16)))  # inexact Newton
        y, model, used = _steihaug(grad, hessp, radius, forcing * gnorm, max_iter=50)
        hvps += used
        trial_theta = theta + scale * y
        trial_theta = torch.maximum(trial_theta, trial_theta.max() - 600.0)  # keep exp(theta) > 0
        try:
            trial = problem.evaluate(torch.exp(trial_theta))
            tracker.add(trial)
            ratio = (trial.dual - point.dual) / -model if model < 0 else -math.inf
        except _Singular:
            tracker.evaluations += 1
            ratio = -math.inf
        step = float(y.norm())
        if ratio < 0.25:
            radius = 0.25 * step
        elif ratio > 0.75 and step >= 0.99 * radius:
            radius = min(2.0 * radius, 1e6 * first_radius)
        if ratio > 1e-4:
            theta, point = trial_theta, trial
        if radius < 1e-14 * first_radius:
            return tracker, hvps, "trust region collapsed"


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


def _pcg(hessp, rhs: torch.Tensor, precond, tol: float, max_iter: int) -> tuple[torch.Tensor, int]:
    """Preconditioned CG for H d = rhs with H positive definite (Nocedal & Wright, Alg. 5.3;
    ``precond`` applies the inverse of the preconditioner). Stops at ||residual|| <= tol or on non-positive curvature.
    Returns (d, Hessian-vector products)."""
    d = torch.zeros_like(rhs)
    r = rhs.clone()
    z = precond(r)
    p = z
    rz = float((r * z).sum())
    for i in range(max_iter):
        hp = hessp(p)
        php = float((p * hp).sum())
        if php <= 0.0:
            return (d if i else p), i + 1
        alpha = rz / php
        d = d + alpha * p
        r = r - alpha * hp
        if float(r.norm()) <= tol:
            return d, i + 1
        z = precond(r)
        rz_new = float((r * z).sum())
        p = z + (rz_new / rz) * p
        rz = rz_new
    return d, max_iter


def _max_step(u: torch.Tensor, d: torch.Tensor) -> float:
    """Largest a <= 1 with U + a d positive definite, times 0.95 (fraction to the boundary,
    Nocedal & Wright Eq. 19.9): 1 / lambda_max(-U^{-1/2} d U^{-1/2}) per block."""
    w, q = torch.linalg.eigh(u)
    r = q / w.sqrt().unsqueeze(1)
    top = float((-torch.linalg.eigvalsh(r.transpose(1, 2) @ d @ r)).max())
    return 1.0 if top <= 0.0 else min(1.0, 0.95 / top)


#: barrier weight at the start, relative to |g| / n, its decay per accepted Newton step, and its
#: floor (relative, ~ eps: the barrier must not hold U away from an ill-conditioned optimum)
_MU_START, _MU_DECAY, _MU_FLOOR = 0.1, 0.35, 1e-12
#: Armijo's slack for the rounding error of g, relative to |g|
_SLACK = 1e-12


def _start_blocks(problem: "_BlockDual") -> torch.Tensor:
    """First U: the multipliers of the KKT condition X U X = T at the structured X = I (jax's
    start X = I/k up to scale) are the blocks T_jj; projected onto the constant-diagonal blocks
    and shifted by a multiple of I (a direction of that set) until lambda_min >= the diagonal."""
    b, k = problem.b, problem.k
    idx = torch.arange(b, device=problem.device)
    u = problem.project(problem.t.view(b, k, b, k)[idx, :, idx, :])
    diag = torch.diagonal(u, dim1=1, dim2=2).mean(1)
    shift = (diag - torch.linalg.eigvalsh(u)[:, 0]).clamp_min(0.0)
    return u + shift[:, None, None] * problem.eye


def _optimize_blocks(
    rounds: int,
    k: int,
    b: int,
    workload: Workload,
    tolerance: float,
    max_steps: int,
    dev: torch.device,
    progress: Progress | None,
    started: float,
) -> tuple[DenseMechanism, OptimizationResult]:
    """optimize_dense for k > MAX_PARTICIPATIONS: maximize the concave g(U) over the PSD pattern
    blocks with constant diagonal. Newton-CG on g + mu sum_j log det U_j (a barrier method, Boyd &
    Vandenberghe Sec. 11.3; mu shrinks by _MU_DECAY per step): block-preconditioned CG (Nocedal &
    Wright Alg. 5.3) with forcing term min(1/2, sqrt(||grad|| / ||grad_0||)) (Alg. 7.1), a step
    kept inside U > 0 (fraction to the boundary) and Armijo backtracking. Every evaluated U gives
    a lower bound g(U) and a feasible structured primal; it stops when their relative gap is
    <= tolerance. The size is O(b k^2) dual variables for every k, never 2^k."""
    with _solve_threads(rounds, dev):
        problem = _BlockDual(workload.matrix(rounds), k, b, dev)
        u = _start_blocks(problem)
        point = problem.evaluate(u)
        # g(a U) = 2 sqrt(a) tr M - a sum t is maximized at sqrt(a) = tr M / sum t (Eq. 7)
        t_sum = float(torch.diagonal(u, dim1=1, dim2=2).mean(1).sum())
        point = problem.evaluate(u * (float(point.sigma.sum()) / t_sum) ** 2)
        evaluations, hvps = 2, 0
        best, dual = point, point.dual
        # barrier weight: the central point of g + mu sum_j log det U_j is within mu·n of the
        # optimum (Boyd & Vandenberghe, Sec. 11.2.2, with n = b·k the barrier's degree)
        mu = _MU_START * abs(point.dual) / problem.n
        mu_floor = _MU_FLOOR * abs(point.dual) / problem.n
        first_norm = math.nan
        message = "maximum number of steps reached"
        while True:
            rel = (best.primal - dual) / best.primal if math.isfinite(best.primal) else math.inf
            if progress is not None:
                progress.update(evaluations, best.primal / rounds, f"gap {rel:.2e}")
            if rel <= tolerance:
                message = "relative duality gap below tolerance"
                break
            if evaluations >= max_steps:
                break
            u_inv = torch.linalg.inv(point.u)
            barrier = mu * float(torch.linalg.slogdet(point.u)[1].sum())
            grad = problem.gradient(point) + mu * problem.project(u_inv)
            norm = float(grad.norm())
            first_norm = norm if math.isnan(first_norm) else first_norm
            sig = point.sigma
            kernel = sig[:, None] * sig[None, :] / (sig[:, None] + sig[None, :])
            # block preconditioner: -d^2 g ~ G dU G with G = V diag(sqrt s) V^T (K_pq <= sqrt(s_p s_q)/2,
            # AM-GM), the barrier's mu U^-1 dU U^-1 folded in; inverted per block and projected
            root = (point.basis * point.sigma.sqrt()) @ point.basis.transpose(1, 2) + math.sqrt(mu) * u_inv
            root_inv = torch.linalg.inv(root)
            step_dir, used = _pcg(
                lambda z: -problem.hessian_vector(point, kernel, z) + mu * problem.project(u_inv @ z @ u_inv),
                grad, lambda r: problem.project(root_inv @ r @ root_inv),
                min(0.5, math.sqrt(norm / first_norm)) * norm, 500)
            hvps += used
            slope = float((grad * step_dir).sum())
            step, trial, accepted = _max_step(point.u, step_dir), None, False
            while evaluations < max_steps and step > 1e-12:
                evaluations += 1
                try:
                    trial = problem.evaluate(problem.project(point.u + step * step_dir))
                except _Singular:
                    trial = None
                if trial is not None:
                    dual = max(dual, trial.dual)
                    if trial.primal < best.primal:
                        best = trial
                    value = trial.dual + mu * float(torch.linalg.slogdet(trial.u)[1].sum())
                    # Armijo, with a slack for the rounding error of g (~ eps · n · |g|)
                    if value >= point.dual + barrier + 1e-4 * step * slope - _SLACK * abs(point.dual):
                        accepted = True
                        break
                step *= 0.5
            if not accepted:
                if evaluations < max_steps:
                    message = "line search failed"
                    break
                continue
            point = trial
            mu = max(mu * _MU_DECAY, mu_floor)
        primal = best.primal
        gram = None
        if math.isfinite(primal) and dev.type == "cpu":
            x = problem.structured(best.sigma, best.basis)[0].cpu().numpy()
            gram = np.empty_like(x)
            gram[np.ix_(problem.perm, problem.perm)] = x
    if not math.isfinite(primal):
        raise ArithmeticError(f"no positive definite structured X in {evaluations} steps (raise max_steps)")
    mechanism = DenseMechanism(rounds, k, b, best.u.cpu().numpy().copy(), workload)
    if gram is not None:
        mechanism.__dict__["_solution"] = (gram, primal, best.dual)
    gap = primal - dual
    rel = gap / primal
    if rel < -1e-9:
        raise AssertionError(f"duality gap is negative ({gap}): primal {primal} < dual {dual}")
    # the structure makes the sensitivity exactly 1; the flag reports what the sensitivity code certifies
    exact = mechanism.sensitivity(FixedEpoch(k, b)).exact
    return mechanism, _result(rel <= tolerance, evaluations, primal, dual, gap, rel, rounds, tolerance, message,
                              started, hvps, dev, progress, sensitivity_exact=exact)
