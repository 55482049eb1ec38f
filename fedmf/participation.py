"""Participation schemas: which sets of rounds one user may contribute to.

* ``MinSep(b, k)``: rounds i < j of one user satisfy j - i >= b, at most k of them
  ("(k,b)-participation / b-min-separation", Choquette-Choo et al. 2023/2024).
* ``FixedEpoch(k, b)``: n = k·b and a user takes part exactly in rounds j, j+b, …
  (the optimal multi-epoch mechanism's assumption; Multi-Epoch MF, Sec. 2).
* ``Observed``: the rounds each user really took part in (post-hoc accounting).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .checks import positive_int
from .errors import ConfigError

__all__ = ["MinSep", "FixedEpoch", "Observed", "Schema", "schema_from_dict"]


@dataclass(frozen=True)
class MinSep:
    """At most ``max_participations`` rounds per user, consecutive ones >= ``min_sep`` apart."""

    min_sep: int
    max_participations: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_sep", positive_int("min_sep", self.min_sep))  # a numpy int is stored as int
        if self.max_participations is not None:
            object.__setattr__(self, "max_participations", positive_int("max_participations", self.max_participations))

    def participations(self, n: int) -> int:
        """The number of participations that really fit in n rounds: min(k, ceil(n/b))."""
        fit = math.ceil(n / self.min_sep)
        return fit if self.max_participations is None else min(self.max_participations, fit)

    def validate(self, n: int) -> None:
        positive_int("rounds", n)
        if self.min_sep > n:
            raise ConfigError(f"min_sep b={self.min_sep} exceeds the number of rounds n={n}")

    def allows(self, rounds: Iterable[int], n: int) -> bool:
        r = sorted(rounds)
        if any(t < 0 or t >= n for t in r) or len(r) > self.participations(n):
            return False
        return all(j - i >= self.min_sep for i, j in zip(r, r[1:]))

    @property
    def name(self) -> str:
        return "min-sep"

    def to_dict(self, n: int | None = None) -> dict:
        k = self.participations(n) if n is not None else self.max_participations
        return {"type": "min-sep", "min_sep": self.min_sep, "max_participations": k}


@dataclass(frozen=True)
class FixedEpoch:
    """n = k·b rounds; a user takes part in rounds j, j+b, …, j+(k-1)b for one slot j < b."""

    max_participations: int
    min_sep: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_participations", positive_int("max_participations", self.max_participations))
        object.__setattr__(self, "min_sep", positive_int("min_sep", self.min_sep))

    def participations(self, n: int) -> int:
        """The most rounds one user takes part in among the first n: min(k, ceil(n/b)) (slot 0 attains
        it); the whole run, n = k·b, gives k."""
        return min(self.max_participations, -(-n // self.min_sep))

    def validate(self, n: int) -> None:
        positive_int("rounds", n)
        if self.max_participations * self.min_sep != n:
            raise ConfigError(
                f"fixed-epoch needs rounds = participations x min_sep, got {n} != "
                f"{self.max_participations} x {self.min_sep}"
            )

    def patterns(self) -> list[list[int]]:
        k, b = self.max_participations, self.min_sep
        return [[j + e * b for e in range(k)] for j in range(b)]

    @property
    def name(self) -> str:
        return "fixed-epoch"

    def to_dict(self, n: int | None = None) -> dict:
        return {"type": "fixed-epoch", "min_sep": self.min_sep, "max_participations": self.max_participations}


@dataclass(frozen=True)
class Observed:
    """The rounds each user (by pseudonymous key) really took part in."""

    rounds_by_user: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Iterable[int]]) -> Observed:
        items = []
        for user, rounds in mapping.items():
            r = tuple(sorted(int(t) for t in rounds))
            if len(set(r)) != len(r):
                raise ConfigError(f"user {user!r} is listed twice in one round")
            items.append((str(user), r))
        return cls(tuple(sorted(items)))

    def validate(self, n: int) -> None:
        positive_int("rounds", n)
        for user, rounds in self.rounds_by_user:
            if rounds and (rounds[0] < 0 or rounds[-1] >= n):
                raise ConfigError(f"user {user!r} has a round outside [0, {n})")

    def participations(self, n: int) -> int:
        return max((len(r) for _, r in self.rounds_by_user), default=0)

    @property
    def min_sep(self) -> int | None:
        gaps = [j - i for _, r in self.rounds_by_user for i, j in zip(r, r[1:])]
        return min(gaps) if gaps else None

    @property
    def name(self) -> str:
        return "observed"

    def to_dict(self, n: int | None = None) -> dict:
        return {"type": "observed", "users": len(self.rounds_by_user), "min_sep": self.min_sep,
                "max_participations": self.participations(0)}


Schema = MinSep | FixedEpoch | Observed


def schema_from_dict(data: Mapping) -> Schema:
    kind = data.get("type")
    if kind == "min-sep":
        return MinSep(data["min_sep"], data.get("max_participations"))
    if kind == "fixed-epoch":
        return FixedEpoch(data["max_participations"], data["min_sep"])
    raise ConfigError(f"unknown participation schema {kind!r}")
