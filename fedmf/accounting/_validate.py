"""Argument checks shared by the accountants: bad input raises a one-line ValueError."""

from __future__ import annotations

import math
from numbers import Integral, Real

from ..errors import ConfigError

__all__ = ["delta", "epsilon", "noise", "probability", "positive_int", "finite"]


def finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return value


def delta(value: object, name: str = "delta") -> float:
    value = finite(name, value)
    if not 0.0 < value < 1.0:
        raise ConfigError(f"{name} must lie in (0, 1), got {value!r}")
    return value


def epsilon(value: object, name: str = "epsilon") -> float:
    value = finite(name, value)
    if value <= 0.0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return value


def noise(value: object, name: str = "noise multiplier") -> float:
    value = finite(name, value)
    if value <= 0.0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return value


def probability(value: object, name: str = "sampling probability") -> float:
    value = finite(name, value)
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{name} must lie in (0, 1], got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
