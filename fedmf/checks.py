"""The checks every edge of the engine runs on what a user, a client or a file hands it.

Each check returns the value in its canonical type (``float``, ``int``, a layout dict, …) or
raises a ``FedmfError`` subclass with a one-line message naming the parameter (never a CLI
flag: the CLI may add the flag where it validates its own arguments). A wrong type raises
``ConfigTypeError`` (a ``ConfigError`` and a ``TypeError``); a wrong value ``ConfigError``.
Booleans are never numbers here, and NaN/±inf are never finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any, NoReturn

from .errors import CheckpointError, ConfigError, ConfigTypeError, FedmfError

__all__ = [
    "number", "positive", "non_negative", "integer", "positive_int", "interval", "probability", "open_unit",
    "one_of", "host_port",
    "FLOATING_DTYPES", "floating_dtypes", "is_floating", "layout", "state_format", "refuse_pickle", "load_tensors",
]

#: the floating dtypes a model, an update and the noise may use (torch names), with bytes per value
FLOATING_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _is_bool(value: object) -> bool:
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")  # numpy's bool too


def number(name: str, value: object) -> float:
    """``value`` as a finite float (ints and numpy scalars accepted; bools, NaN and ±inf refused)."""
    if _is_bool(value) or not isinstance(value, Real):
        raise ConfigTypeError(f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return out


def positive(name: str, value: object) -> float:
    """``value`` as a finite float > 0."""
    out = number(name, value)
    if out <= 0.0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return out


def non_negative(name: str, value: object) -> float:
    """``value`` as a finite float >= 0."""
    out = number(name, value)
    if out < 0.0:
        raise ConfigError(f"{name} must be non-negative, got {value!r}")
    return out


def integer(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum] (either bound optional; bools and floats refused)."""
    if _is_bool(value) or not isinstance(value, Integral):
        raise ConfigTypeError(f"{name} must be an integer, got {value!r}")
    out = int(value)
    if (minimum is not None and out < minimum) or (maximum is not None and out > maximum):
        low = "-inf" if minimum is None else str(minimum)
        high = "inf" if maximum is None else str(maximum)
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return out


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1."""
    if _is_bool(value) or not isinstance(value, Integral):
        raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def interval(name: str, value: object, low: float, high: float, *, low_open: bool = False,
             high_open: bool = False) -> float:
    """``value`` as a finite float between ``low`` and ``high`` (each end included unless
    ``low_open``/``high_open``; ``high`` may be ``math.inf``)."""
    out = number(name, value)
    if not ((out > low if low_open else out >= low) and (out < high if high_open else out <= high)):
        if high == math.inf:
            bound = f"be {'>' if low_open else '>='} {low}"
        else:
            bound = f"lie in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must {bound}, got {value!r}")
    return out


def probability(name: str, value: object) -> float:
    """``value`` as a probability in (0, 1] (a sampling probability: 0 would sample no one)."""
    return interval(name, value, 0, 1, low_open=True)


def open_unit(name: str, value: object) -> float:
    """``value`` in the open interval (0, 1) (a δ, a confidence, a fraction)."""
    return interval(name, value, 0, 1, low_open=True, high_open=True)


def one_of(name: str, value: object, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if _is_bool(value) or value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def host_port(name: str, value: object) -> str:
    """``value`` as a network address ``HOST:PORT`` (``[IPv6]:PORT`` for an IPv6 host): a host of
    letters, digits, ``.``, ``-``, ``_`` (or an IPv6 address in brackets) and a port in [1, 65535].
    No scheme (``ray://``, ``http://``), no path, no whitespace."""
    if not isinstance(value, str):
        raise ConfigTypeError(f"{name} must be an address HOST:PORT, got {value!r}")
    host, sep, port = value.rpartition(":")
    ipv6 = host.startswith("[") and host.endswith("]") and len(host) > 2 and \
        all(c in "0123456789abcdefABCDEF:." for c in host[1:-1])
    named = bool(host) and all(c.isascii() and (c.isalnum() or c in ".-_") for c in host) and \
        not host.startswith(("-", "."))
    if not sep or not (ipv6 or named) or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{name} must be an address HOST:PORT with a port in [1, 65535], got {value!r}")
    return f"{host}:{int(port)}"


def floating_dtypes() -> tuple[Any, ...]:
    """``FLOATING_DTYPES`` as torch dtypes (torch is imported here, not by every user of the checks)."""
    import torch

    return tuple(getattr(torch, dtype) for dtype in FLOATING_DTYPES)


def is_floating(dtype: object) -> bool:
    """Whether ``dtype`` (a torch dtype) is one of ``FLOATING_DTYPES``."""
    return dtype in floating_dtypes()


def layout(value: object, name: str = "layout") -> dict[str, tuple[int, ...]]:
    """A model layout: a non-empty mapping parameter name -> shape (non-negative ints) holding
    at least one value."""
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{name} must be a non-empty mapping name -> shape")
    out = {}
    for key, shape in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"{name} names must be strings, got {key!r}")
        if isinstance(shape, (str, bytes)):
            raise ConfigError(f"{name} shape of {key!r} must be a tuple of ints, got {shape!r}")
        try:
            dims = tuple(shape)
        except TypeError:
            raise ConfigError(f"{name} shape of {key!r} must be a tuple of ints, got {shape!r}") from None
        if any(_is_bool(x) or not isinstance(x, Integral) or x < 0 for x in dims):
            raise ConfigError(f"{name} shape of {key!r} must be non-negative ints, got {shape!r}")
        out[key] = tuple(int(x) for x in dims)
    if sum(math.prod(s) for s in out.values()) == 0:
        raise ConfigError(f"{name} has no parameters")
    return out


def state_format(state: object, what: str, accepted: object | Iterable[object], *,
                 error: type[FedmfError] = CheckpointError) -> Any:
    """The ``format`` field of a saved state (a mapping) if it is one this fedmf reads
    (``accepted``: one format or several); otherwise ``error`` naming ``what`` the state is."""
    formats = tuple(accepted) if isinstance(accepted, (tuple, list, set, frozenset)) else (accepted,)
    if not isinstance(state, Mapping):
        raise error(f"{what} must be a mapping, got {type(state).__name__}")
    got = state.get("format")
    if _is_bool(got) or got not in formats:
        reads = " or ".join(map(repr, formats))
        raise error(f"{what} has format {got!r}; this fedmf reads {reads}")
    return got


def refuse_pickle(obj: object, *, instead: str | None = None) -> NoReturn:
    """The body of ``__reduce__`` for an object that holds a secret: it is never pickled (into a
    checkpoint, a multiprocessing queue, …); ``instead`` says what to save (e.g. its ``state_dict()``)."""
    hint = "" if instead is None else f"; {instead} instead"
    raise ConfigTypeError(f"{type(obj).__name__} holds a secret and cannot be pickled{hint}")


def load_tensors(source: Any, where: str, *, error: type[FedmfError] = CheckpointError) -> Any:
    """``torch.load`` of a file or buffer with ``weights_only=True``: tensors and plain containers
    only, never a pickled object (which would run code); any failure is ``error`` naming ``where``."""
    import torch

    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds on a damaged or pickled file
        raise error(f"cannot read {where}: {type(e).__name__}") from None
