"""epsilon and calibration for a mechanism, a participation schema and a sampling scheme.

Noise convention (ARCHITECTURE.md): the server adds noise of standard deviation
sigma = z·ζ·sens, sens = the sensitivity of C under the planned schema (``noise_sensitivity``,
default: the schema given here). In clip-norm units the noise std is z·sens
(``Accounting.noise_std_per_clip_norm``; ``noise_std`` is always the absolute sigma). Then
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

from ..errors import ConfigError
from .. import checks
from . import cyclic_poisson, gaussian
from .sampling import Sampling, amplification_min_sep, check_banded, max_column_norm, parse_sampling

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema

__all__ = ["Accounting", "MonteCarloOptions", "epsilon", "calibrate", "schema_sensitivity"]


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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["epsilon_by_round"] is None:
            del out["epsilon_by_round"]
        return out


def schema_sensitivity(mechanism: "Mechanism", schema: "Schema"):
    """The sensitivity of C under ``schema`` (a ``fedmf.sensitivity.Sensitivity``)."""
    return mechanism.sensitivity(schema)


def _noise_sens(sens: float, noise_sensitivity: float | None) -> float:
    if noise_sensitivity is None:
        return sens
    return checks.positive("noise sensitivity", noise_sensitivity)


def _sens_details(sens) -> dict[str, Any]:
    return {"sensitivity_method": sens.method, "sensitivity_exact": sens.exact}


def _unamplified_guarantee(accountant: str, exact: bool) -> str:
    if accountant == "rdp":
        return "upper bound (RDP)"
    return "exact (Gaussian privacy loss distribution)" if exact else "upper bound (sensitivity bound)"


def epsilon(mechanism: "Mechanism", noise_multiplier: float, delta: float, schema: "Schema", *,
            sampling: Sampling | str | None = None, accountant: str = "pld",
            noise_sensitivity: float | None = None, per_round: bool = False,
            monte_carlo: MonteCarloOptions = MonteCarloOptions()) -> Accounting:
    """epsilon at ``delta`` of a run of ``mechanism`` with noise multiplier z under
    ``schema`` and ``sampling``. See the module docstring for the noise convention."""
    started = time.perf_counter()
    z = checks.positive("noise multiplier", noise_multiplier)
    delta = checks.open_unit("delta", delta)
    gaussian.check_accountant(accountant)
    sampling = parse_sampling(sampling)
    if per_round and sampling.kind in ("bminsep", "poisson"):
        raise ConfigError(f"per-round spend is not available for {sampling.kind} sampling")
    sens = schema_sensitivity(mechanism, schema)
    if not sens.value > 0:
        raise ConfigError("the mechanism has zero sensitivity under this schema")
    noise_sens = _noise_sens(sens.value, noise_sensitivity)
    std_per_clip = z * noise_sens
    details: dict[str, Any] = _sens_details(sens)
    if noise_sensitivity is not None:
        details["noise_sensitivity"] = noise_sens
    if sampling.kind == "none":
        z_eff = z if noise_sensitivity is None else std_per_clip / sens.value
        eps = gaussian.epsilon(z_eff, delta, accountant)
        name, guarantee = f"gaussian-{accountant}", _unamplified_guarantee(accountant, sens.exact)
        details["effective_noise_multiplier"] = z_eff
    elif sampling.kind == "cyclic-poisson":
        b = amplification_min_sep(schema, sampling)
        check_banded(mechanism, b, "cyclic-Poisson")
        col = max_column_norm(mechanism)
        count = cyclic_poisson.steps(mechanism.rounds, b)
        z_step = std_per_clip / col
        eps = cyclic_poisson.epsilon(z_step, sampling.probability, count, delta, accountant)
        name, guarantee = f"cyclic-poisson-{accountant}", f"upper bound ({accountant.upper()})"
        details.update(steps=count, step_noise_multiplier=z_step, max_column_norm=col,
                       sampling_probability=sampling.probability)
    elif sampling.kind == "poisson":
        from . import mmcc

        if accountant != "pld":
            raise ConfigError("poisson (MMCC) sampling is accounted with PLD only (accountant 'pld')")
        mmcc.strategy(mechanism)  # a ConfigError when the strategy C does not suit MMCC: the user's choice
        run = mmcc.epsilon(mechanism, sampling.probability, std_per_clip, delta)
        eps, name = run.epsilon, "mmcc-pld"
        guarantee = "upper bound (MMCC, Thm 4.3 of arXiv 2310.15526; Poisson sampling in every round)"
        details.update({f"mmcc_{k}": v for k, v in run.to_dict().items() if k not in ("epsilon", "delta")})
    else:
        eps, name, guarantee, more = _bminsep_epsilon(mechanism, z, std_per_clip, delta, schema, sens, sampling,
                                                       accountant, monte_carlo)
        details.update(more)
    result = Accounting(eps, delta, z, sens.value, std_per_clip, name, guarantee, str(sampling), 0.0, details)
    if per_round:
        from .per_round import epsilon_by_round

        by_round = epsilon_by_round(mechanism, z, delta, schema, sampling=sampling, accountant=accountant,
                                    noise_sensitivity=noise_sensitivity, final=eps)
        result.epsilon_by_round = by_round.epsilons.tolist()
        result.details["per_round_method"] = by_round.method
        result.details["per_round_exact"] = bool(by_round.exact.all())
    result.seconds = time.perf_counter() - started
    return result


def _bminsep_accountant(mechanism: "Mechanism", schema: "Schema", sampling: Sampling, options: MonteCarloOptions):
    from .bminsep import BMinSep
    from .montecarlo import MonteCarloAccountant

    b = amplification_min_sep(schema, sampling)
    check_banded(mechanism, b, "b-min-sep")
    scheme = BMinSep.from_mechanism(mechanism, b, sampling.probability, sampling.warm_start)
    return MonteCarloAccountant(scheme, workers=options.workers, chunk_size=options.chunk_size, keep=options.keep)


def _samples(options: MonteCarloOptions, delta: float) -> tuple[int, float]:
    """Samples per verification and the base delta with which they certify ``delta``."""
    from . import evr

    samples = options.samples or evr.minimum_samples(delta)
    return samples, evr.base_delta(samples, delta)  # a ConfigError when too few samples certify delta


def _bminsep_epsilon(mechanism, z, std_per_clip, delta, schema, sens, sampling, accountant, options):
    """MC-verified epsilon at a fixed noise: the smallest eps whose estimate is <= base
    delta in both directions, with base chosen so that overall_delta(s, base) <= delta.
    By monotonicity of the estimate in eps, the probability that this eps is not
    (eps, overall_delta)-DP is at most the verifier's failure bound q (as in EVR); the
    un-amplified epsilon (always a guarantee) is reported instead when it is smaller."""
    from . import evr

    mc = _bminsep_accountant(mechanism, schema, sampling, options)
    samples, base = _samples(options, delta)
    losses = mc.losses(std_per_clip, samples, options.seed, key=(2,))
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
        return eps_unamplified, f"gaussian-{accountant}", _unamplified_guarantee(accountant, sens.exact), more
    return (eps_mc, "bminsep-monte-carlo",
            "verified: (epsilon, delta)-DP unless the Monte Carlo verification failed, which has "
            "probability <= the bound folded into delta (Thm A.1 of arXiv 2602.09338); use calibrate for EVR", more)


def calibrate(mechanism: "Mechanism", epsilon: float, delta: float, schema: "Schema", *,
              sampling: Sampling | str | None = None, accountant: str = "pld", per_round: bool = False,
              monte_carlo: MonteCarloOptions = MonteCarloOptions()) -> Accounting:
    """The smallest noise multiplier z (noise std = z·ζ·sens_schema) whose run is
    (epsilon, delta)-DP. Cached for the analytic accountants; b-min-sep runs EVR."""
    started = time.perf_counter()
    epsilon = checks.positive("epsilon", epsilon)
    delta = checks.open_unit("delta", delta)
    gaussian.check_accountant(accountant)
    sampling = parse_sampling(sampling)
    if sampling.kind == "poisson":
        raise ConfigError("calibrate does not support poisson (MMCC) sampling yet: run epsilon at candidate z")
    if per_round and sampling.kind == "bminsep":
        raise ConfigError("per-round spend is not available for bminsep sampling")
    sens = schema_sensitivity(mechanism, schema)
    if not sens.value > 0:
        raise ConfigError("the mechanism has zero sensitivity under this schema")
    details: dict[str, Any] = _sens_details(sens)
    if sampling.kind == "none":
        z = gaussian.calibrate(epsilon, delta, accountant)
        name, guarantee = f"gaussian-{accountant}", _unamplified_guarantee(accountant, sens.exact)
    elif sampling.kind == "cyclic-poisson":
        b = amplification_min_sep(schema, sampling)
        check_banded(mechanism, b, "cyclic-Poisson")
        col = max_column_norm(mechanism)
        count = cyclic_poisson.steps(mechanism.rounds, b)
        z_step = cyclic_poisson.calibrate(epsilon, delta, sampling.probability, count, accountant)
        z = z_step * col / sens.value
        name, guarantee = f"cyclic-poisson-{accountant}", f"upper bound ({accountant.upper()})"
        details.update(steps=count, step_noise_multiplier=z_step, max_column_norm=col,
                       sampling_probability=sampling.probability)
    else:
        from . import evr

        mc = _bminsep_accountant(mechanism, schema, sampling, monte_carlo)
        samples, base = _samples(monte_carlo, delta)
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
        details["evr"] = result.to_dict()
        details["scheme"] = mc.scheme.to_dict()
    out = Accounting(epsilon, delta, z, sens.value, z * sens.value, name, guarantee, str(sampling), 0.0, details)
    if per_round:
        from .per_round import epsilon_by_round

        by_round = epsilon_by_round(mechanism, z, delta, schema, sampling=sampling, accountant=accountant)
        out.epsilon_by_round = by_round.epsilons.tolist()
        out.details["per_round_method"] = by_round.method
        out.details["per_round_exact"] = bool(by_round.exact.all())
    out.seconds = time.perf_counter() - started
    return out
