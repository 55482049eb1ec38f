"""Mechanisms: immutable factorization descriptions, one module per family."""

from __future__ import annotations

from typing import Any

from .. import checks
from ..errors import ConfigError
from ..participation import FixedEpoch, MinSep, Schema
from ..workloads import Workload
from .base import Mechanism, check_rounds
from .identity import DpSgd
from .toeplitz import (
    BandedInverseFractionalRoot,
    BandedInverseSquareRoot,
    BandedInverseToeplitz,
    BandedSquareRoot,
    BandedToeplitz,
    optimal_gamma,
)
from .optimize import OptimizationResult, ProgressCallback
from .robust import RobustToeplitz
from .tree import TreeAggregation

__all__ = ["Mechanism", "KINDS", "OPTIMIZED_KINDS", "BANDED_KINDS", "build", "plan", "mechanism_class", "default_bands"]

#: every kind a mechanism file may hold -> its class
_CLASSES: dict[str, type[Mechanism]] = {
    cls.kind: cls
    for cls in (
        DpSgd,
        TreeAggregation,
        BandedSquareRoot,
        BandedInverseSquareRoot,
        BandedInverseFractionalRoot,
        BandedToeplitz,
        BandedInverseToeplitz,
        RobustToeplitz,
    )
}


#: kinds whose modules import torch: loaded on first use so that the CLI starts fast
_LAZY: dict[str, tuple[str, str]] = {
    "dense": ("dense", "DenseMechanism"),
    "blt": ("blt", "BufferedLinearToeplitz"),
    "banded": ("banded", "ColumnNormalizedBanded"),
}


#: kinds built from closed forms by ``build``
CLOSED_FORM_KINDS = ("dp-sgd", "tree", "bsr", "bisr", "bifr")
#: kinds found by numerical optimization (``plan``)
OPTIMIZED_KINDS = ("banded-toeplitz", "banded", "blt", "dense", "robust")
#: every kind ``plan`` can produce
KINDS = CLOSED_FORM_KINDS + OPTIMIZED_KINDS
#: kinds whose number of bands is a parameter (every other kind refuses --bands)
BANDED_KINDS = ("bsr", "bisr", "bifr", "banded", "banded-toeplitz", "robust")


def mechanism_class(kind: str) -> type[Mechanism]:
    if kind not in _CLASSES and kind in _LAZY:
        import importlib

        module, name = _LAZY[kind]
        _CLASSES[kind] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    try:
        return _CLASSES[kind]
    except KeyError:
        known = sorted(set(_CLASSES) | set(_LAZY))
        raise ConfigError(f"unknown mechanism kind {kind!r} (known: {', '.join(known)})") from None


def default_bands(rounds: int, schema: Schema) -> int:
    """Bands used when none are given: min(b, 64, n) (b bands is the most a banded C
    may have and keep its exact MinSep sensitivity; 64 bounds the noise memory)."""
    b = schema.min_sep if isinstance(schema, (MinSep, FixedEpoch)) else rounds
    return max(1, min(b, 64, rounds))


def _check_bands(num_bands: Any, rounds: int) -> int | None:
    """``num_bands`` as an int in [1, rounds], or None."""
    return None if num_bands is None else checks.integer("num_bands", num_bands, minimum=1, maximum=rounds)


def _check_options(tolerance: float | None, max_steps: int | None, error: str, weighting: str) -> None:
    """The optimizer options ``plan`` passes on: checked here, so bad ones are a ConfigError."""
    if tolerance is not None:
        checks.positive("tolerance", tolerance)
    if max_steps is not None:
        checks.positive_int("max_steps", max_steps)
    checks.one_of("error", error, ("mean", "max"))
    checks.one_of("weighting", weighting, ("worst", "mean"))


def _check_bands_apply(kind: str, num_bands: int | None) -> None:
    if num_bands is not None and kind not in BANDED_KINDS:
        raise ConfigError(f"num_bands does not apply to {kind} (banded kinds: {', '.join(BANDED_KINDS)})")


def build(
    kind: str,
    rounds: int,
    schema: Schema,
    workload: Workload = Workload(),
    num_bands: int | None = None,
    gamma: float | None = None,
) -> Mechanism:
    """Construct a closed-form mechanism; bifr without ``gamma`` searches gamma for ``schema``."""
    if kind not in CLOSED_FORM_KINDS:
        mechanism_class(kind)  # unknown kinds get the list of known ones
        raise ConfigError(f"kind {kind!r} is optimized, not built from a closed form (use plan)")
    check_rounds(rounds)
    schema.validate(rounds)
    num_bands = _check_bands(num_bands, rounds)
    if gamma is not None and kind != "bifr":
        raise ConfigError(f"gamma applies to bifr only, not {kind}")
    _check_bands_apply(kind, num_bands)
    if kind == "dp-sgd":
        return DpSgd(rounds, workload)
    if kind == "tree":
        return TreeAggregation(rounds, workload)
    p = default_bands(rounds, schema) if num_bands is None else num_bands
    if kind == "bsr":
        return BandedSquareRoot(rounds, p, workload)
    if kind == "bisr":
        return BandedInverseSquareRoot(rounds, p, workload)
    if gamma is not None:
        return BandedInverseFractionalRoot(rounds, p, gamma, workload)
    return optimal_gamma(rounds, p, schema, workload)


def from_params(kind: str, rounds: int, workload: Workload, params: dict[str, Any]) -> Mechanism:
    return mechanism_class(kind).from_params(rounds, workload, params)


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

    Returns the mechanism and, for optimized kinds, what the optimizer reports."""
    if kind in CLOSED_FORM_KINDS:
        return build(kind, rounds, schema, workload, num_bands, gamma), None
    mechanism_class(kind)
    check_rounds(rounds)
    num_bands = _check_bands(num_bands, rounds)
    _check_bands_apply(kind, num_bands)
    _check_options(tolerance, max_steps, error, weighting)
    if gamma is not None:
        raise ConfigError(f"gamma applies to bifr only, not {kind}")
    options: dict[str, Any] = {"progress": progress}
    if tolerance is not None:
        options["tolerance"] = tolerance
    if max_steps is not None:
        options["max_steps"] = max_steps
    if kind == "dense":
        from .dense_optimize import optimize_dense

        if not isinstance(schema, FixedEpoch):
            raise ConfigError("dense is optimized for fixed-epoch participation (rounds = participations x min_sep)")
        return optimize_dense(rounds, schema, workload, device=device, **options)
    if not isinstance(schema, MinSep):
        raise ConfigError(f"{kind} is optimized for MinSep participation")
    if kind in ("banded-toeplitz", "robust") and not workload.is_toeplitz:
        raise ConfigError(f"{kind} optimization needs a Toeplitz workload (prefix or momentum without cooldown); "
                          "use kind 'banded' or 'dense' for a learning-rate cooldown")
    schema.validate(rounds)
    if kind == "blt":
        from .blt import DENSE_LIMIT, MAX_BUFFERS
        from .blt_optimize import optimize_blt

        if not workload.is_toeplitz and rounds > DENSE_LIMIT:
            raise ConfigError(f"a cooldown workload is optimized densely, up to n={DENSE_LIMIT} rounds (got {rounds})")
        if num_buffers is not None:
            num_buffers = checks.integer("num_buffers", num_buffers, minimum=1, maximum=MAX_BUFFERS)
        return optimize_blt(rounds, schema, workload, num_buffers=num_buffers, error=error, **options)
    p = default_bands(rounds, schema) if num_bands is None else num_bands
    if kind in ("banded-toeplitz", "banded") and p > schema.min_sep:
        raise ConfigError(f"{kind} needs num_bands p <= min_sep b under MinSep (got {p} > {schema.min_sep})")
    if kind == "banded-toeplitz":
        from .banded_toeplitz import optimize_banded_toeplitz

        return optimize_banded_toeplitz(rounds, p, schema, workload, error=error, **options)
    if kind == "banded":
        from .banded import optimize_banded

        return optimize_banded(rounds, p, schema, workload, **options)
    from .robust import optimize_robust, taper as taper_coefficients
    from .banded_toeplitz import optimize_banded_toeplitz

    if min_sep_range is None:
        raise ConfigError("robust needs a min_sep_range (B0, B1)")
    b0, b1 = min_sep_range
    k = schema.max_participations
    if taper:
        bt, result = optimize_banded_toeplitz(rounds, b1, MinSep(b1, k), workload, error=error, **options)
        coefficients = taper_coefficients(bt.coefficients, b0, b1)
        result.message = f"taper of banded-toeplitz optimized for min_sep {b1}: {result.message}"
        result.details["taper"] = True
        return RobustToeplitz(rounds, coefficients, b0, b1, workload), result
    return optimize_robust(
        rounds, b0, b1, workload, participations=k, num_bands=num_bands, weighting=weighting, error=error, **options
    )
