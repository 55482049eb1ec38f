"""How clients are sampled, as the accountants see it: one immutable object per scheme.

* ``NoSampling`` (``none``): un-amplified, any schedule that respects the participation schema;
* ``BMinSepSampling`` (``bminsep:P[:warm]``): b-min-sep Poisson sampling with probability P,
  b = the schema's min_sep (Dong & Ganesh, arXiv 2602.09338);
* ``CyclicPoissonSampling`` (``cyclic-poisson:Q``): b groups in turn, each client of the active
  group included with probability Q ("Scaling up BandMF", Alg. 2);
* ``PlainPoissonSampling`` (``poisson:P``): every client in every round with probability P
  (MMCC, ``accounting.mmcc``).

A scheme knows its string form (``str``, read back by ``parse_sampling``: the form the CLI,
config files, the ledger and checkpoints store), the schemas it follows, the scheduler that
realizes it (``fedmf.schedule``) and how the accountants compute its ε: ``epsilon``,
``calibrate`` and ``epsilon_by_round`` read the scheme and call the interpreters
(``gaussian``, ``cyclic_poisson``, ``mmcc``, the b-min-sep Monte Carlo accountant,
``per_round``), as dp_accounting's accountants read a DpEvent. The entry points with their
common checks are ``accounting.accountant``; the noise convention is documented there.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Hashable, Iterable

from ..errors import ConfigError
from .. import checks

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema
    from ..schedule import Scheduler
    from ..sensitivity import Sensitivity
    from .accountant import MonteCarloOptions
    from .per_round import ByRound

__all__ = [
    "Sampling", "NoSampling", "BMinSepSampling", "CyclicPoissonSampling", "PlainPoissonSampling", "parse_sampling",
    "NONE", "check_banded", "max_column_norm",
]

#: (epsilon, accountant name, guarantee, details): what a scheme's accounting adds to an ``Accounting``
Result = tuple[float, str, str, dict[str, Any]]


class _ByParts(abc.ABCMeta):
    """``Sampling(kind, probability, warm_start)`` builds the scheme of that kind (the parts of
    its string form); a scheme class is called with its own parameters."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Sampling:
            return _from_parts(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Sampling(metaclass=_ByParts):
    """A sampling scheme (immutable). ``kind``: the first part of its string form."""

    kind: ClassVar[str]
    #: whether the accountant's ε relies on the sampling (and its secrecy)
    amplified: ClassVar[bool]
    #: whether the accountants give ε after each round (else every round is charged the whole run's ε)
    has_per_round_curve: ClassVar[bool]
    #: whether the scheme may follow a FixedEpoch schema (else it is planned with MinSep)
    follows_fixed_epoch: ClassVar[bool]

    @property
    def observed_guard(self) -> bool:
        """Whether the worst user's observed ε (accounted from the ledger's participations) is a
        valid ε and guards each round: only for un-amplified runs, where ε holds for every
        participation pattern the schema allows."""
        return not self.amplified

    # ---- the schemas it follows -------------------------------------------------------
    def check_schema(self, schema: "Schema") -> None:
        """Refuse a planned schema this scheme does not follow."""
        from ..participation import FixedEpoch

        if isinstance(schema, FixedEpoch) and not self.follows_fixed_epoch:
            raise ConfigError(f"{self.kind} sampling does not follow the fixed-epoch order; plan it with MinSep")

    def min_sep_of(self, schema: "Schema") -> int:
        """b of an amplified scheme: the schema's min_sep (MinSep; FixedEpoch where it follows it)."""
        from ..participation import FixedEpoch, MinSep

        if isinstance(schema, MinSep) or (isinstance(schema, FixedEpoch) and self.follows_fixed_epoch):
            return schema.min_sep
        raise ConfigError(f"{self.kind} sampling needs a min-sep schema (got {schema.name})")

    # ---- the scheduler ----------------------------------------------------------------
    @abc.abstractmethod
    def scheduler(self, schema: "Schema", *, key: bytes, max_participations: int | None,
                  users_per_round: int | None, population: Iterable[Hashable] | None) -> "Scheduler":
        """The scheduler that realizes this scheme under ``schema`` (``fedmf.schedule.make_scheduler``)."""

    def _refuse_users_per_round(self, schema: "Schema", users_per_round: int | None) -> None:
        if users_per_round is not None:
            raise ConfigError(f"users_per_round applies to MinSep without sampling; {schema.name} with sampling "
                              f"{self} decides the number of users itself")

    # ---- the accountant ---------------------------------------------------------------
    @abc.abstractmethod
    def epsilon(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, noise_multiplier: float,
                std_per_clip: float, delta: float, accountant: str, noise_sensitivity: float | None,
                monte_carlo: "MonteCarloOptions", count_noise_std: float | None = None) -> Result:
        """ε at ``delta`` of the run whose noise std is ``std_per_clip`` clip norms."""

    def check_calibrate(self) -> None:
        """Refuse calibration where the scheme has no calibrator."""

    def check_delta(self, delta: float) -> None:
        """Refuse up front a delta the scheme's accountant cannot certify in bounded time."""

    @abc.abstractmethod
    def calibrate(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, epsilon: float,
                  delta: float, accountant: str, monte_carlo: "MonteCarloOptions",
                  count_noise_std: float | None = None) -> Result:
        """The smallest noise multiplier (first item) whose run is (epsilon, delta)-DP."""

    def epsilon_by_round(self, mechanism: "Mechanism", schema: "Schema", planned: "Sensitivity", *,
                         noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                         noise_sensitivity: float | None, final: float | None, max_points: int,
                         count_noise_std: float | None = None) -> "ByRound":
        """ε after each round: the un-amplified curve of ``per_round``."""
        from .per_round import unamplified_curve

        return unamplified_curve(mechanism, schema, planned, noise_multiplier=noise_multiplier,
                                 std_per_clip=std_per_clip, delta=delta, accountant=accountant,
                                 noise_sensitivity=noise_sensitivity, final=final, max_points=max_points,
                                 count_noise_std=count_noise_std)


def _gaussian_guarantee(accountant: str, exact: bool) -> str:
    """The guarantee of the un-amplified (Gaussian) ε."""
    if accountant == "rdp":
        return "upper bound (RDP)"
    return "exact (Gaussian privacy loss distribution)" if exact else "upper bound (sensitivity bound)"


@dataclass(frozen=True)
class NoSampling(Sampling):
    """``none``: un-amplified DP-MF, one Gaussian mechanism with sensitivity sens_schema
    ("Multi-Epoch MF", Thm 2.2 / App. D.2); any schedule that respects the schema."""

    kind: ClassVar[str] = "none"
    amplified: ClassVar[bool] = False
    has_per_round_curve: ClassVar[bool] = True
    follows_fixed_epoch: ClassVar[bool] = True
    probability: ClassVar[None] = None
    warm_start: ClassVar[bool] = False

    def __str__(self) -> str:
        return "none"

    def scheduler(self, schema: "Schema", *, key: bytes, max_participations: int | None,
                  users_per_round: int | None, population: Iterable[Hashable] | None) -> "Scheduler":
        """MinSep: uniform ``users_per_round`` of the eligible users; FixedEpoch: the fixed-epoch order."""
        from ..participation import FixedEpoch

        if isinstance(schema, FixedEpoch):
            self._refuse_users_per_round(schema, users_per_round)
            if population is None:
                raise ConfigError("the fixed-epoch order needs the population (the users, fixed for the run)")
            from ..schedule.fixed_epoch import FixedEpochOrder

            return FixedEpochOrder(schema.min_sep, schema.max_participations, population, key)
        if users_per_round is None:
            raise ConfigError("MinSep without sampling needs users_per_round")
        from ..schedule.min_sep import MinSepSelection

        return MinSepSelection(schema.min_sep, max_participations, users_per_round, key)

    def epsilon(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, noise_multiplier: float,
                std_per_clip: float, delta: float, accountant: str, noise_sensitivity: float | None,
                monte_carlo: "MonteCarloOptions", count_noise_std: float | None = None) -> Result:
        """The Gaussian mechanism's ε at multiplier z·sens/sens_schema (= z when the noise was scaled for it)."""
        from . import count_release, gaussian

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

    def calibrate(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, epsilon: float,
                  delta: float, accountant: str, monte_carlo: "MonteCarloOptions",
                  count_noise_std: float | None = None) -> Result:
        from . import count_release, gaussian

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


@dataclass(frozen=True)
class _Sampled(Sampling):
    """An amplified scheme: each user of the whole population is sampled with ``probability``."""

    probability: float
    amplified: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "probability", checks.probability(f"{self.kind} probability", self.probability))

    def __str__(self) -> str:
        return f"{self.kind}:{self.probability:g}"

    def scheduler(self, schema: "Schema", *, key: bytes, max_participations: int | None,
                  users_per_round: int | None, population: Iterable[Hashable] | None) -> "Scheduler":
        """The scheme's sampler over the population (users added as they are seen)."""
        self._refuse_users_per_round(schema, users_per_round)
        scheduler = self._sampler(schema, key, max_participations)
        if population is not None:
            scheduler.add_users(population)
        return scheduler

    @abc.abstractmethod
    def _sampler(self, schema: "Schema", key: bytes, max_participations: int | None) -> "Scheduler":
        """The scheduler, before any user is added."""


#: the most samples the b-min-sep Monte Carlo accountant is asked to draw per verification: it certifies
#: delta only with more than 1/delta samples (EVR, Thm A.1 of arXiv 2602.09338), so delta below ~1/this is
#: refused up front instead of running for hours
MAX_MONTE_CARLO_SAMPLES = 1 << 31


def _mc_refusal(delta: float, needed: str) -> str:
    return (f"delta={delta:g} is too small for bminsep Monte Carlo accounting ({needed} samples needed, at most "
            f"{MAX_MONTE_CARLO_SAMPLES}): use cyclic-poisson:Q (PLD) or sampling none (un-amplified) for this delta")


@dataclass(frozen=True)
class BMinSepSampling(_Sampled):
    """``bminsep:P[:warm]``: b-min-sep Poisson sampling (Dong & Ganesh, Alg. 1 cold / Alg. 2
    warm start), accounted by the Monte Carlo accountant of arXiv 2602.09338: for ``epsilon`` an
    MC-verified ε, for ``calibrate`` Estimate-Verify-Release with the un-amplified mechanism as
    analytic fallback. No per-round curve (the accountant covers the whole run only)."""

    warm_start: bool = False
    kind: ClassVar[str] = "bminsep"
    has_per_round_curve: ClassVar[bool] = False
    follows_fixed_epoch: ClassVar[bool] = False

    def __str__(self) -> str:
        return super().__str__() + (":warm" if self.warm_start else "")

    def _sampler(self, schema: "Schema", key: bytes, max_participations: int | None) -> "Scheduler":
        self.check_schema(schema)
        from ..schedule.bminsep import BMinSepPoisson

        return BMinSepPoisson(schema.min_sep, self.probability, key, max_participations=max_participations,
                              warm_start=self.warm_start)

    def _accountant(self, mechanism: "Mechanism", schema: "Schema", options: "MonteCarloOptions"):
        from .bminsep import BMinSep
        from .montecarlo import MonteCarloAccountant

        b = self.min_sep_of(schema)
        check_banded(mechanism, b, "b-min-sep")
        scheme = BMinSep.from_mechanism(mechanism, b, self.probability, self.warm_start)  # ConfigError: e.g. C < 0
        return MonteCarloAccountant(scheme, workers=options.workers, chunk_size=options.chunk_size, keep=options.keep)

    def check_delta(self, delta: float) -> None:
        self._minimum_samples(delta)

    @staticmethod
    def _minimum_samples(delta: float) -> int:
        """The fewest samples that certify ``delta``; a ConfigError when they exceed the cap."""
        from . import evr

        if delta * MAX_MONTE_CARLO_SAMPLES < 1.0:  # it needs more than 1/delta samples (evr.minimum_samples)
            raise ConfigError(_mc_refusal(delta, f"more than {1.0 / delta:.3g}"))
        samples = evr.minimum_samples(delta)
        if samples > MAX_MONTE_CARLO_SAMPLES:
            raise ConfigError(_mc_refusal(delta, f"{samples}"))
        return samples

    def _samples(self, options: "MonteCarloOptions", delta: float) -> tuple[int, float]:
        """Samples per verification and the base delta with which they certify ``delta``."""
        from . import evr

        samples = options.samples or self._minimum_samples(delta)
        if samples > MAX_MONTE_CARLO_SAMPLES:
            raise ConfigError(_mc_refusal(delta, f"{samples}"))
        return samples, evr.base_delta(samples, delta)  # a ConfigError when too few samples certify delta

    def epsilon(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, noise_multiplier: float,
                std_per_clip: float, delta: float, accountant: str, noise_sensitivity: float | None,
                monte_carlo: "MonteCarloOptions", count_noise_std: float | None = None) -> Result:
        """MC-verified epsilon at a fixed noise: the smallest eps whose estimate is <= base
        delta in both directions, with base chosen so that overall_delta(s, base) <= delta.
        By monotonicity of the estimate in eps, the probability that this eps is not
        (eps, overall_delta)-DP is at most the verifier's failure bound q (as in EVR); the
        un-amplified epsilon (always a guarantee) is reported instead when it is smaller."""
        from . import evr, gaussian

        mc = self._accountant(mechanism, schema, monte_carlo)
        samples, base = self._samples(monte_carlo, delta)
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

    def calibrate(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, epsilon: float,
                  delta: float, accountant: str, monte_carlo: "MonteCarloOptions",
                  count_noise_std: float | None = None) -> Result:
        """Estimate-Verify-Release (Thm A.1 of arXiv 2602.09338) with the un-amplified fallback."""
        from . import evr, gaussian

        mc = self._accountant(mechanism, schema, monte_carlo)
        samples, base = self._samples(monte_carlo, delta)
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

    def epsilon_by_round(self, mechanism: "Mechanism", schema: "Schema", planned: "Sensitivity", *,
                         noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                         noise_sensitivity: float | None, final: float | None, max_points: int,
                         count_noise_std: float | None = None) -> "ByRound":
        raise ConfigError("per-round spend is not available for bminsep sampling (Monte Carlo accounting covers the "
                          "whole run only)")


@dataclass(frozen=True)
class CyclicPoissonSampling(_Sampled):
    """``cyclic-poisson:Q``: ceil(n/b) Poisson(Q)-subsampled Gaussians with multiplier
    z·sens/max_j ||C e_j|| ("(Amplified) Banded MF"; "Scaling up BandMF" Prop. 2.1); after t
    rounds, ceil(t/b) of them. A FixedEpoch schema's b slots are cyclic groups too."""

    kind: ClassVar[str] = "cyclic-poisson"
    has_per_round_curve: ClassVar[bool] = True
    follows_fixed_epoch: ClassVar[bool] = True
    warm_start: ClassVar[bool] = False

    def _sampler(self, schema: "Schema", key: bytes, max_participations: int | None) -> "Scheduler":
        from ..schedule.cyclic_poisson import CyclicPoisson

        return CyclicPoisson(schema.min_sep, self.probability, key, max_participations=max_participations)

    def _steps(self, mechanism: "Mechanism", schema: "Schema") -> tuple[int, float]:
        """b and max_j ||C e_j||, once C is checked square and banded with <= b bands."""
        b = self.min_sep_of(schema)
        check_banded(mechanism, b, "cyclic-Poisson")
        return b, max_column_norm(mechanism)

    def epsilon(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, noise_multiplier: float,
                std_per_clip: float, delta: float, accountant: str, noise_sensitivity: float | None,
                monte_carlo: "MonteCarloOptions", count_noise_std: float | None = None) -> Result:
        from . import cyclic_poisson

        b, col = self._steps(mechanism, schema)
        count = cyclic_poisson.steps(mechanism.rounds, b)
        z_step = std_per_clip / col
        more = dict(steps=count, step_noise_multiplier=z_step, max_column_norm=col,
                    sampling_probability=self.probability)
        z_step = self._with_count(z_step, count_noise_std, more)
        eps = cyclic_poisson.epsilon(z_step, self.probability, count, delta, accountant)
        return eps, f"cyclic-poisson-{accountant}", f"upper bound ({accountant.upper()})", more

    @staticmethod
    def _with_count(z_step: float, count_noise_std: float | None, details: dict[str, Any]) -> float:
        """The step's multiplier with the count composed in: 1/z² = col²/σ_u² + 1/σ_b² (count_release (2))."""
        if count_noise_std is None:
            return z_step
        from . import count_release

        composed = count_release.compose(z_step, count_noise_std, 1.0)
        details.update(count_noise_std=count_noise_std, composed_step_noise_multiplier=composed,
                       privacy_split=count_release.privacy_split(z_step, count_noise_std, 1.0))
        return composed

    def calibrate(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, epsilon: float,
                  delta: float, accountant: str, monte_carlo: "MonteCarloOptions",
                  count_noise_std: float | None = None) -> Result:
        from . import cyclic_poisson

        b, col = self._steps(mechanism, schema)
        count = cyclic_poisson.steps(mechanism.rounds, b)
        z_step = cyclic_poisson.calibrate(epsilon, delta, self.probability, count, accountant)
        if count_noise_std is not None:
            from . import count_release

            total = z_step
            z_step = count_release.mf_multiplier(total, count_noise_std, 1.0)  # solve (2) for the MF column's part
            while cyclic_poisson.epsilon(count_release.compose(z_step, count_noise_std, 1.0), self.probability,
                                         count, delta, accountant) > epsilon:
                z_step *= 1 + 1e-12  # the conservative side of the rounding
        return (z_step * col / sens.value, f"cyclic-poisson-{accountant}", f"upper bound ({accountant.upper()})",
                dict(steps=count, step_noise_multiplier=z_step, max_column_norm=col,
                     sampling_probability=self.probability))

    def epsilon_by_round(self, mechanism: "Mechanism", schema: "Schema", planned: "Sensitivity", *,
                         noise_multiplier: float, std_per_clip: float, delta: float, accountant: str,
                         noise_sensitivity: float | None, final: float | None, max_points: int,
                         count_noise_std: float | None = None) -> "ByRound":
        from .per_round import cyclic_poisson_curve

        b, col = self._steps(mechanism, schema)
        z_step = self._with_count(std_per_clip / col, count_noise_std, {})
        return cyclic_poisson_curve(mechanism.rounds, b, self.probability, z_step, delta=delta,
                                    accountant=accountant, final=final, max_points=max_points)


_NO_MMCC_CALIBRATION = "calibrate does not support poisson (MMCC) sampling yet: run epsilon at candidate z"


@dataclass(frozen=True)
class PlainPoissonSampling(_Sampled):
    """``poisson:P``: Poisson sampling in every round, planned with MinSep(1, n), accounted by
    MMCC (Thm 4.3 of arXiv 2310.15526) with PLD. No calibration yet and no per-round curve in a
    plan (``epsilon_by_round`` gives the un-amplified curve, an upper bound)."""

    kind: ClassVar[str] = "poisson"
    has_per_round_curve: ClassVar[bool] = False
    follows_fixed_epoch: ClassVar[bool] = False
    warm_start: ClassVar[bool] = False

    def check_schema(self, schema: "Schema") -> None:
        from ..participation import MinSep

        if not (isinstance(schema, MinSep) and schema.min_sep == 1):
            raise ConfigError("poisson sampling (MMCC) samples every user in every round: plan it with MinSep(1, n)")
        super().check_schema(schema)

    def _sampler(self, schema: "Schema", key: bytes, max_participations: int | None) -> "Scheduler":
        super().check_schema(schema)
        if schema.min_sep != 1:
            raise ConfigError(f"poisson sampling (MMCC) samples every user in every round: plan it with "
                              f"MinSep(1, n), not min_sep={schema.min_sep}")
        from ..schedule.poisson import PoissonSampling

        return PoissonSampling(self.probability, key, max_participations=max_participations)

    def epsilon(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, noise_multiplier: float,
                std_per_clip: float, delta: float, accountant: str, noise_sensitivity: float | None,
                monte_carlo: "MonteCarloOptions", count_noise_std: float | None = None) -> Result:
        from . import mmcc

        if accountant != "pld":
            raise ConfigError("poisson (MMCC) sampling is accounted with PLD only (accountant 'pld')")
        mmcc.strategy(mechanism)  # a ConfigError when the strategy C does not suit MMCC: the user's choice
        run = mmcc.epsilon(mechanism, self.probability, std_per_clip, delta)
        return (run.epsilon, "mmcc-pld",
                "upper bound (MMCC, Thm 4.3 of arXiv 2310.15526; Poisson sampling in every round)",
                {f"mmcc_{k}": v for k, v in run.to_dict().items() if k not in ("epsilon", "delta")})

    def check_calibrate(self) -> None:
        raise ConfigError(_NO_MMCC_CALIBRATION)

    def calibrate(self, mechanism: "Mechanism", schema: "Schema", sens: "Sensitivity", *, epsilon: float,
                  delta: float, accountant: str, monte_carlo: "MonteCarloOptions",
                  count_noise_std: float | None = None) -> Result:
        raise ConfigError(_NO_MMCC_CALIBRATION)


NONE = NoSampling()
_SCHEMES: dict[str, type[Sampling]] = {
    cls.kind: cls for cls in (NoSampling, BMinSepSampling, CyclicPoissonSampling, PlainPoissonSampling)}


def _from_parts(kind: str = "none", probability: float | None = None, warm_start: bool = False) -> Sampling:
    """The scheme of ``kind`` with ``probability`` (and ``warm_start``, bminsep only)."""
    scheme = _SCHEMES.get(kind)
    if scheme is None:
        raise ConfigError(f"unknown sampling {kind!r} (use none, bminsep:P, cyclic-poisson:Q or poisson:P)")
    if scheme is NoSampling:
        if probability is not None or warm_start:
            raise ConfigError("sampling 'none' takes no probability")
        return NoSampling()
    if scheme is BMinSepSampling:
        return BMinSepSampling(probability, warm_start)
    sampled = scheme(probability)
    if warm_start:
        raise ConfigError("warm start applies to bminsep sampling only")
    return sampled


def parse_sampling(text: str | Sampling | None) -> Sampling:
    """'none' | 'bminsep:P' | 'bminsep:P:warm' | 'cyclic-poisson:Q' | 'poisson:P'."""
    if text is None:
        return NONE
    if isinstance(text, Sampling):
        return text
    parts = str(text).strip().split(":")
    kind = parts[0]
    if kind == NoSampling.kind and len(parts) == 1:
        return NONE
    if kind not in _SCHEMES or not _SCHEMES[kind].amplified or len(parts) not in (2, 3):
        raise ConfigError(f"sampling must be none, bminsep:P[:warm], cyclic-poisson:Q or poisson:P, got {text!r}")
    warm = False
    if len(parts) == 3:
        if _SCHEMES[kind] is not BMinSepSampling or parts[2] not in ("warm", "cold"):
            raise ConfigError(f"sampling must be none, bminsep:P[:warm] or cyclic-poisson:Q, got {text!r}")
        warm = parts[2] == "warm"
    try:
        probability = float(parts[1])
    except ValueError:
        raise ConfigError(f"sampling probability must be a number, got {parts[1]!r}") from None
    return Sampling(kind, probability, warm)


def check_banded(mechanism: "Mechanism", min_sep: int, what: str) -> int:
    """The bands of C, which amplification (``what``) needs square and banded with <= min_sep bands."""
    bands = mechanism.strategy_bands
    if bands is None:
        raise ConfigError(f"{what} amplification needs a banded strategy C; {mechanism.kind} is not banded")
    if bands > min_sep:
        raise ConfigError(f"{what} amplification needs bands <= min_sep, got {bands} bands > b={min_sep}")
    if mechanism.noise_rows != mechanism.rounds:
        raise ConfigError(f"{what} amplification needs a square strategy C ({mechanism.kind} is not)")
    return bands


def max_column_norm(mechanism: "Mechanism") -> float:
    """max_j ||C e_j||: the per-participation sensitivity of one amplified step."""
    return float(math.sqrt(max(mechanism.column_norms_sq())))
