"""Mechanisms: immutable factorization descriptions, one module per family.

Each kind's facts are attributes of its class (``Mechanism.made_by``, ``banded``, ``options``, …);
the one registry below lists the classes (and, for the optimized kinds whose solver has a module
of its own, that module); ``plan`` and ``fedmf mechanism`` read the facts, never a kind's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import checks
from ..errors import ConfigError
from ..participation import Schema
from ..workloads import Workload
from .banded import ColumnNormalizedBanded
from .base import CLOSED_FORM, OPTIMIZED, Mechanism, check_rounds, default_bands
from .identity import DpSgd
from .optimize import OptimizationResult, ProgressCallback
from .robust import RobustToeplitz
from .toeplitz import (
    BandedInverseFractionalRoot,
    BandedInverseSquareRoot,
    BandedInverseToeplitz,
    BandedSquareRoot,
    BandedToeplitz,
)
from .tree import TreeAggregation

__all__ = ["Mechanism", "KINDS", "CLOSED_FORM_KINDS", "OPTIMIZED_KINDS", "BANDED_KINDS", "build", "plan",
           "mechanism_class", "default_bands"]


@dataclass(frozen=True)
class _Solved:
    """An optimized kind whose solver has a module of its own beside the class (the solver imports
    the class, so the class cannot name it): the class, and that module, whose ``make`` stands for
    the class's. A class given as (module, name) is loaded on first use: its module imports torch,
    and importing this package (so starting the CLI) does not. Only kinds without bands are given
    so (``mechanism_class`` checks the loaded class), which BANDED_KINDS relies on."""

    cls: type[Mechanism] | tuple[str, str]
    solver: str
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", self.cls.kind)


_Entry = type[Mechanism] | _Solved

#: every kind a mechanism file may hold, in the order ``fedmf mechanism`` lists them
_REGISTRY: tuple[_Entry, ...] = (
    DpSgd,
    TreeAggregation,
    BandedSquareRoot,
    BandedInverseSquareRoot,
    BandedInverseFractionalRoot,
    _Solved(BandedToeplitz, "banded_toeplitz"),
    ColumnNormalizedBanded,
    _Solved(("blt", "BufferedLinearToeplitz"), "blt_optimize", kind="blt"),
    _Solved(("dense", "DenseMechanism"), "dense_optimize", kind="dense"),
    RobustToeplitz,
    BandedInverseToeplitz,
)
_ENTRIES: dict[str, _Entry] = {entry.kind: entry for entry in _REGISTRY}


def _class(entry: _Entry) -> type[Mechanism] | None:
    """The entry's class, or None while it is not loaded."""
    if isinstance(entry, _Solved):
        return entry.cls if isinstance(entry.cls, type) else None
    return entry


def _made_by(entry: _Entry) -> str | None:
    cls = _class(entry)
    return OPTIMIZED if cls is None else cls.made_by


#: kinds built from closed forms by ``build``
CLOSED_FORM_KINDS = tuple(kind for kind, entry in _ENTRIES.items() if _made_by(entry) == CLOSED_FORM)
#: kinds found by numerical optimization (``plan``)
OPTIMIZED_KINDS = tuple(kind for kind, entry in _ENTRIES.items() if _made_by(entry) == OPTIMIZED)
#: every kind ``plan`` can produce
KINDS = tuple(kind for kind, entry in _ENTRIES.items() if _made_by(entry) is not None)
#: kinds whose number of bands is a parameter (every other kind refuses num_bands)
BANDED_KINDS = tuple(kind for kind, entry in _ENTRIES.items() if (cls := _class(entry)) is not None and cls.banded)


def mechanism_class(kind: str) -> type[Mechanism]:
    """The class of ``kind`` (a ConfigError naming the known kinds for any other)."""
    try:
        entry = _ENTRIES[kind]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown mechanism kind {kind!r} (known: {', '.join(sorted(_ENTRIES))})") from None
    cls = _class(entry)
    if cls is None:
        module, name = entry.cls
        cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        if cls.kind != kind or cls.made_by != OPTIMIZED or cls.banded:
            raise TypeError(f"{module}.{name} is not the optimized kind {kind!r} without bands")
        _ENTRIES[kind] = _Solved(cls, entry.solver)
    return cls


def _make(kind: str) -> Callable[..., tuple[Mechanism, OptimizationResult | None]]:
    """How ``kind`` is made: its class's ``make``, or its solver module's."""
    cls, entry = mechanism_class(kind), _ENTRIES[kind]
    if isinstance(entry, _Solved):
        return importlib.import_module(f"{__name__}.{entry.solver}").make
    return cls.make


def from_params(kind: str, rounds: int, workload: Workload, params: dict[str, Any]) -> Mechanism:
    return mechanism_class(kind).from_params(rounds, workload, params)


def _check_bands(num_bands: Any, rounds: int) -> int | None:
    """``num_bands`` as an int in [1, rounds], or None."""
    return None if num_bands is None else checks.integer("num_bands", num_bands, minimum=1, maximum=rounds)


def _check_bands_apply(cls: type[Mechanism], num_bands: int | None) -> None:
    if num_bands is not None and not cls.banded:
        raise ConfigError(f"num_bands does not apply to {cls.kind} (banded kinds: {', '.join(BANDED_KINDS)})")


def _check_gamma(cls: type[Mechanism], gamma: float | None) -> None:
    if gamma is not None and "gamma" not in cls.options:
        takers = [kind for kind in CLOSED_FORM_KINDS if "gamma" in mechanism_class(kind).options]
        raise ConfigError(f"gamma applies to {', '.join(takers)} only, not {cls.kind}")


def _check_options(tolerance: float | None, max_steps: int | None, error: str, weighting: str) -> None:
    """The optimizer options ``plan`` passes on: checked here, so bad ones are a ConfigError."""
    if tolerance is not None:
        checks.positive("tolerance", tolerance)
    if max_steps is not None:
        checks.positive_int("max_steps", max_steps)
    checks.one_of("error", error, ("mean", "max"))
    checks.one_of("weighting", weighting, ("worst", "mean"))


def build(
    kind: str,
    rounds: int,
    schema: Schema,
    workload: Workload = Workload(),
    num_bands: int | None = None,
    gamma: float | None = None,
) -> Mechanism:
    """Construct a closed-form mechanism; bifr without ``gamma`` searches gamma for ``schema``."""
    cls = mechanism_class(kind)  # unknown kinds get the list of known ones
    if cls.made_by == OPTIMIZED:
        raise ConfigError(f"kind {kind!r} is optimized, not built from a closed form (use plan)")
    if cls.made_by is None:
        cls.make(rounds, schema, workload, num_bands)  # refuses: read from files only
    check_rounds(rounds)
    schema.validate(rounds)
    num_bands = _check_bands(num_bands, rounds)
    _check_gamma(cls, gamma)
    _check_bands_apply(cls, num_bands)
    return _make(kind)(rounds, schema, workload, num_bands, **({} if gamma is None else {"gamma": gamma}))[0]


def plan(
    kind: str,
    rounds: int,
    schema: Schema,
    workload: Workload = Workload(),
    *,
    num_bands: int | None = None,
    gamma: float | None = None,
    error: str = "mean",
    num_buffers: int | None = None,
    min_sep_range: tuple[int, int] | None = None,
    taper: bool = False,
    weighting: str = "worst",
    tolerance: float | None = None,
    max_steps: int | None = None,
    device: str | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[Mechanism, OptimizationResult | None]:
    """Build (closed forms) or optimize (the other kinds) a mechanism for ``schema``.

    Returns the mechanism and, for optimized kinds, what the optimizer reports. An option a
    kind does not read is ignored, except ``num_bands`` and ``gamma``, which are refused."""
    cls = mechanism_class(kind)
    if cls.made_by == CLOSED_FORM:
        return build(kind, rounds, schema, workload, num_bands, gamma), None
    if cls.made_by is None:
        return cls.make(rounds, schema, workload, num_bands)  # refuses: read from files only
    check_rounds(rounds)
    num_bands = _check_bands(num_bands, rounds)
    _check_bands_apply(cls, num_bands)
    _check_options(tolerance, max_steps, error, weighting)
    _check_gamma(cls, gamma)
    if not isinstance(schema, cls.planned_schema):
        raise ConfigError(f"{kind} is optimized for {cls.planned_schema.__name__} participation")
    if cls.toeplitz_workload_only and not workload.is_toeplitz:
        raise ConfigError(f"{kind} optimization needs a Toeplitz workload (prefix or momentum without cooldown); "
                          "use kind 'banded' or 'dense' for a learning-rate cooldown")
    schema.validate(rounds)
    p = default_bands(rounds, schema) if num_bands is None else num_bands
    if cls.bands_within_min_sep and p > schema.min_sep:
        raise ConfigError(f"{kind} needs num_bands p <= min_sep b under MinSep (got {p} > {schema.min_sep})")
    given = {"error": error, "num_buffers": num_buffers, "min_sep_range": min_sep_range, "taper": taper,
             "weighting": weighting, "tolerance": tolerance, "max_steps": max_steps, "device": device,
             "progress": progress}
    options = {name: given[name] for name in cls.options if given[name] is not None}
    return _make(kind)(rounds, schema, workload, num_bands, **options)
