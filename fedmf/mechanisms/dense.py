"""Dense (optimal multi-epoch) factorization for fixed-epoch participation FixedEpoch(k, b).

Source: Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization
Mechanisms for Private Machine Learning" (arXiv 2211.06530), Sec. 3 and App. I.

The strategy Gram matrix X = C^T C solves  min tr(T X^{-1})  s.t.  u^T X u <= 1  for every
corner u of the neighbouring set (Eq. 18, T = A^T A). For FixedEpoch(k, b) the corners are
the +-1 sign vectors on each pattern {j, j+b, ..., j+(k-1)b}, 2^(k-1) per pattern up to a
global sign. The mechanism stores the dual variables v (one per corner) and derives
    U = sum_i v_i u_i u_i^T,   X(v) = U^{-1/2} (U^{1/2} T U^{1/2})^{1/2} U^{-1/2}   (Thm 3.1),
scaled to be feasible, then a lower-triangular C by reversed Cholesky (App. I / code).

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
from ..sensitivity import _mixing, pattern_sensitivity
from ..workloads import Workload
from .base import Mechanism
from .optimize import OptimizationResult, Progress
from .streaming import Dense

__all__ = ["DenseMechanism", "optimize_dense", "corner_signs", "MAX_PARTICIPATIONS"]

#: largest k whose 2^(k-1) sign corners per pattern are enumerated; beyond it the corners are
#: generated (``_column_generation``) and the mechanism stores them explicitly
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

    def __init__(
        self, workload_matrix: np.ndarray, k: int, b: int, device: torch.device, signs: np.ndarray | None = None
    ) -> None:
        self.k, self.b, self.n = k, b, k * b
        self.device = device
        perm = pattern_major(k, b)
        a = torch.from_numpy(np.asarray(workload_matrix, dtype=np.float64)[:, perm]).to(device, _DTYPE)
        self.t = a.T @ a  # T = A^T A (Sec. 3, Eq. 6), rows and columns in the working order
        self.signs = torch.from_numpy(corner_signs(k) if signs is None else np.array(signs, np.float64)).to(
            device, _DTYPE
        )
        self.perm = perm
        self.generated = signs is not None  # explicit (column-generated) corners, k > MAX_PARTICIPATIONS
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
        b, k, n = self.b, self.k, self.n
        if not bool(torch.all(torch.isfinite(v))):
            raise _Singular("non-finite dual variables")
        try:
            w, q = torch.linalg.eigh(self.blocks(v))
        except torch.linalg.LinAlgError as exc:
            raise _Singular(str(exc)) from None
        if not bool(torch.all(w > 0)):
            raise _Singular("U is singular")
        root = (q * w.sqrt().unsqueeze(1)) @ q.transpose(1, 2)  # U^{1/2}, block-diagonal
        inv_root = (q / w.sqrt().unsqueeze(1)) @ q.transpose(1, 2)  # U^{-1/2}
        left = (root @ self.t.view(b, k, n)).reshape(n, n)  # U^{1/2} T
        inner = (root @ left.T.reshape(b, k, n)).reshape(n, n)  # U^{1/2} T U^{1/2}
        try:
            lam, vec = _eigh(0.5 * (inner + inner.T), self.scipy_eigh)
        except (torch.linalg.LinAlgError, np.linalg.LinAlgError, ValueError) as exc:
            raise _Singular(str(exc)) from None
        if not bool(torch.all(torch.isfinite(lam))) or float(lam[0]) <= 0.0:
            raise _Singular("U^{1/2} T U^{1/2} is not positive definite")
        sigma = lam.sqrt()
        basis = inv_root @ vec.reshape(b, k, n)  # V = U^{-1/2} Q
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
        if self.generated:  # many corners of a large k: p_i o p_i directly, O(m n^2) per pattern
            out = []
            for j in range(self.b):
                pp = (self.signs @ point.basis[j]) ** 2  # (m, n)
                out.append(-((pp @ kernel) * pp).sum(1))
            return torch.stack(out)
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

    ``duals[j, s]`` is the multiplier of corner s (row s of ``corner_signs(k)``, or of ``signs``
    when given) on pattern {j, j+b, ...}. C is derived deterministically (on CPU) from them.

    For k > MAX_PARTICIPATIONS the corners are not enumerated: ``signs`` (m, k) holds the ones
    column generation kept (s_0 = +1), shared by every pattern. X(v) is then scaled by the
    certified upper bound on its sensitivity (``pattern_sensitivity`` per pattern), so X is
    feasible for every corner, not only the stored ones.
    """

    kind = "dense"
    rounds: int
    max_participations: int
    min_sep: int
    duals: np.ndarray
    workload: Workload = Workload()
    signs: np.ndarray | None = None

    def __post_init__(self) -> None:
        k, b = _check_schema(self.rounds, FixedEpoch(self.max_participations, self.min_sep))
        if self.signs is None:
            if k > MAX_PARTICIPATIONS:
                raise ValueError(f"dense duals for k={k} > {MAX_PARTICIPATIONS} need their sign corners (signs)")
            corners = corner_signs(k)
        else:
            signs = np.array(self.signs, dtype=np.float64)
            if signs.ndim != 2 or signs.shape[1] != k or signs.shape[0] < 1:
                raise ValueError(f"dense signs must have shape (m, k={k}), got {signs.shape}")
            if not np.all(np.abs(signs) == 1.0) or not np.all(signs[:, 0] == 1.0):
                raise ValueError("dense signs must be +-1 vectors with first entry +1")
            signs.setflags(write=False)
            object.__setattr__(self, "signs", signs)
            corners = signs
        duals = np.array(self.duals, dtype=np.float64)
        if duals.shape != (b, corners.shape[0]):
            raise ValueError(
                f"dense duals must have shape (b, corners) = {(b, corners.shape[0])} (2^(k-1) corners "
                f"unless signs are given), got {duals.shape}"
            )
        if not np.all(np.isfinite(duals)) or np.any(duals < 0):
            raise ValueError("dense duals must be finite and non-negative")
        if not np.all(np.linalg.eigvalsh(np.einsum("jm,ma,mc->jac", duals, *(corners,) * 2)) > 0):
            raise ValueError("dense duals must span every pattern (U = sum v_i u_i u_i^T positive definite)")
        duals.setflags(write=False)
        object.__setattr__(self, "duals", duals)

    @property
    def schema(self) -> FixedEpoch:
        return FixedEpoch(self.max_participations, self.min_sep)

    def params(self) -> dict[str, Any]:
        out = {"max_participations": self.max_participations, "min_sep": self.min_sep, "duals": self.duals.tolist()}
        if self.signs is not None:
            out["signs"] = self.signs.astype(int).tolist()
        return out

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> "DenseMechanism":
        return cls(
            rounds,
            int(params["max_participations"]),
            int(params["min_sep"]),
            np.asarray(params["duals"], dtype=np.float64),
            workload,
            None if params.get("signs") is None else np.asarray(params["signs"], dtype=np.float64),
        )

    @cached_property
    def _solution(self) -> tuple[np.ndarray, float, float]:
        """(feasible X, primal value tr(T X^{-1}), dual value g(v)) from the stored duals."""
        cpu = torch.device("cpu")
        with _solve_threads(self.rounds, cpu):
            problem = _Dual(self.workload.matrix(self.rounds), self.max_participations, self.min_sep, cpu, self.signs)
            try:
                point = problem.evaluate(torch.from_numpy(self.duals.copy()))
            except _Singular as exc:
                raise ValueError(f"dense duals give no positive definite X(v): {exc}") from None
            if self.signs is None:
                return problem.gram(point), point.primal, point.dual
            scale = _certified_scale(problem, point)[0]
            return problem.gram(point, scale), scale * point.trace_m, point.dual

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
        """g(v): a lower bound on the loss·n of any factorization under FixedEpoch(k, b)."""
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
        return _optimize_generated(rounds, k, b, workload, tolerance, max_steps, dev, progress, started)
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


# ---- many participations: column generation over the sign corners -------------------------
def _initial_signs(k: int) -> np.ndarray:
    """All-ones (the worst corner when X >= 0 on a pattern, Cor. 2.1) and the k - 1 single
    flips 1 - 2 e_i: k independent corners, so U = sum v_i u_i u_i^T is positive definite."""
    signs = np.ones((k, k))
    signs[np.arange(1, k), np.arange(1, k)] = -1.0
    return signs


def _certified_scale(problem: _Dual, point: _Point) -> tuple[float, bool, list[tuple[np.ndarray, float]]]:
    """(s, exact, worst): s >= max over all patterns and all sign vectors u of u^T X(v) u, a
    certified upper bound (``pattern_sensitivity``: exact, or the SDP dual bound), so X(v)/s is
    feasible for every corner; exact when every pattern's value is certified. ``worst`` is each
    pattern's best sign vector found and its value u^T X(v) u (the separation oracle)."""
    scale, exact, worst = point.violation, True, []
    for block in problem.pattern_blocks(point):
        sens = pattern_sensitivity(block)
        scale = max(scale, sens.value**2)
        exact = exact and sens.exact
        worst.append(block)
    return scale, exact, worst


#: separation enumerates every sign vector up to this k (2^(k-1) = 32768 rows), else searches
_SEPARATE_ENUMERATION = 16


def _violated_signs(x: np.ndarray, threshold: float, limit: int) -> list[np.ndarray]:
    """Up to ``limit`` distinct sign vectors u (u_0 = +1) with u^T X u > threshold, largest first:
    all of them for k <= 16, else local maxima (single flips, Goemans-Williamson style) from
    hyperplane roundings of the mixing method's SDP solution and from random signs."""
    k = x.shape[0]
    if k <= _SEPARATE_ENUMERATION:
        cand = corner_signs(k)
    else:
        rng = np.random.default_rng(0)
        v = _mixing(x)[0]
        cand = np.vstack([np.sign(v @ rng.normal(size=(k, 256))).T, np.sign(rng.normal(size=(256, k)))])
        cand[cand == 0] = 1.0
        diag = np.diag(x)
        for _ in range(4 * k):  # flipping u_i changes u^T X u by -4 u_i (sum_{j != i} X_ij u_j)
            gain = -4.0 * cand * (cand @ x - diag * cand)
            best = np.argmax(gain, axis=1)
            rows = np.nonzero(gain[np.arange(len(cand)), best] > 1e-12 * np.abs(x).max())[0]
            if rows.size == 0:
                break
            cand[rows, best[rows]] *= -1.0
        cand = np.unique(cand * cand[:, :1], axis=0)
    values = np.sum((cand @ x) * cand, axis=1)
    order = np.argsort(-values, kind="stable")
    return [cand[i] for i in order[:limit] if values[i] > threshold]


def _optimize_generated(
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
    """optimize_dense for k > MAX_PARTICIPATIONS: the dual over a growing set of corners shared by
    the patterns (column / constraint generation). Each round maximizes the restricted dual (its
    value lower-bounds the full problem: fewer constraints), then asks every pattern for its most
    violated sign vector (``worst_sign_vector``) and adds those above the restricted maximum.
    The primal is X(v) scaled by its certified sensitivity bound over all corners, so the gap
    primal - dual is a true duality gap; it stops when that is <= tolerance (relative)."""
    a = workload.matrix(rounds)
    signs = _initial_signs(k)
    inner = tolerance / 2.0
    start: torch.Tensor | None = None
    best: tuple[float, _Point, np.ndarray, bool, _Dual] | None = None
    dual, evaluations, hvps, generations = -math.inf, 0, 0, 0
    with _solve_threads(rounds, dev):
        while True:
            generations += 1
            problem = _Dual(a, k, b, dev, signs)
            gap_now = math.inf if best is None else (best[0] - dual) / best[0]
            tracker, used, inner_message = _trust_region(
                problem, max(inner, min(0.05 * gap_now, 1e-2)), max_steps, progress, start, evaluations
            )
            evaluations, hvps = tracker.evaluations, hvps + used
            dual = max(dual, tracker.dual)
            point = tracker.best
            scale, exact, worst = _certified_scale(problem, point)
            primal = scale * point.trace_m
            if best is None or primal < best[0]:
                best = (primal, point, signs, exact, problem)
            if (best[0] - dual) / best[0] <= tolerance:
                message = "relative duality gap below tolerance"
                break
            if evaluations >= max_steps:
                message = "maximum number of steps reached"
                break
            known = {tuple(row) for row in signs}
            new = []
            for block in worst:
                for u in _violated_signs(block, point.violation * (1.0 + 1e-9), 4 * k):
                    if tuple(u) not in known:
                        known.add(tuple(u))
                        new.append(u)
            if not new:
                message = (
                    f"no violated corner found ({inner_message}); "
                    + ("" if exact else "the sensitivity bound is not certified tight")
                )
                break
            v = point.v
            fill = v.mean(dim=1, keepdim=True).expand(-1, len(new))
            start = torch.cat([v, fill], dim=1)
            signs = np.vstack([signs, np.array(new)])
        primal, point, signs, exact, problem = best
        scale = primal / point.trace_m
        gram = problem.gram(point, scale) if dev.type == "cpu" else None
    mechanism = DenseMechanism(rounds, k, b, point.v.cpu().numpy().copy(), workload, signs.copy())
    if gram is not None:
        mechanism.__dict__["_solution"] = (gram, primal, point.dual)
    gap = primal - dual
    rel = gap / primal
    if rel < -1e-9:
        raise AssertionError(f"duality gap is negative ({gap}): primal {primal} < dual {dual}")
    converged = rel <= tolerance
    return mechanism, _result(converged, evaluations, primal, dual, gap, rel, rounds, tolerance, message, started,
                              hvps, dev, progress, corners=int(signs.shape[0]), generation_rounds=generations,
                              sensitivity_exact=exact)
