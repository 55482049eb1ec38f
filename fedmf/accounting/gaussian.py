"""One Gaussian mechanism: delta(epsilon), epsilon(delta) and noise calibration.

Why one Gaussian is enough for un-amplified DP-MF ("Multi-Epoch Matrix Factorization
Mechanisms", Thm 2.2 and App. D.2): the run releases C·X + Z with Z ~ N(0, s²) entry-wise,
s = z·ζ·sens(C), where sens(C) is the sensitivity of C under the participation schema and
ζ the clip norm. One user changes C·X by at most ζ·sens(C) in Frobenius norm, even with
adaptively chosen updates, so the whole run is ONE Gaussian mechanism with sensitivity
ζ·sens(C) and noise std z·ζ·sens(C), i.e. noise multiplier exactly z. A user whose own
sensitivity s_u differs from the sensitivity the noise was scaled to has the multiplier
z·sens/s_u (larger s_u: smaller multiplier, larger epsilon).

Adjacency is add-or-remove (zero-out), dp_accounting's default. Accountants:
  * "pld" (default): the privacy loss distribution of the Gaussian, which for a single
    Gaussian is known in closed form (Balle & Wang 2018, "Improving the Gaussian
    mechanism", Thm 8; dp_accounting's ``GaussianPrivacyLoss.get_delta_for_epsilon``):
        delta(eps) = Phi(1/(2z) - eps·z) - e^eps · Phi(-1/(2z) - eps·z).
    It is exact (no discretization); dp_accounting's PLDAccountant agrees to ~1e-9.
  * "rdp": dp_accounting's RdpAccountant (looser; for comparison).
Results are cached: repeated calls with the same arguments are instant; calibrations are also
kept on disk across processes (``disk_cache``) and verified before use.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import optimize, special

from .. import checks
from ..errors import ConfigError

__all__ = ["ACCOUNTANTS", "delta_for_epsilon", "epsilon", "epsilons", "calibrate", "check_accountant", "meets"]

ACCOUNTANTS = ("pld", "rdp")


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {accountant!r} (use one of: {', '.join(ACCOUNTANTS)})")
    return accountant


def delta_for_epsilon(noise_multiplier, epsilon):
    """delta(eps) of the Gaussian mechanism with this multiplier (sensitivity 1), exact
    and vectorized (Balle & Wang 2018, Thm 8), computed as
    Phi(a)·(1 - exp(eps + log Phi(b) - log Phi(a))) to avoid cancellation."""
    z = np.asarray(noise_multiplier, dtype=np.float64)
    eps = np.asarray(epsilon, dtype=np.float64)
    a = 0.5 / z - eps * z
    b = -0.5 / z - eps * z
    log_a = special.log_ndtr(a)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.exp(log_a) * -np.expm1(np.minimum(eps + special.log_ndtr(b) - log_a, 0.0))
    out = np.where(np.isfinite(out), out, 0.0)
    return out if out.ndim else float(out)


def epsilons(noise_multipliers, delta: float) -> np.ndarray:
    """epsilon(delta) for many multipliers at once (exact Gaussian curve, vectorized
    bisection; each value is the upper end of its final bracket, so delta(eps) <= delta).
    Multipliers may be +inf (a user who never took part): epsilon 0."""
    delta = checks.open_unit("delta", delta)
    z = np.atleast_1d(np.asarray(noise_multipliers, dtype=np.float64))
    if np.any(~(z > 0)):
        raise ConfigError("noise multipliers must be positive")
    out = np.zeros(z.shape)
    live = np.isfinite(z)
    live[live] = delta_for_epsilon(z[live], 0.0) > delta  # else epsilon = 0 already suffices
    if not np.any(live):
        return out
    zl = z[live]
    # delta(eps) <= Phi(1/(2z) - eps z), so eps_hi = (1/(2z) - Phi^{-1}(delta))/z has delta(eps_hi) <= delta
    lo = np.zeros(zl.shape)
    hi = (0.5 / zl - special.ndtri(delta)) / zl
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        above = delta_for_epsilon(zl, mid) > delta
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
        if np.all(hi - lo <= 1e-13 * np.maximum(hi, 1e-300)):
            break
    out[live] = hi
    return out


@functools.lru_cache(maxsize=4096)
def _epsilon_cached(noise_multiplier: float, delta: float, accountant: str) -> float:
    if accountant == "rdp":
        import dp_accounting

        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
        return float(acc.get_epsilon(delta))
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    loss = GaussianPrivacyLoss(noise_multiplier, sensitivity=1.0)
    if loss.get_delta_for_epsilon(0.0) <= delta:
        return 0.0
    hi = float(epsilons(noise_multiplier, delta)[0])  # bracket from the vectorized curve
    lo = 0.0
    while loss.get_delta_for_epsilon(hi) > delta:  # guard: never report below the dp_accounting curve
        lo, hi = hi, 2.0 * hi + 1e-12
    root = optimize.brentq(lambda e: loss.get_delta_for_epsilon(e) - delta, lo, hi, xtol=1e-14, rtol=1e-13)
    while loss.get_delta_for_epsilon(root) > delta:
        root = root * (1 + 1e-13) + 1e-15
    return float(root)


def epsilon(noise_multiplier: float, delta: float, accountant: str = "pld") -> float:
    """epsilon at ``delta`` of one Gaussian mechanism with this noise multiplier
    (noise std / sensitivity). Cached."""
    z = checks.positive("noise multiplier", noise_multiplier)
    delta = checks.open_unit("delta", delta)
    return _epsilon_cached(z, delta, check_accountant(accountant))


#: a cached calibration is used only if it meets the target and this much less noise would not
MINIMAL_REL = 1e-6


@functools.lru_cache(maxsize=4096)
def _calibrate_cached(epsilon: float, delta: float, accountant: str) -> float:
    """The calibration, from this process's memory, else from the disk cache (``disk_cache``) once
    verified — it meets (epsilon, delta) and a multiplier ``MINIMAL_REL`` smaller would not — else
    searched and stored there."""
    from . import disk_cache

    key = {"epsilon": epsilon, "delta": delta, "accountant": accountant}
    z = disk_cache.load("gaussian-calibrate", key)
    if z is not None and z > 0 and _verified(z, epsilon, delta, accountant):
        return z
    z = _calibrate_search(epsilon, delta, accountant)
    disk_cache.store("gaussian-calibrate", key, z)
    return z


def _verified(z: float, epsilon: float, delta: float, accountant: str) -> bool:
    """Whether ``z`` is a calibration for (epsilon, delta): it meets the target, and a multiplier
    ``MINIMAL_REL`` smaller does not. For "pld" by the exact closed form ``delta_for_epsilon``
    (Balle & Wang 2018, Thm 8; no dp_accounting import, which costs more than the search). A value the
    check cannot evaluate (e.g. z = 1e300: the RDP curve overflows) is not a calibration."""
    smaller = z * (1 - MINIMAL_REL)
    try:
        with np.errstate(all="ignore"):
            if accountant == "pld":
                return bool(delta_for_epsilon(z, epsilon) <= delta < delta_for_epsilon(smaller, epsilon))
            return meets(z, epsilon, delta, accountant) and not meets(smaller, epsilon, delta, accountant)
    except (ArithmeticError, ValueError):
        return False


def _calibrate_search(epsilon: float, delta: float, accountant: str) -> float:
    if accountant == "rdp":
        import dp_accounting

        return float(
            dp_accounting.calibrate_dp_mechanism(
                dp_accounting.rdp.RdpAccountant,
                dp_accounting.GaussianDpEvent,
                epsilon,
                delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
                tol=1e-9,
            )
        )
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    def excess(log_z: float) -> float:  # log delta(eps; z) - log delta, decreasing in z
        d = GaussianPrivacyLoss(math.exp(log_z), sensitivity=1.0).get_delta_for_epsilon(epsilon)
        return math.log(max(d, 1e-320)) - math.log(delta)

    lo, hi = math.log(1e-3), math.log(1.0)
    while excess(hi) > 0:
        lo, hi = hi, hi + 2.0
    while excess(lo) < 0:
        lo, hi = lo - 2.0, lo
    log_z = optimize.brentq(excess, lo, hi, xtol=1e-15, rtol=1e-14)
    z = math.exp(log_z)
    while GaussianPrivacyLoss(z, sensitivity=1.0).get_delta_for_epsilon(epsilon) > delta:
        z *= 1 + 1e-13  # conservative side of the root
    return z


def meets(noise_multiplier: float, epsilon: float, delta: float, accountant: str = "pld") -> bool:
    """Whether the Gaussian with this multiplier is (epsilon, delta)-DP by the criterion ``calibrate``
    solves: dp_accounting's exact delta(epsilon) for "pld", the RDP epsilon for "rdp"."""
    if accountant == "rdp":
        return _epsilon_cached(noise_multiplier, delta, accountant) <= epsilon
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    return GaussianPrivacyLoss(noise_multiplier, sensitivity=1.0).get_delta_for_epsilon(epsilon) <= delta


def calibrate(epsilon: float, delta: float, accountant: str = "pld") -> float:
    """The smallest noise multiplier whose Gaussian mechanism is (epsilon, delta)-DP.
    Cached in memory and, verified on reuse, on disk (``disk_cache``)."""
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    return _calibrate_cached(epsilon, delta, check_accountant(accountant))
