"""How clients are sampled, as the accountants see it: ``none`` (un-amplified: any
schedule that respects the participation schema), ``bminsep:P[:warm]`` (b-min-sep Poisson
sampling with probability P, b = the schema's min_sep), ``cyclic-poisson:Q`` (b groups
in turn, each client of the active group included with probability Q) and ``poisson:P``
(every client in every round with probability P; MMCC, ``accounting.mmcc``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .. import checks

if TYPE_CHECKING:
    from ..mechanisms.base import Mechanism
    from ..participation import Schema

__all__ = ["Sampling", "parse_sampling", "NONE", "amplification_min_sep", "check_banded", "max_column_norm"]

KINDS = ("none", "bminsep", "cyclic-poisson", "poisson")


@dataclass(frozen=True)
class Sampling:
    kind: str = "none"
    probability: float | None = None
    warm_start: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown sampling {self.kind!r} (use none, bminsep:P, cyclic-poisson:Q or poisson:P)")
        if self.kind == "none":
            if self.probability is not None or self.warm_start:
                raise ConfigError("sampling 'none' takes no probability")
            return
        object.__setattr__(self, "probability", checks.probability(f"{self.kind} probability", self.probability))
        if self.warm_start and self.kind != "bminsep":
            raise ConfigError("warm start applies to bminsep sampling only")

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        return f"{self.kind}:{self.probability:g}" + (":warm" if self.warm_start else "")

    @property
    def amplified(self) -> bool:
        return self.kind != "none"


NONE = Sampling()


def parse_sampling(text: str | Sampling | None) -> Sampling:
    """'none' | 'bminsep:P' | 'bminsep:P:warm' | 'cyclic-poisson:Q'."""
    if text is None:
        return NONE
    if isinstance(text, Sampling):
        return text
    parts = str(text).strip().split(":")
    kind = parts[0]
    if kind == "none" and len(parts) == 1:
        return NONE
    if kind not in ("bminsep", "cyclic-poisson", "poisson") or len(parts) not in (2, 3):
        raise ConfigError(f"sampling must be none, bminsep:P[:warm], cyclic-poisson:Q or poisson:P, got {text!r}")
    warm = False
    if len(parts) == 3:
        if kind != "bminsep" or parts[2] not in ("warm", "cold"):
            raise ConfigError(f"sampling must be none, bminsep:P[:warm] or cyclic-poisson:Q, got {text!r}")
        warm = parts[2] == "warm"
    try:
        probability = float(parts[1])
    except ValueError:
        raise ConfigError(f"sampling probability must be a number, got {parts[1]!r}") from None
    return Sampling(kind, probability, warm)


def amplification_min_sep(schema: "Schema", sampling: Sampling) -> int:
    """b of an amplified ``sampling``: the schema's min_sep (MinSep; FixedEpoch for cyclic Poisson)."""
    from ..participation import FixedEpoch, MinSep

    if isinstance(schema, MinSep) or (isinstance(schema, FixedEpoch) and sampling.kind == "cyclic-poisson"):
        return schema.min_sep
    raise ConfigError(f"{sampling.kind} sampling needs a min-sep schema (got {schema.name})")


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
