"""Argument checks of the schedulers: bad input raises a one-line ``ConfigError`` (a round
out of order ``RoundOrderError``)."""

from __future__ import annotations

import math
from typing import Hashable, Iterable

import numpy as np

from ..errors import ConfigError, RoundOrderError

__all__ = ["positive_int", "optional_int", "unit_probability", "round_index", "canonical", "population_arg"]


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def optional_int(name: str, value: object) -> int | None:
    return None if value is None else positive_int(name, value)


def unit_probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}")
    p = float(value)
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise ConfigError(f"{name} must lie in (0, 1], got {value!r}")
    return p


def round_index(t: object) -> int:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise RoundOrderError(f"a round must be an integer, got {t!r}")
    return int(t)


def canonical(users: Iterable[Hashable], what: str) -> dict[str, Hashable]:
    """{str(user): user}; duplicates of one user collapse, two users with one id are refused."""
    if isinstance(users, (str, bytes)) or not isinstance(users, Iterable):
        raise ConfigError(f"{what} must be a collection of users (e.g. range(N)), not {type(users).__name__}")
    items = users if isinstance(users, (list, tuple)) else list(users)
    ids = list(map(str, items))
    out = dict(zip(ids, items))
    if len(out) != len(items):
        for s, u in zip(ids, items):
            v = out[s]
            if v is not u and v != u:
                raise ConfigError(f"two {what} share the id {s!r} (identity is str(user))")
    return out


def population_arg(population: object) -> int:
    if isinstance(population, bool) or not isinstance(population, (int, np.integer)) or population < 0:
        raise ConfigError(f"population must be a non-negative integer, got {population!r}")
    return int(population)
