"""Mechanisms: immutable factorization descriptions, one module per family."""

from __future__ import annotations

from typing import Any

from ..participation import FixedEpoch, MinSep, Schema
from ..workloads import Workload
from .base import Mechanism
from .identity import DpSgd
from .toeplitz import (
    BandedInverseFractionalRoot,
    BandedInverseSquareRoot,
    BandedInverseToeplitz,
    BandedSquareRoot,
    BandedToeplitz,
    optimal_gamma,
)
from .tree import TreeAggregation

__all__ = ["Mechanism", "KINDS", "build", "mechanism_class", "default_bands"]

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
    )
}

#: kinds that ``build`` constructs from options (others are loaded from files or optimized)
KINDS = ("dp-sgd", "tree", "bsr", "bisr", "bifr")


def mechanism_class(kind: str) -> type[Mechanism]:
    try:
        return _CLASSES[kind]
    except KeyError:
        raise ValueError(f"unknown mechanism kind {kind!r} (known: {', '.join(sorted(_CLASSES))})") from None


def default_bands(rounds: int, schema: Schema) -> int:
    """Bands used when none are given: min(b, 64, n) (b bands is the most a banded C
    may have and keep its exact MinSep sensitivity; 64 bounds the noise memory)."""
    b = schema.min_sep if isinstance(schema, (MinSep, FixedEpoch)) else rounds
    return max(1, min(b, 64, rounds))


def build(
    kind: str,
    rounds: int,
    schema: Schema,
    workload: Workload = Workload(),
    num_bands: int | None = None,
    gamma: float | None = None,
) -> Mechanism:
    """Construct a closed-form mechanism; bifr without ``gamma`` searches gamma for ``schema``."""
    if kind not in KINDS:
        mechanism_class(kind)  # unknown kinds get the list of known ones
        raise ValueError(f"kind {kind!r} cannot be built here (buildable: {', '.join(KINDS)})")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    schema.validate(rounds)
    if gamma is not None and kind != "bifr":
        raise ValueError(f"--gamma applies to bifr only, not {kind}")
    if num_bands is not None and kind in ("dp-sgd", "tree"):
        raise ValueError(f"--bands does not apply to {kind}")
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
    from .toeplitz import _check_bands

    _check_bands(p, rounds)
    return optimal_gamma(rounds, p, schema, workload)


def from_params(kind: str, rounds: int, workload: Workload, params: dict[str, Any]) -> Mechanism:
    return mechanism_class(kind).from_params(rounds, workload, params)
