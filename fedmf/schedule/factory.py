"""A plan's scheduler: the sampler its accountant assumes, from its schema and sampling scheme."""

from __future__ import annotations

from typing import Hashable, Iterable

from ..accounting.sampling import Sampling, parse_sampling
from ..errors import ConfigError
from ..participation import FixedEpoch, MinSep
from .base import Scheduler

__all__ = ["make_scheduler"]


def make_scheduler(schema: MinSep | FixedEpoch, sampling: Sampling | str | None, *, key: bytes,
                   users_per_round: int | None = None, population: Iterable[Hashable] | None = None,
                   rounds: int | None = None) -> Scheduler:
    """The scheduler that realizes ``schema`` under ``sampling`` (what the accountant assumes;
    ``Sampling.scheduler``). k = ``schema.participations(rounds)`` when ``rounds`` is given,
    else the schema's own k."""
    sampling = parse_sampling(sampling)
    if not isinstance(schema, (MinSep, FixedEpoch)):
        raise ConfigError(f"a scheduler follows a MinSep or FixedEpoch schema, not {type(schema).__name__}")
    if rounds is not None:
        schema.validate(rounds)
    k = schema.participations(rounds) if rounds is not None else schema.max_participations
    return sampling.scheduler(schema, key=key, max_participations=k, users_per_round=users_per_round,
                              population=population)
