"""Poisson sampling in every round (``poisson:P``; MMCC, Choquette-Choo et al. 2023)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .. import checks
from .population import PopulationScheduler

__all__ = ["PoissonSampling"]


class PoissonSampling(PopulationScheduler):
    """Poisson sampling in every round (MMCC's assumption): every population user is
    selected independently with probability p in every round. No min-sep; an optional cap
    ``max_participations`` as in ``CyclicPoisson``."""

    scheme = "poisson"

    def __init__(self, probability: float, key: bytes, max_participations: int | None = None) -> None:
        self.probability = checks.probability("poisson probability", probability)
        super().__init__(key, max_participations)

    def describe(self) -> dict:
        return {"scheme": self.scheme, "probability": self.probability,
                "max_participations": self.max_participations}

    def expected_users(self, population: int) -> float:
        """p·N (Poisson sampling with rate p; MMCC, arXiv 2310.15526 §2)."""
        return self.probability * checks.integer("population", population, minimum=0)

    def _sample(self, t: int) -> list[str]:
        return self._id_list(self._coins(t, np.flatnonzero(self._below_cap()), self.probability))

    def _parse_state(self, state: Mapping, next_round: int) -> Callable[[], None]:
        ids, count = self._parse_population(state)
        return lambda: self._set_population(ids, count)
