"""Cyclic Poisson sampling (``cyclic-poisson:Q``; Choquette-Choo et al., "Scaling up BandMF", Alg. 2)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import numpy as np

from .. import checks
from .population import PopulationScheduler
from .stream import encode_id

__all__ = ["CyclicPoisson"]


class CyclicPoisson(PopulationScheduler):
    """Cyclic Poisson sampling ("Scaling up BandMF", Alg. 2): users fall into b groups by
    keyed hash (group = w mod b, fixed for the run); in round t group t mod b is active and
    each of its users is selected independently with probability p. With
    ``max_participations`` k a user is not selected after its k-th selection (zero updates
    from then on, which the per-step Poisson accounting dominates)."""

    scheme = "cyclic-poisson"

    def __init__(self, min_sep: int, probability: float, key: bytes, max_participations: int | None = None) -> None:
        self.min_sep = checks.positive_int("min_sep", min_sep)
        self.probability = checks.probability("cyclic-poisson probability", probability)
        super().__init__(key, max_participations)
        self._group = np.zeros(0, dtype=np.int64)

    def describe(self) -> dict:
        return {"scheme": self.scheme, "min_sep": self.min_sep, "probability": self.probability,
                "max_participations": self.max_participations}

    def expected_users(self, population: int) -> float:
        """p·N/b: one group of about N/b users, each with probability p (Alg. 2)."""
        return self.probability * checks.integer("population", population, minimum=0) / self.min_sep

    def group_of(self, user: Hashable) -> int:
        """The user's group (active in rounds ≡ group mod b)."""
        return int(self._groups([encode_id(str(user))])[0])

    def _groups(self, names: list[bytes]) -> np.ndarray:
        return (self._stream.words(b"group", 0, names) % np.uint64(self.min_sep)).astype(np.int64)

    def _joined(self, t: int, names: list[bytes]) -> None:
        self._group = np.concatenate([self._group, self._groups(names)])

    def _sample(self, t: int) -> list[str]:
        candidates = np.flatnonzero((self._group == t % self.min_sep) & self._below_cap())
        return self._id_list(self._coins(t, candidates, self.probability))

    def _parse_state(self, state: Mapping, next_round: int) -> Callable[[], None]:
        ids, count = self._parse_population(state)

        def apply() -> None:
            self._set_population(ids, count)
            self._group = self._groups(self._names)

        return apply
