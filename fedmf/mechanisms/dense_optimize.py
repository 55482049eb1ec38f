"""The solvers of the dense (optimal multi-epoch) mechanism: the duals of ``DenseMechanism``
that maximize the Lagrange dual g of Eq. 18 for FixedEpoch(k, b).

Source: Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization
Mechanisms for Private Machine Learning" (arXiv 2211.06530), Sec. 3 and App. I; the dual
problems (g, X(v), their derivatives) are in ``dense``. For k <= MAX_PARTICIPATIONS,
trust-region Newton-CG over the corner duals (Nocedal & Wright, Alg. 4.1, Steihaug's CG); beyond
it, a barrier Newton-CG over the PSD pattern blocks (Boyd & Vandenberghe Sec. 11.3, Nocedal &
Wright Alg. 5.3). Every evaluated point gives a lower bound and a feasible primal; both stop at a
relative duality gap <= tolerance.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from .. import checks
from ..participation import FixedEpoch, Schema
from ..workloads import Workload
from .dense import (
    _DTYPE,
    MAX_PARTICIPATIONS,
    DenseMechanism,
    _BlockDual,
    _check_schema,
    _Dual,
    _Point,
    _Singular,
    _solve_threads,
)
from .optimize import OptimizationResult, ProgressCallback, Step

__all__ = ["optimize_dense", "make"]


def _device(device: str | None) -> torch.device:
    """The solve's device: ``device``, else CUDA when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ---- the corner dual: trust-region Newton-CG ---------------------------------------------
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


def optimize_dense(
    rounds: int,
    schema: FixedEpoch,
    workload: Workload = Workload(),
    *,
    tolerance: float = 1e-3,
    max_steps: int = 10000,
    device: str | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[DenseMechanism, OptimizationResult]:
    """The loss-optimal factorization for FixedEpoch(k, b) by maximizing the dual g(v).

    Trust-region Newton-CG on theta = log v. A step costs one n x n eigh (the point), a
    diagonal Hessian (about four n x n matmuls) and Hessian-vector products (two each).
    Stops when the relative duality gap (primal of the feasible-scaled X(v) minus the best
    dual, over the primal) is <= tolerance; ``steps`` counts evaluated points.
    """
    k, b = _check_schema(rounds, schema)
    checks.positive("tolerance", tolerance)
    checks.positive_int("max_steps", max_steps)
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
    """The optimizer's report (values per round); reports the final step to ``progress``."""
    if progress is not None:
        progress(Step(steps, None, primal / rounds, rel, tolerance, final=True, converged=converged))
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
    progress: ProgressCallback | None,
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
            # the convergence measure: the relative duality gap
            progress(Step(tracker.evaluations, max_steps, tracker.best.primal / problem.n, tracker.relative_gap,
                          tolerance))
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


# ---- many participations: the block dual, barrier Newton-CG -----------------------------
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


def _start_blocks(problem: _BlockDual) -> torch.Tensor:
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
    progress: ProgressCallback | None,
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
                progress(Step(evaluations, max_steps, best.primal / rounds, rel, tolerance))
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
                lambda z: -problem.hessian_vector(point, kernel, z) + mu * problem.project(u_inv @ z @ u_inv),  # noqa: B023 (_pcg calls it within this iteration)
                grad, lambda r: problem.project(root_inv @ r @ root_inv),  # noqa: B023 (_pcg calls it within this iteration)
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


def make(rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
         **options: Any) -> tuple[DenseMechanism, OptimizationResult]:
    """``fedmf.mechanisms.plan``'s maker of this kind (the class cannot name its solver: the solver
    imports it): ``optimize_dense``."""
    return optimize_dense(rounds, schema, workload, **options)
