"""Estimate-Verify-Release: a real (epsilon, delta) guarantee from Monte Carlo accounting.

Source: Dong & Ganesh, arXiv 2602.09338, App. A (Alg. 5, Thm A.1), after Wang et al.,
"A randomized approach to tight privacy accounting" (NeurIPS 2023).

Candidates M_1, …, M_k are ordered by privacy (here: the same b-min-sep DP-MF run with
noise sigma_1 < … < sigma_{k-1}, and M_k an analytically accounted fallback). Each M_i,
i < k, is verified with fresh, independent Monte Carlo samples: v_i = 1 iff the estimated
delta at epsilon is <= delta' (= base delta) in BOTH divergence directions. The released
mechanism is M_{i*}, i* = min{i : v_j = 1 for all j >= i}, so only the candidates from the
top down to the first failure need verifying. If every M_i that is not (eps, tau·delta')-DP
passes with probability <= q and M_k is (eps, tau·delta')-DP, the whole procedure is
(eps, tau·delta' + q·(1 - tau·delta'))-DP (Thm A.1), for any tau >= 1.

q is the Chernoff bound for an average of s i.i.d. [0, 1]-valued samples (Fact 4.2 of
Chua et al., arXiv 2412.16802): Pr[mean <= delta' | true mean > tau·delta']
<= exp(-s·KL(delta' || tau·delta')), KL the Bernoulli divergence. The two directions may
share their Gaussian draws: a candidate that is not DP fails in one fixed direction, and
that direction's estimator alone passes with probability <= q.

The grid is built before any verification sample is drawn, from an independent pilot
run (a data-independent choice, so Thm A.1 holds conditionally on it).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import optimize
from scipy.special import rel_entr

from .. import checks
from ..errors import ConfigError
from .montecarlo import MonteCarloAccountant

__all__ = ["failure_probability", "overall_delta", "base_delta", "minimum_samples", "Verification", "EvrResult",
           "calibrate"]


def _kl(a: float, b: float) -> float:
    return float(rel_entr(a, b) + rel_entr(1.0 - a, 1.0 - b))


def failure_probability(samples: int, base_delta: float, delta: float) -> float:
    """Bound on Pr[estimate <= base_delta] when the true delta is >= ``delta`` > base_delta
    (Fact 4.2 of arXiv 2412.16802)."""
    if delta <= base_delta:
        return 1.0
    return math.exp(-samples * _kl(base_delta, min(delta, 1.0)))


def _overall(samples: int, base: float, log_tau: float) -> float:
    tau_delta = min(base * math.exp(log_tau), 1.0)
    return tau_delta + failure_probability(samples, base, tau_delta) * (1.0 - tau_delta)


def overall_delta(samples: int, base_delta: float) -> float:
    """delta of the whole EVR procedure when every candidate is verified at ``base_delta``
    with ``samples`` samples: min over tau >= 1 of tau·delta' + q·(1 - tau·delta') (Thm A.1).
    Any tau gives a valid bound; the minimum is searched on a grid, then refined."""
    samples = checks.positive_int("samples", samples)
    base = checks.number("base delta", base_delta)
    if not 0.0 < base < 1.0:
        raise ConfigError(f"base delta must lie in (0, 1), got {base_delta!r}")
    top = math.log(1.0 / base)
    grid = np.linspace(0.0, top, 257)
    values = [_overall(samples, base, t) for t in grid]
    j = int(np.argmin(values))
    lo, hi = grid[max(j - 1, 0)], grid[min(j + 1, grid.size - 1)]
    res = optimize.minimize_scalar(lambda t: _overall(samples, base, t), bounds=(lo, hi), method="bounded",
                                   options={"xatol": 1e-10})
    return float(min(values[j], _overall(samples, base, float(res.x)), 1.0))


def minimum_samples(target_delta: float, base_delta: float | None = None) -> int:
    """The fewest samples per candidate for which overall_delta(s, base) <= target
    (base = target/2 by default, as in the paper)."""
    target = checks.open_unit("target delta", target_delta)
    base = target / 2.0 if base_delta is None else checks.open_unit("base delta", base_delta)
    if base >= target:
        raise ConfigError(f"base delta {base:g} must be smaller than the target delta {target:g}")
    lo = max(1, int(1.0 / target))
    hi = 2 * lo
    while overall_delta(hi, base) > target:
        lo, hi = hi, 2 * hi
        if hi > 1 << 62:
            raise ConfigError("no feasible sample count for this base delta")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if overall_delta(mid, base) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def base_delta(samples: int, target_delta: float) -> float:
    """The largest base delta (within 1e-6 relative) with overall_delta(samples, base) <= target."""
    samples = checks.positive_int("samples", samples)
    target = checks.open_unit("target delta", target_delta)
    lo, hi = 0.0, target
    if overall_delta(samples, target * 1e-6) > target:
        raise ConfigError(f"{samples} samples are too few to certify delta={target:g}; "
                         f"at least {minimum_samples(target)} are needed")
    lo = target * 1e-6
    while hi - lo > 1e-6 * lo:
        mid = 0.5 * (lo + hi)
        if overall_delta(samples, mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Verification:
    noise_multiplier: float
    delta_positive: float
    delta_negative: float
    passed: bool
    samples: int
    key: tuple
    seconds: float


@dataclass
class EvrResult:
    """Outcome of EVR calibration. ``noise_multiplier`` (noise std in clip-norm units) is
    the one to run with; the procedure as a whole is (epsilon, overall_delta)-DP."""

    noise_multiplier: float
    epsilon: float
    delta: float
    base_delta: float
    overall_delta: float
    samples: int
    verified: bool  # False: the analytic fallback was chosen
    fallback_noise_multiplier: float
    candidates: list[float]
    verifications: list[Verification]
    pilot: dict = field(default_factory=dict)
    seed: int | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verifications"] = [asdict(v) | {"key": list(v.key)} for v in self.verifications]
        return out


def _pilot(accountant: MonteCarloAccountant, epsilon: float, target: float, start: float, upper: float,
           samples: int, seed: int, rtol: float, max_iterations: int = 8) -> tuple[float, list[dict]]:
    """sigma with estimated epsilon(target) ~= epsilon: secant steps on (log sigma,
    log epsilon) with a bracket, fresh pilot samples per step (stream key (0, step))."""
    history: list[dict] = []
    lo, hi = None, None  # sigma with eps_hat > epsilon (too little noise) / <= epsilon
    sigma = start
    points: list[tuple[float, float]] = []
    for step in range(max_iterations):
        result = accountant.losses(sigma, samples, seed, key=(0, step))
        eps_hat = result.epsilon(target)
        history.append({"noise_multiplier": sigma, "epsilon": eps_hat, "samples": samples,
                        "seconds": round(result.seconds, 3)})
        if eps_hat > epsilon:
            lo = sigma if lo is None else max(lo, sigma)
        else:
            hi = sigma if hi is None else min(hi, sigma)
        points.append((math.log(sigma), math.log(max(eps_hat, 1e-12))))
        if len(points) >= 2 and points[-1][1] != points[-2][1]:
            slope = (points[-1][1] - points[-2][1]) / (points[-1][0] - points[-2][0])
            slope = min(-0.2, max(slope, -5.0))
        else:
            slope = -1.0  # epsilon roughly ~ 1/sigma
        new = math.exp(points[-1][0] + (math.log(epsilon) - points[-1][1]) / slope)
        if lo is not None and hi is not None:
            new = min(max(new, lo * (1 + rtol)), hi)  # stay inside the bracket
            if hi / lo <= 1 + rtol:
                new = hi
        new = min(new, upper)
        if abs(math.log(new / sigma)) <= rtol:
            return new, history
        sigma = new
    return (hi if hi is not None else sigma), history


def calibrate(accountant: MonteCarloAccountant, epsilon: float, delta: float, fallback_noise_multiplier: float, *,
              samples: int | None = None, base: float | None = None, candidates: int = 3, ratio: float = 1.01,
              pilot_samples: int | None = None, seed: int | None = None, margin: float = 0.7) -> EvrResult:
    """EVR noise calibration for a b-min-sep scheme (Alg. 5 of arXiv 2602.09338).

    ``fallback_noise_multiplier`` must make the same run (epsilon, base)-DP analytically
    (e.g. un-amplified DP-MF: the Gaussian multiplier for (epsilon, base) times the
    schema sensitivity). The pilot looks for sigma_hat whose estimated delta at epsilon is
    ``margin``·base; candidates are sigma_hat·ratio^j, j = -1 … candidates-2, below the
    fallback; they are verified from the most private down to the first failure."""
    started = time.perf_counter()
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    fallback = checks.positive("fallback noise multiplier", fallback_noise_multiplier)
    base = delta / 2.0 if base is None else checks.open_unit("base delta", base)
    if samples is None:
        samples = minimum_samples(delta, base)
    samples = checks.positive_int("samples", samples)
    overall = overall_delta(samples, base)
    if overall > delta:
        raise ConfigError(f"{samples} samples per candidate certify only delta={overall:.3g} > {delta:g}; "
                         f"use at least {minimum_samples(delta, base)}")
    candidates = checks.positive_int("candidates", candidates)
    if not ratio > 1.0:
        raise ConfigError(f"grid ratio must exceed 1, got {ratio!r}")
    entropy = np.random.SeedSequence().entropy if seed is None else int(seed)
    pilot_samples = pilot_samples or max(10_000, samples // 4)
    sigma_hat, history = _pilot(accountant, epsilon, margin * base, fallback / 2.0, fallback, pilot_samples, entropy,
                                rtol=math.log(ratio) / 2)
    grid = [sigma_hat * ratio**j for j in range(-1, candidates - 1)]
    grid = [s for s in grid if s < fallback]
    verifications: list[Verification] = []
    chosen, verified = fallback, False
    for j in range(len(grid) - 1, -1, -1):  # most private first
        result = accountant.losses(grid[j], samples, entropy, key=(1, j), epsilons=(epsilon,))
        dp, dn = result.exact[epsilon]
        ok = dp <= base and dn <= base
        verifications.append(Verification(grid[j], dp, dn, ok, samples, (1, j), round(result.seconds, 3)))
        if not ok:
            break
        chosen, verified = grid[j], True
    return EvrResult(chosen, epsilon, delta, base, overall, samples, verified, fallback, grid, verifications,
                     {"samples": pilot_samples, "target_delta": margin * base, "steps": history,
                      "noise_multiplier": sigma_hat}, entropy, time.perf_counter() - started)
