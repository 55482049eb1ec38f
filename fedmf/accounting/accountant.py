"""epsilon and calibration for a mechanism, a participation schema and a sampling scheme.

Noise convention (ARCHITECTURE.md): the server adds noise of standard deviation
sigma = z·ζ·sens, sens = the sensitivity of C under the planned schema (``noise_sensitivity``,
default: the schema given here). In clip-norm units the noise std is z·sens
(``Accounting.noise_std_per_clip_norm``; ``noise_std`` is always the absolute sigma). Then (each
scheme's part is its entry in ``schemes``; this module holds the common checks and the result)
  * none (un-amplified DP-MF): one Gaussian mechanism with sensitivity sens_schema and
    noise std z·sens, i.e. multiplier z·sens/sens_schema (= z when the noise was scaled
    for this schema) — "Multi-Epoch MF", Thm 2.2 / App. D.2;
  * cyclic-poisson:Q — ceil(n/b) Poisson(Q)-subsampled Gaussians with multiplier
    z·sens/max_j ||C e_j|| ("(Amplified) Banded MF"; "Scaling up BandMF" Prop. 2.1);
  * bminsep:P — the Monte Carlo accountant of arXiv 2602.09338 at noise std z·sens: for
    ``epsilon`` an MC-verified epsilon (see ``Accounting.guarantee``), for ``calibrate``
    Estimate-Verify-Release with the un-amplified mechanism as analytic fallback.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import checks
from ..errors import ConfigError
from ..sampling import Sampling, parse_sampling
from . import count_release, gaussian, schemes
from .releases import ExtraReleases

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema
    from .per_round import ByRound

__all__ = ["Accounting", "MonteCarloOptions", "epsilon", "calibrate", "epsilon_by_round", "schema_sensitivity"]


@dataclass(frozen=True)
class MonteCarloOptions:
    """Options of the b-min-sep Monte Carlo accountant. ``samples`` per verification
    (default: the fewest that certify delta with base delta = delta/2)."""

    samples: int | None = None
    seed: int | None = None
    workers: int = 1
    candidates: int = 3
    ratio: float = 1.01
    pilot_samples: int | None = None
    chunk_size: int | None = None
    keep: int = 200_000


@dataclass
class Accounting:
    """One accounting result; ``to_dict`` gives the CLI's JSON fields."""

    epsilon: float
    delta: float
    noise_multiplier: float
    sensitivity: float
    noise_std_per_clip_norm: float  # sigma / clip norm = z·(noise sensitivity)
    accountant: str
    guarantee: str
    sampling: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    epsilon_by_round: list[float] | None = None
    #: ρ-zCDP of the un-amplified (Gaussian) run, None where the accountant is amplified (``rho_note`` says why)
    rho: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["epsilon_by_round"] is None:
            del out["epsilon_by_round"]
        return out


def _rho(sampling: Sampling, details: dict[str, Any]) -> float | None:
    """ρ = 1/(2 z_eff²) of an un-amplified run (Bun & Steinke 2016, Prop. 1.6; composition adds, which
    z_eff already holds); None with a note in ``details`` for amplified accounting (no zCDP bound)."""
    if sampling.amplified or "effective_noise_multiplier" not in details:
        details["rho_note"] = count_release.RHO_AMPLIFIED_NOTE
        return None
    return count_release.rho(details["effective_noise_multiplier"])


def _extra(sampling: Sampling, count_noise_std: float | None,
           releases: ExtraReleases | None) -> tuple[float | None, ExtraReleases | None]:
    """The round's extra Gaussian releases (``releases``, or ``count_noise_std``: σ_b of adaptive clipping's
    count alone; None: none) as σ_unit, the std per unit sensitivity the formulas compose (``releases`` (R)),
    after checking that ``sampling``'s accountant composes them."""
    count_noise_std = count_release.check_count_noise_std(count_noise_std)
    if count_noise_std is not None:
        if releases is not None:
            raise ConfigError("give count_noise_std or releases, not both")
        releases = ExtraReleases.count(count_noise_std)
    if releases is None:
        return None, None
    if not isinstance(releases, ExtraReleases):
        raise ConfigError(f"releases must be an ExtraReleases, got {type(releases).__name__}")
    schemes.check_releases(sampling, releases)
    return releases.unit_std, releases


def schema_sensitivity(mechanism: Mechanism, schema: Schema):
    """The sensitivity of C under ``schema`` (a ``fedmf.sensitivity.Sensitivity``)."""
    return mechanism.sensitivity(schema)


def _noise_sens(sens: float, noise_sensitivity: float | None) -> float:
    if noise_sensitivity is None:
        return sens
    return checks.positive("noise sensitivity", noise_sensitivity)


def _sens_details(sens) -> dict[str, Any]:
    return {"sensitivity_method": sens.method, "sensitivity_exact": sens.exact}


def epsilon(mechanism: Mechanism, noise_multiplier: float, delta: float, schema: Schema, *,
            sampling: Sampling | str | None = None, accountant: str = "pld",
            noise_sensitivity: float | None = None, per_round: bool = False,
            monte_carlo: MonteCarloOptions = MonteCarloOptions(), count_noise_std: float | None = None,
            releases: ExtraReleases | None = None) -> Accounting:
    """epsilon at ``delta`` of a run of ``mechanism`` with noise multiplier z under
    ``schema`` and ``sampling``. See the module docstring for the noise convention.
    ``count_noise_std``: σ_b of adaptive clipping's count release, composed in (``count_release``);
    ``releases``: the round's extra Gaussian releases, composed in (``fedmf.accounting.releases``)."""
    started = time.perf_counter()
    z = checks.positive("noise multiplier", noise_multiplier)
    delta = checks.open_unit("delta", delta)
    gaussian.check_accountant(accountant)
    sampling = parse_sampling(sampling)
    count_noise_std, releases = _extra(sampling, count_noise_std, releases)
    if per_round and not schemes.has_per_round_curve(sampling):
        raise ConfigError(f"per-round spend is not available for {sampling.kind} sampling")
    sens = schema_sensitivity(mechanism, schema)
    if not sens.value > 0:
        raise ConfigError("the mechanism has zero sensitivity under this schema")
    noise_sens = _noise_sens(sens.value, noise_sensitivity)
    std_per_clip = z * noise_sens
    details: dict[str, Any] = _sens_details(sens)
    if noise_sensitivity is not None:
        details["noise_sensitivity"] = noise_sens
    eps, name, guarantee, more = schemes.epsilon(
        sampling, mechanism, schema, sens, noise_multiplier=z, std_per_clip=std_per_clip, delta=delta,
        accountant=accountant, noise_sensitivity=noise_sensitivity, monte_carlo=monte_carlo,
        count_noise_std=count_noise_std)
    details.update(more)
    if releases is not None:
        releases.label(details)
    result = Accounting(eps, delta, z, sens.value, std_per_clip, name, guarantee, str(sampling), 0.0, details)
    result.rho = _rho(sampling, details)
    if per_round:
        by_round = epsilon_by_round(mechanism, z, delta, schema, sampling=sampling, accountant=accountant,
                                    noise_sensitivity=noise_sensitivity, final=eps, count_noise_std=count_noise_std)
        result.epsilon_by_round = by_round.epsilons.tolist()
        result.details["per_round_method"] = by_round.method
        result.details["per_round_exact"] = bool(by_round.exact.all())
    result.seconds = time.perf_counter() - started
    return result


def calibrate(mechanism: Mechanism, epsilon: float, delta: float, schema: Schema, *,
              sampling: Sampling | str | None = None, accountant: str = "pld", per_round: bool = False,
              monte_carlo: MonteCarloOptions = MonteCarloOptions(), count_noise_std: float | None = None,
              releases: ExtraReleases | None = None) -> Accounting:
    """The smallest noise multiplier z (noise std = z·ζ·sens_schema) whose run is
    (epsilon, delta)-DP. Cached for the analytic accountants; b-min-sep runs EVR.
    ``count_noise_std``: σ_b of adaptive clipping's count release; ``releases``: the round's extra
    Gaussian releases (``fedmf.accounting.releases``); z is solved with them composed in."""
    started = time.perf_counter()
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    gaussian.check_accountant(accountant)
    sampling = parse_sampling(sampling)
    count_noise_std, releases = _extra(sampling, count_noise_std, releases)
    schemes.check_calibrate(sampling)
    if per_round and not schemes.has_per_round_curve(sampling):
        raise ConfigError(f"per-round spend is not available for {sampling.kind} sampling")
    sens = schema_sensitivity(mechanism, schema)
    if not sens.value > 0:
        raise ConfigError("the mechanism has zero sensitivity under this schema")
    details: dict[str, Any] = _sens_details(sens)
    try:
        z, name, guarantee, more = schemes.calibrate(sampling, mechanism, schema, sens, epsilon=epsilon, delta=delta,
                                                     accountant=accountant, monte_carlo=monte_carlo,
                                                     count_noise_std=count_noise_std)
    except ConfigError as e:
        if releases is None or releases.count_only or "alone spends" not in str(e):
            raise
        raise ConfigError(f"{releases.what()} alone would spend the whole privacy budget (epsilon {epsilon:g}): raise "
                          "client-metrics-noise (or adaptive-clipping-count-noise) or the target epsilon") from None
    details.update(more)
    if releases is not None:
        releases.label(details)
    if not sampling.amplified and "effective_noise_multiplier" not in details:
        details["effective_noise_multiplier"] = z
    out = Accounting(epsilon, delta, z, sens.value, z * sens.value, name, guarantee, str(sampling), 0.0, details)
    out.rho = _rho(sampling, details)
    if per_round:
        by_round = epsilon_by_round(mechanism, z, delta, schema, sampling=sampling, accountant=accountant,
                                    count_noise_std=count_noise_std)
        out.epsilon_by_round = by_round.epsilons.tolist()
        out.details["per_round_method"] = by_round.method
        out.details["per_round_exact"] = bool(by_round.exact.all())
    out.seconds = time.perf_counter() - started
    return out


def epsilon_by_round(mechanism: Mechanism, noise_multiplier: float, delta: float, schema: Schema, *,
                     sampling: Sampling | str | None = None, accountant: str = "pld",
                     noise_sensitivity: float | None = None, final: float | None = None,
                     max_points: int = 64, count_noise_std: float | None = None,
                     releases: ExtraReleases | None = None) -> ByRound:
    """epsilon after each round (``per_round``: un-amplified or cyclic-Poisson). ``final``: the
    planned epsilon when already known (the curve ends exactly there). ``count_noise_std``: σ_b of
    adaptive clipping's count release; ``releases``: the round's extra Gaussian releases; composed in."""
    z = checks.positive("noise multiplier", noise_multiplier)
    delta = checks.open_unit("delta", delta)
    gaussian.check_accountant(accountant)
    sampling = parse_sampling(sampling)
    count_noise_std, _ = _extra(sampling, count_noise_std, releases)
    max_points = checks.positive_int("max_points", max_points)
    planned = mechanism.sensitivity(schema)
    noise_sens = planned.value if noise_sensitivity is None else checks.positive("noise sensitivity",
                                                                                  noise_sensitivity)
    return schemes.epsilon_by_round(sampling, mechanism, schema, planned, noise_multiplier=z,
                                    std_per_clip=z * noise_sens, delta=delta, accountant=accountant,
                                    noise_sensitivity=noise_sensitivity, final=final, max_points=max_points,
                                    count_noise_std=count_noise_std)
