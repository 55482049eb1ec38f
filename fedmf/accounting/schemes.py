"""How each sampling scheme is accounted: ε, calibration and the per-round curve, read from the
scheme's description (``fedmf.sampling``) as dp_accounting's accountants read a DpEvent.

One entry per scheme in ``ACCOUNTANTS`` (``SchemeAccountant``); the functions below dispatch on the
scheme's type and call the interpreters (``gaussian``, ``cyclic_poisson``, ``mmcc``, the b-min-sep
Monte Carlo accountant and ``evr``, ``per_round``, ``count_release``):

* ``none``: un-amplified DP-MF, one Gaussian mechanism with sensitivity sens_schema
  ("Multi-Epoch MF", Thm 2.2 / App. D.2);
* ``bminsep:P[:warm]``: the Monte Carlo accountant of arXiv 2602.09338: for ``epsilon`` an
  MC-verified ε, for ``calibrate`` Estimate-Verify-Release with the un-amplified mechanism as
  analytic fallback; no per-round curve (the accountant covers the whole run only);
* ``cyclic-poisson:Q``: ceil(n/b) Poisson(Q)-subsampled Gaussians with multiplier
  z·sens/max_j ||C e_j|| ("(Amplified) Banded MF"; "Scaling up BandMF" Prop. 2.1); after t
  rounds, ceil(t/b) of them;
* ``poisson:P``: MMCC (Thm 4.3 of arXiv 2310.15526) with PLD; no calibration yet and no per-round
  curve in a plan (``epsilon_by_round`` gives the un-amplified curve, an upper bound).

The entry points with their common checks are ``accounting.accountant``; the noise convention is
documented there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..sampling import BMinSepSampling, CyclicPoissonSampling, NoSampling, PlainPoissonSampling, Sampling
from . import count_release, cyclic_poisson, evr, gaussian, mmcc
from .bminsep import BMinSep
from .montecarlo import MonteCarloAccountant
from .per_round import ByRound, cyclic_poisson_curve, unamplified_curve

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema
    from ..sensitivity import Sensitivity
    from .accountant import MonteCarloOptions
    from .releases import ExtraReleases

__all__ = [
    "SchemeAccountant", "ACCOUNTANTS", "Result", "epsilon", "calibrate", "epsilon_by_round", "check_delta",
    "check_calibrate", "check_releases", "has_per_round_curve", "check_banded", "max_column_norm",
    "MAX_MONTE_CARLO_SAMPLES",
]

#: (epsilon, accountant name, guarantee, details): what a scheme's accounting adds to an ``Accounting``
Result = tuple[float, str, str, dict[str, Any]]


def _accepts(*_: Any) -> None:
    """No refusal."""


def _refuses_releases(sampling: Sampling, releases: ExtraReleases | None) -> None:
    what = "adaptive clipping's count release" if releases is None else releases.what()
    raise ConfigError(f"{what} is accounted with sampling none (un-amplified) or cyclic-poisson:Q only, not {sampling}")


@dataclass(frozen=True)
class SchemeAccountant:
    """How the accountants read one scheme. ``epsilon`` / ``calibrate`` / ``epsilon_by_round`` take the
    scheme, then the arguments of the module's functions of the same names."""

    epsilon: Callable[..., Result]
    calibrate: Callable[..., Result]
    #: ε after each round (where ``has_per_round_curve`` is False: an upper bound, or a ConfigError)
    epsilon_by_round: Callable[..., ByRound]
    #: whether the accountants give ε after each round (else every round is charged the whole run's ε)
    has_per_round_curve: bool
    #: refuses up front a delta the accountant cannot certify in bounded time
    check_delta: Callable[[Sampling, float], None] = _accepts
    #: refuses calibration where the scheme has no calibrator
    check_calibrate: Callable[[Sampling], None] = _accepts
    #: refuses the round's extra Gaussian releases (``releases``) where the accountant does not compose them
    check_releases: Callable[[Sampling, ExtraReleases | None], None] = _refuses_releases


def _entry(sampling: Sampling) -> SchemeAccountant:
    return ACCOUNTANTS[type(sampling)]


def epsilon(sampling: Sampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity, *,
            noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
            noise_sensitivity: float | None, monte_carlo: MonteCarloOptions,
            count_noise_std: float | None = None) -> Result:
    """ε at ``delta`` of the run whose noise std is ``std_per_clip`` clip norms."""
    return _entry(sampling).epsilon(sampling, mechanism, schema, sens, noise_multiplier=noise_multiplier,
                                    std_per_clip=std_per_clip, delta=delta, accountant=accountant,
                                    noise_sensitivity=noise_sensitivity, monte_carlo=monte_carlo,
                                    count_noise_std=count_noise_std)


def calibrate(sampling: Sampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity, *,
              epsilon: float, delta: float, accountant: str, monte_carlo: MonteCarloOptions,
              count_noise_std: float | None = None) -> Result:
    """The smallest noise multiplier (first item) whose run is (epsilon, delta)-DP."""
    return _entry(sampling).calibrate(sampling, mechanism, schema, sens, epsilon=epsilon, delta=delta,
                                      accountant=accountant, monte_carlo=monte_carlo,
                                      count_noise_std=count_noise_std)


def epsilon_by_round(sampling: Sampling, mechanism: Mechanism, schema: Schema, planned: Sensitivity, *,
                     noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                     noise_sensitivity: float | None, final: float | None, max_points: int,
                     count_noise_std: float | None = None) -> ByRound:
    """ε after each round."""
    return _entry(sampling).epsilon_by_round(
        sampling, mechanism, schema, planned, noise_multiplier=noise_multiplier, std_per_clip=std_per_clip,
        delta=delta, accountant=accountant, noise_sensitivity=noise_sensitivity, final=final,
        max_points=max_points, count_noise_std=count_noise_std)


def has_per_round_curve(sampling: Sampling) -> bool:
    """Whether the accountants give ε after each round of a run sampled by ``sampling``."""
    return _entry(sampling).has_per_round_curve


def check_delta(sampling: Sampling, delta: float) -> None:
    """Refuse up front a delta the scheme's accountant cannot certify in bounded time."""
    _entry(sampling).check_delta(sampling, delta)


def check_calibrate(sampling: Sampling) -> None:
    """Refuse calibration where the scheme has no calibrator."""
    _entry(sampling).check_calibrate(sampling)


def check_releases(sampling: Sampling, releases: ExtraReleases | None = None) -> None:
    """Refuse a sampler whose accountant does not compose the count release (or ``releases``: the
    round's extra Gaussian releases, ``fedmf.accounting.releases``)."""
    _entry(sampling).check_releases(sampling, releases)


def check_banded(mechanism: Mechanism, min_sep: int, what: str) -> int:
    """The bands of C, which amplification (``what``) needs square and banded with <= min_sep bands."""
    bands = mechanism.strategy_bands
    if bands is None:
        raise ConfigError(f"{what} amplification needs a banded strategy C; {mechanism.kind} is not banded")
    if bands > min_sep:
        raise ConfigError(f"{what} amplification needs bands <= min_sep, got {bands} bands > b={min_sep}")
    if mechanism.noise_rows != mechanism.rounds:
        raise ConfigError(f"{what} amplification needs a square strategy C ({mechanism.kind} is not)")
    return bands


def max_column_norm(mechanism: Mechanism) -> float:
    """max_j ||C e_j||: the per-participation sensitivity of one amplified step."""
    return float(math.sqrt(max(mechanism.column_norms_sq())))


# ---- none: the Gaussian mechanism ------------------------------------------------------------
def _gaussian_guarantee(accountant: str, exact: bool) -> str:
    """The guarantee of the un-amplified (Gaussian) ε."""
    if accountant == "rdp":
        return "upper bound (RDP)"
    return "exact (Gaussian privacy loss distribution)" if exact else "upper bound (sensitivity bound)"


def _none_epsilon(sampling: NoSampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity, *,
                  noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                  noise_sensitivity: float | None, monte_carlo: MonteCarloOptions,
                  count_noise_std: float | None = None) -> Result:
    """The Gaussian mechanism's ε at multiplier z·sens/sens_schema (= z when the noise was scaled for it)."""
    z_eff = noise_multiplier if noise_sensitivity is None else std_per_clip / sens.value
    more: dict[str, Any] = {}
    if count_noise_std is not None:
        # the MF Gaussian composed with k count releases: 1/z² = 1/z_mf² + k/σ_b² (count_release (1))
        k = count_release.participations(schema, mechanism.rounds)
        more = {"count_noise_std": count_noise_std, "count_participations": k,
                "mf_noise_multiplier": z_eff,
                "privacy_split": count_release.privacy_split(z_eff, count_noise_std, k)}
        z_eff = count_release.compose(z_eff, count_noise_std, k)
    eps = gaussian.epsilon(z_eff, delta, accountant)
    return (eps, f"gaussian-{accountant}", _gaussian_guarantee(accountant, sens.exact),
            {"effective_noise_multiplier": z_eff, **more})


def _none_calibrate(sampling: NoSampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity, *,
                    epsilon: float, delta: float, accountant: str, monte_carlo: MonteCarloOptions,
                    count_noise_std: float | None = None) -> Result:
    z = gaussian.calibrate(epsilon, delta, accountant)
    if count_noise_std is None:
        return z, f"gaussian-{accountant}", _gaussian_guarantee(accountant, sens.exact), {}
    k = count_release.participations(schema, mechanism.rounds)
    total = z
    z = count_release.mf_multiplier(total, count_noise_std, k)  # solve (1) for z_mf at the calibrated total
    while not gaussian.meets(count_release.compose(z, count_noise_std, k), epsilon, delta, accountant):
        z *= 1 + 1e-13  # the conservative side of the rounding, by calibrate's own criterion
    return z, f"gaussian-{accountant}", _gaussian_guarantee(accountant, sens.exact), {
        "count_noise_std": count_noise_std, "count_participations": k, "effective_noise_multiplier": total,
        "privacy_split": count_release.privacy_split(z, count_noise_std, k)}


def _unamplified_curve(sampling: Sampling, mechanism: Mechanism, schema: Schema, planned: Sensitivity, *,
                       noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                       noise_sensitivity: float | None, final: float | None, max_points: int,
                       count_noise_std: float | None = None) -> ByRound:
    """ε after each round: the un-amplified curve of ``per_round``."""
    return unamplified_curve(mechanism, schema, planned, noise_multiplier=noise_multiplier,
                             std_per_clip=std_per_clip, delta=delta, accountant=accountant,
                             noise_sensitivity=noise_sensitivity, final=final, max_points=max_points,
                             count_noise_std=count_noise_std)


# ---- bminsep: Monte Carlo, Estimate-Verify-Release ---------------------------------------------
#: the most samples the b-min-sep Monte Carlo accountant is asked to draw per verification: it certifies
#: delta only with more than 1/delta samples (EVR, Thm A.1 of arXiv 2602.09338), so delta below ~1/this is
#: refused up front instead of running for hours
MAX_MONTE_CARLO_SAMPLES = 1 << 31


def _mc_refusal(delta: float, needed: str) -> str:
    return (f"delta={delta:g} is too small for bminsep Monte Carlo accounting ({needed} samples needed, at most "
            f"{MAX_MONTE_CARLO_SAMPLES}): use cyclic-poisson:Q (PLD) or sampling none (un-amplified) for this delta")


def _bminsep_accountant(sampling: BMinSepSampling, mechanism: Mechanism, schema: Schema,
                        options: MonteCarloOptions) -> MonteCarloAccountant:
    b = sampling.min_sep_of(schema)
    check_banded(mechanism, b, "b-min-sep")
    scheme = BMinSep.from_mechanism(mechanism, b, sampling.probability, sampling.warm_start)  # ConfigError: e.g. C < 0
    return MonteCarloAccountant(scheme, workers=options.workers, chunk_size=options.chunk_size, keep=options.keep)


def _minimum_samples(delta: float) -> int:
    """The fewest samples that certify ``delta``; a ConfigError when they exceed the cap."""
    if delta * MAX_MONTE_CARLO_SAMPLES < 1.0:  # it needs more than 1/delta samples (evr.minimum_samples)
        raise ConfigError(_mc_refusal(delta, f"more than {1.0 / delta:.3g}"))
    samples = evr.minimum_samples(delta)
    if samples > MAX_MONTE_CARLO_SAMPLES:
        raise ConfigError(_mc_refusal(delta, f"{samples}"))
    return samples


def _bminsep_check_delta(sampling: BMinSepSampling, delta: float) -> None:
    _minimum_samples(delta)


def _bminsep_samples(options: MonteCarloOptions, delta: float) -> tuple[int, float]:
    """Samples per verification and the base delta with which they certify ``delta``."""
    samples = options.samples or _minimum_samples(delta)
    if samples > MAX_MONTE_CARLO_SAMPLES:
        raise ConfigError(_mc_refusal(delta, f"{samples}"))
    return samples, evr.base_delta(samples, delta)  # a ConfigError when too few samples certify delta


def _bminsep_epsilon(sampling: BMinSepSampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity, *,
                     noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                     noise_sensitivity: float | None, monte_carlo: MonteCarloOptions,
                     count_noise_std: float | None = None) -> Result:
    """MC-verified epsilon at a fixed noise: the smallest eps whose estimate is <= base
    delta in both directions, with base chosen so that overall_delta(s, base) <= delta.
    By monotonicity of the estimate in eps, the probability that this eps is not
    (eps, overall_delta)-DP is at most the verifier's failure bound q (as in EVR); the
    un-amplified epsilon (always a guarantee) is reported instead when it is smaller."""
    mc = _bminsep_accountant(sampling, mechanism, schema, monte_carlo)
    samples, base = _bminsep_samples(monte_carlo, delta)
    losses = mc.losses(std_per_clip, samples, monte_carlo.seed, key=(2,))
    eps_mc = losses.epsilon(base)
    eps_unamplified = gaussian.epsilon(std_per_clip / sens.value, delta, accountant)
    dp, dn = losses.delta(eps_mc)
    more = {
        "samples": samples, "base_delta": base, "overall_delta": evr.overall_delta(samples, base),
        "epsilon_monte_carlo": eps_mc, "epsilon_estimate": losses.epsilon(delta),
        "epsilon_unamplified": eps_unamplified, "delta_positive": dp, "delta_negative": dn,
        "seed": losses.seed, "monte_carlo_seconds": losses.seconds, "scheme": mc.scheme.to_dict(),
    }
    if eps_unamplified <= eps_mc:
        return eps_unamplified, f"gaussian-{accountant}", _gaussian_guarantee(accountant, sens.exact), more
    return (eps_mc, "bminsep-monte-carlo",
            "verified: (epsilon, delta)-DP unless the Monte Carlo verification failed, which has "
            "probability <= the bound folded into delta (Thm A.1 of arXiv 2602.09338); use calibrate for EVR",
            more)


def _bminsep_calibrate(sampling: BMinSepSampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity, *,
                       epsilon: float, delta: float, accountant: str, monte_carlo: MonteCarloOptions,
                       count_noise_std: float | None = None) -> Result:
    """Estimate-Verify-Release (Thm A.1 of arXiv 2602.09338) with the un-amplified fallback."""
    mc = _bminsep_accountant(sampling, mechanism, schema, monte_carlo)
    samples, base = _bminsep_samples(monte_carlo, delta)
    # analytic fallback: the same run, un-amplified, (epsilon, base)-DP
    fallback = gaussian.calibrate(epsilon, base) * sens.value
    result = evr.calibrate(mc, epsilon, delta, fallback, samples=samples, base=base,
                           candidates=monte_carlo.candidates, ratio=monte_carlo.ratio,
                           pilot_samples=monte_carlo.pilot_samples, seed=monte_carlo.seed)
    z = result.noise_multiplier / sens.value
    name = "bminsep-evr" if result.verified else "bminsep-evr-fallback"
    guarantee = ("(epsilon, delta)-DP for the run that uses this noise as chosen by Estimate-Verify-Release "
                 "(Thm A.1 of arXiv 2602.09338)" if result.verified else
                 "exact (un-amplified fallback chosen by Estimate-Verify-Release)")
    return z, name, guarantee, {"evr": result.to_dict(), "scheme": mc.scheme.to_dict()}


def _bminsep_by_round(sampling: BMinSepSampling, mechanism: Mechanism, schema: Schema, planned: Sensitivity,
                      **_: Any) -> ByRound:
    raise ConfigError("per-round spend is not available for bminsep sampling (Monte Carlo accounting covers the "
                      "whole run only)")


# ---- cyclic-poisson: PLD or RDP of the subsampled Gaussian -------------------------------------
def _cyclic_steps(sampling: CyclicPoissonSampling, mechanism: Mechanism, schema: Schema) -> tuple[int, float]:
    """b and max_j ||C e_j||, once C is checked square and banded with <= b bands."""
    b = sampling.min_sep_of(schema)
    check_banded(mechanism, b, "cyclic-Poisson")
    return b, max_column_norm(mechanism)


def _with_count(z_step: float, count_noise_std: float | None, details: dict[str, Any]) -> float:
    """The step's multiplier with the count composed in: 1/z² = col²/σ_u² + 1/σ_b² (count_release (2))."""
    if count_noise_std is None:
        return z_step
    composed = count_release.compose(z_step, count_noise_std, 1.0)
    details.update(count_noise_std=count_noise_std, composed_step_noise_multiplier=composed,
                   privacy_split=count_release.privacy_split(z_step, count_noise_std, 1.0))
    return composed


def _cyclic_epsilon(sampling: CyclicPoissonSampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity,
                    *, noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                    noise_sensitivity: float | None, monte_carlo: MonteCarloOptions,
                    count_noise_std: float | None = None) -> Result:
    b, col = _cyclic_steps(sampling, mechanism, schema)
    count = cyclic_poisson.steps(mechanism.rounds, b)
    z_step = std_per_clip / col
    more = dict(steps=count, step_noise_multiplier=z_step, max_column_norm=col,
                sampling_probability=sampling.probability)
    z_step = _with_count(z_step, count_noise_std, more)
    eps = cyclic_poisson.epsilon(z_step, sampling.probability, count, delta, accountant)
    return eps, f"cyclic-poisson-{accountant}", f"upper bound ({accountant.upper()})", more


def _cyclic_calibrate(sampling: CyclicPoissonSampling, mechanism: Mechanism, schema: Schema,
                      sens: Sensitivity, *, epsilon: float, delta: float, accountant: str,
                      monte_carlo: MonteCarloOptions, count_noise_std: float | None = None) -> Result:
    b, col = _cyclic_steps(sampling, mechanism, schema)
    count = cyclic_poisson.steps(mechanism.rounds, b)
    z_step = cyclic_poisson.calibrate(epsilon, delta, sampling.probability, count, accountant)
    if count_noise_std is not None:
        total = z_step
        z_step = count_release.mf_multiplier(total, count_noise_std, 1.0)  # solve (2) for the MF column's part
        while cyclic_poisson.epsilon(count_release.compose(z_step, count_noise_std, 1.0), sampling.probability,
                                     count, delta, accountant) > epsilon:
            z_step *= 1 + 1e-12  # the conservative side of the rounding
    return (z_step * col / sens.value, f"cyclic-poisson-{accountant}", f"upper bound ({accountant.upper()})",
            dict(steps=count, step_noise_multiplier=z_step, max_column_norm=col,
                 sampling_probability=sampling.probability))


def _cyclic_by_round(sampling: CyclicPoissonSampling, mechanism: Mechanism, schema: Schema,
                     planned: Sensitivity, *, noise_multiplier: float, std_per_clip: float, delta: float,
                     accountant: str, noise_sensitivity: float | None, final: float | None, max_points: int,
                     count_noise_std: float | None = None) -> ByRound:
    b, col = _cyclic_steps(sampling, mechanism, schema)
    z_step = _with_count(std_per_clip / col, count_noise_std, {})
    return cyclic_poisson_curve(mechanism.rounds, b, sampling.probability, z_step, delta=delta,
                                accountant=accountant, final=final, max_points=max_points)


# ---- poisson: MMCC ------------------------------------------------------------------------------
_NO_MMCC_CALIBRATION = "calibrate does not support poisson (MMCC) sampling yet: run epsilon at candidate z"


def _poisson_epsilon(sampling: PlainPoissonSampling, mechanism: Mechanism, schema: Schema, sens: Sensitivity,
                     *, noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                     noise_sensitivity: float | None, monte_carlo: MonteCarloOptions,
                     count_noise_std: float | None = None) -> Result:
    if accountant != "pld":
        raise ConfigError("poisson (MMCC) sampling is accounted with PLD only (accountant 'pld')")
    mmcc.strategy(mechanism)  # a ConfigError when the strategy C does not suit MMCC: the user's choice
    run = mmcc.epsilon(mechanism, sampling.probability, std_per_clip, delta)
    return (run.epsilon, "mmcc-pld",
            "upper bound (MMCC, Thm 4.3 of arXiv 2310.15526; Poisson sampling in every round)",
            {f"mmcc_{k}": v for k, v in run.to_dict().items() if k not in ("epsilon", "delta")})


def _poisson_no_calibration(sampling: PlainPoissonSampling, *_: Any, **__: Any) -> Result:
    raise ConfigError(_NO_MMCC_CALIBRATION)


#: {scheme class: its accountant}: one per scheme of ``fedmf.sampling.SCHEMES``
ACCOUNTANTS: dict[type[Sampling], SchemeAccountant] = {
    NoSampling: SchemeAccountant(_none_epsilon, _none_calibrate, _unamplified_curve, has_per_round_curve=True,
                                 check_releases=_accepts),
    BMinSepSampling: SchemeAccountant(_bminsep_epsilon, _bminsep_calibrate, _bminsep_by_round,
                                      has_per_round_curve=False, check_delta=_bminsep_check_delta),
    CyclicPoissonSampling: SchemeAccountant(_cyclic_epsilon, _cyclic_calibrate, _cyclic_by_round,
                                            has_per_round_curve=True, check_releases=_accepts),
    PlainPoissonSampling: SchemeAccountant(_poisson_epsilon, _poisson_no_calibration, _unamplified_curve,
                                           has_per_round_curve=False, check_calibrate=_poisson_no_calibration),
}
