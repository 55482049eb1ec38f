"""A plan's scheduler: the sampler its accountant assumes, from its schema and sampling scheme.

``make_scheduler`` reads the scheme (``fedmf.sampling``) and dispatches on its type to one builder
per scheme (``BUILDERS``); the accountants read the same description (``fedmf.accounting.schemes``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

from ..errors import ConfigError
from ..participation import FixedEpoch, MinSep
from ..sampling import (
    BMinSepSampling,
    CyclicPoissonSampling,
    NoSampling,
    PlainPoissonSampling,
    Sampling,
    parse_sampling,
)
from .base import Scheduler
from .bminsep import BMinSepPoisson
from .cyclic_poisson import CyclicPoisson
from .fixed_epoch import FixedEpochOrder
from .min_sep import MinSepSelection
from .poisson import PoissonSampling

__all__ = ["make_scheduler", "BUILDERS"]

PlannedSchema = MinSep | FixedEpoch
Population = Iterable[Hashable] | None


def make_scheduler(schema: PlannedSchema, sampling: Sampling | str | None, *, key: bytes,
                   users_per_round: int | None = None, population: Population = None,
                   rounds: int | None = None) -> Scheduler:
    """The scheduler that realizes ``schema`` under ``sampling`` (what the accountant assumes).
    k = ``schema.participations(rounds)`` when ``rounds`` is given, else the schema's own k."""
    sampling = parse_sampling(sampling)
    if not isinstance(schema, (MinSep, FixedEpoch)):
        raise ConfigError(f"a scheduler follows a MinSep or FixedEpoch schema, not {type(schema).__name__}")
    if rounds is not None:
        schema.validate(rounds)
    k = schema.participations(rounds) if rounds is not None else schema.max_participations
    return BUILDERS[type(sampling)](sampling, schema, key, k, users_per_round, population)


def _refuse_users_per_round(sampling: Sampling, schema: PlannedSchema, users_per_round: int | None) -> None:
    if users_per_round is not None:
        raise ConfigError(f"users_per_round applies to MinSep without sampling; {schema.name} with sampling "
                          f"{sampling} decides the number of users itself")


def _no_sampling(sampling: NoSampling, schema: PlannedSchema, key: bytes, k: int | None, users_per_round: int | None,
                 population: Population) -> Scheduler:
    """MinSep: uniform ``users_per_round`` of the eligible users; FixedEpoch: the fixed-epoch order."""
    if isinstance(schema, FixedEpoch):
        _refuse_users_per_round(sampling, schema, users_per_round)
        if population is None:
            raise ConfigError("the fixed-epoch order needs the population (the users, fixed for the run)")
        return FixedEpochOrder(schema.min_sep, schema.max_participations, population, key)
    if users_per_round is None:
        raise ConfigError("MinSep without sampling needs users_per_round")
    return MinSepSelection(schema.min_sep, k, users_per_round, key)


def _sampled(make: Callable[[Sampling, PlannedSchema, bytes, int | None], Scheduler]):
    """An amplified scheme's builder: its sampler over the population (users added as they are seen)."""

    def build(sampling: Sampling, schema: PlannedSchema, key: bytes, k: int | None, users_per_round: int | None,
              population: Population) -> Scheduler:
        _refuse_users_per_round(sampling, schema, users_per_round)
        scheduler = make(sampling, schema, key, k)
        if population is not None:
            scheduler.add_users(population)
        return scheduler

    return build


def _bminsep(sampling: BMinSepSampling, schema: PlannedSchema, key: bytes, k: int | None) -> Scheduler:
    sampling.check_schema(schema)
    return BMinSepPoisson(schema.min_sep, sampling.probability, key, max_participations=k,
                          warm_start=sampling.warm_start)


def _cyclic_poisson(sampling: CyclicPoissonSampling, schema: PlannedSchema, key: bytes, k: int | None) -> Scheduler:
    return CyclicPoisson(schema.min_sep, sampling.probability, key, max_participations=k)


def _poisson(sampling: PlainPoissonSampling, schema: PlannedSchema, key: bytes, k: int | None) -> Scheduler:
    sampling.check_order(schema)
    if schema.min_sep != 1:
        raise ConfigError(f"poisson sampling (MMCC) samples every user in every round: plan it with "
                          f"MinSep(1, n), not min_sep={schema.min_sep}")
    return PoissonSampling(sampling.probability, key, max_participations=k)


#: {scheme class: its scheduler's builder}: one per scheme of ``fedmf.sampling.SCHEMES``
BUILDERS: dict[type[Sampling], Callable[..., Scheduler]] = {
    NoSampling: _no_sampling,
    BMinSepSampling: _sampled(_bminsep),
    CyclicPoissonSampling: _sampled(_cyclic_poisson),
    PlainPoissonSampling: _sampled(_poisson),
}
