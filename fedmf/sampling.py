"""How clients are sampled: one immutable description per scheme, as dp_accounting describes a DpEvent.

* ``NoSampling`` (``none``): un-amplified, any schedule that respects the participation schema;
* ``BMinSepSampling`` (``bminsep:P[:warm]``): b-min-sep Poisson sampling with probability P,
  b = the schema's min_sep (Dong & Ganesh, arXiv 2602.09338);
* ``CyclicPoissonSampling`` (``cyclic-poisson:Q``): b groups in turn, each client of the active
  group included with probability Q ("Scaling up BandMF", Alg. 2);
* ``PlainPoissonSampling`` (``poisson:P``): every client in every round with probability P
  (MMCC, Choquette-Choo et al., arXiv 2310.15526).

A scheme is data: its string form (``str``, read back by ``parse_sampling``: the form the CLI,
config files, the ledger and checkpoints store; ``GRAMMAR`` spells them all), whether its ε relies
on the sampling, and the schemas it follows. Interpreters read it: ``fedmf.schedule.make_scheduler``
builds its scheduler, ``fedmf.accounting.schemes`` its ε, calibration and per-round curve. This
module imports neither of them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from . import checks
from .errors import ConfigError
from .participation import FixedEpoch, MinSep, Schema

__all__ = [
    "Sampling", "NoSampling", "BMinSepSampling", "CyclicPoissonSampling", "PlainPoissonSampling", "parse_sampling",
    "NONE", "SCHEMES", "GRAMMAR",
]


class _ByParts(abc.ABCMeta):
    """``Sampling(kind, probability, warm_start)`` builds the scheme of that kind (the parts of
    its string form); a scheme class is called with its own parameters."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Sampling:
            return _from_parts(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Sampling(metaclass=_ByParts):
    """A sampling scheme (immutable). ``kind``: the first part of its string form; ``form``: its
    string form with placeholders (a part of ``GRAMMAR``)."""

    kind: ClassVar[str]
    form: ClassVar[str]
    #: whether the accountant's ε relies on the sampling (and its secrecy)
    amplified: ClassVar[bool]
    #: whether the scheme may follow a FixedEpoch schema (else it is planned with MinSep)
    follows_fixed_epoch: ClassVar[bool]

    @property
    def observed_guard(self) -> bool:
        """Whether the worst user's observed ε (accounted from the ledger's participations) is a
        valid ε and guards each round: only for un-amplified runs, where ε holds for every
        participation pattern the schema allows."""
        return not self.amplified

    def check_order(self, schema: Schema) -> None:
        """Refuse a FixedEpoch schema where the scheme does not follow the fixed-epoch order."""
        if isinstance(schema, FixedEpoch) and not self.follows_fixed_epoch:
            raise ConfigError(f"{self.kind} sampling does not follow the fixed-epoch order; plan it with MinSep")

    def check_schema(self, schema: Schema) -> None:
        """Refuse a planned schema this scheme does not follow."""
        self.check_order(schema)

    def min_sep_of(self, schema: Schema) -> int:
        """b of an amplified scheme: the schema's min_sep (MinSep; FixedEpoch where it follows it)."""
        if isinstance(schema, MinSep) or (isinstance(schema, FixedEpoch) and self.follows_fixed_epoch):
            return schema.min_sep
        raise ConfigError(f"{self.kind} sampling needs a min-sep schema (got {schema.name})")


@dataclass(frozen=True)
class NoSampling(Sampling):
    """``none``: un-amplified; any schedule that respects the schema."""

    kind: ClassVar[str] = "none"
    form: ClassVar[str] = "none"
    amplified: ClassVar[bool] = False
    follows_fixed_epoch: ClassVar[bool] = True
    probability: ClassVar[None] = None
    warm_start: ClassVar[bool] = False

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True)
class _Sampled(Sampling):
    """An amplified scheme: each user of the whole population is sampled with ``probability``."""

    probability: float
    amplified: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "probability", checks.probability(f"{self.kind} probability", self.probability))

    def __str__(self) -> str:
        return f"{self.kind}:{self.probability:g}"


@dataclass(frozen=True)
class BMinSepSampling(_Sampled):
    """``bminsep:P[:warm]``: b-min-sep Poisson sampling (Dong & Ganesh, Alg. 1 cold / Alg. 2 warm start)."""

    warm_start: bool = False
    kind: ClassVar[str] = "bminsep"
    form: ClassVar[str] = "bminsep:P[:warm]"
    follows_fixed_epoch: ClassVar[bool] = False

    def __str__(self) -> str:
        return super().__str__() + (":warm" if self.warm_start else "")


@dataclass(frozen=True)
class CyclicPoissonSampling(_Sampled):
    """``cyclic-poisson:Q``: b groups in turn, each client of the active group with probability Q
    ("Scaling up BandMF", Alg. 2). A FixedEpoch schema's b slots are cyclic groups too."""

    kind: ClassVar[str] = "cyclic-poisson"
    form: ClassVar[str] = "cyclic-poisson:Q"
    follows_fixed_epoch: ClassVar[bool] = True
    warm_start: ClassVar[bool] = False


@dataclass(frozen=True)
class PlainPoissonSampling(_Sampled):
    """``poisson:P``: Poisson sampling of every user in every round, planned with MinSep(1, n)."""

    kind: ClassVar[str] = "poisson"
    form: ClassVar[str] = "poisson:P"
    follows_fixed_epoch: ClassVar[bool] = False
    warm_start: ClassVar[bool] = False

    def check_schema(self, schema: Schema) -> None:
        if not (isinstance(schema, MinSep) and schema.min_sep == 1):
            raise ConfigError("poisson sampling (MMCC) samples every user in every round: plan it with MinSep(1, n)")
        super().check_schema(schema)


NONE = NoSampling()
#: {kind: scheme class}: every scheme there is
SCHEMES: dict[str, type[Sampling]] = {
    cls.kind: cls for cls in (NoSampling, BMinSepSampling, CyclicPoissonSampling, PlainPoissonSampling)}
#: the string forms of all schemes, as the CLI's help, the config's docs and every error spell them
GRAMMAR = " | ".join(cls.form for cls in SCHEMES.values())


def _from_parts(kind: str = "none", probability: float | None = None, warm_start: bool = False) -> Sampling:
    """The scheme of ``kind`` with ``probability`` (and ``warm_start``, bminsep only)."""
    scheme = SCHEMES.get(kind)
    if scheme is None:
        raise ConfigError(f"unknown sampling {kind!r} (use {GRAMMAR})")
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
    """A scheme from its string form (``GRAMMAR``); None is ``none``; a scheme is returned as is."""
    if text is None:
        return NONE
    if isinstance(text, Sampling):
        return text
    parts = str(text).strip().split(":")
    kind = parts[0]
    if kind == NoSampling.kind and len(parts) == 1:
        return NONE
    if kind not in SCHEMES or not SCHEMES[kind].amplified or len(parts) not in (2, 3):
        raise ConfigError(f"sampling must be {GRAMMAR}, got {text!r}")
    warm = False
    if len(parts) == 3:
        if SCHEMES[kind] is not BMinSepSampling or parts[2] not in ("warm", "cold"):
            raise ConfigError(f"sampling must be {GRAMMAR}, got {text!r}")
        warm = parts[2] == "warm"
    try:
        probability = float(parts[1])
    except ValueError:
        raise ConfigError(f"sampling probability must be a number, got {parts[1]!r}") from None
    return Sampling(kind, probability, warm)
