"""The base of the amplified samplers: every user of the population (registered or ever
seen available) flips its own coin, whether or not it is reachable."""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterable, Mapping

import numpy as np

from .. import checks
from ..errors import CheckpointError
from .base import Scheduler, canonical
from .state import int_list
from .stream import encode_id

__all__ = ["PopulationScheduler"]


class PopulationScheduler(Scheduler):
    """A scheme that samples the whole population: every user registered by ``add_users``
    or ever seen in ``available``. Users join at ``next_round``, sorted by id."""

    def __init__(self, key: bytes, max_participations: int | None) -> None:
        self.max_participations = (None if max_participations is None
                                   else checks.positive_int("max_participations", max_participations))
        super().__init__(key)
        self._ids: list[str] = []
        self._names: list[bytes] = []
        self._index: dict[str, int] = {}
        self._count = np.zeros(0, dtype=np.int64)

    @property
    def population(self) -> int:
        """Users registered so far."""
        return len(self._ids)

    def add_users(self, users: Iterable[Hashable]) -> int:
        """Register users (they join at ``next_round``); returns how many were new."""
        return self._join(self._next_round, canonical(users, "users"))

    def _join(self, t: int, users: dict[str, Hashable]) -> int:
        new = sorted(users.keys() - self._index.keys())
        if not new:
            return 0
        names = [encode_id(s) for s in new]
        start = len(self._ids)
        self._index.update(zip(new, range(start, start + len(new))))
        self._ids.extend(new)
        self._names.extend(names)
        self._count = np.concatenate([self._count, np.zeros(len(new), dtype=np.int64)])
        self._joined(t, names)
        return len(new)

    def _joined(self, t: int, names: list[bytes]) -> None:
        """Hook: per-user arrays for users that just joined at round t."""

    def _coins(self, t: int, candidates: np.ndarray, probability: float) -> np.ndarray:
        """Population indices of the candidates whose coin (probability ``probability``) shows heads."""
        u = self._stream.uniforms(b"coin", t, [self._names[i] for i in candidates])
        chosen = candidates[u < probability]
        self._count[chosen] += 1
        return chosen

    def _id_list(self, indices: np.ndarray) -> list[str]:
        return [self._ids[i] for i in indices]

    def _below_cap(self) -> np.ndarray:
        k = self.max_participations
        return np.ones(len(self._ids), dtype=bool) if k is None else self._count < k

    def _decide(self, t: int, users: dict[str, Hashable]) -> list[str]:
        self._join(t, users)
        return self._sample(t)

    @abc.abstractmethod
    def _sample(self, t: int) -> list[str]:
        """Ids selected in round t from the whole population; updates the state."""

    def _extra_state(self) -> dict:
        return {"users": list(self._ids), "count": self._count.tolist()}

    def _parse_population(self, state: Mapping) -> tuple[list[str], np.ndarray]:
        ids = state["users"]
        if not isinstance(ids, list) or not all(isinstance(s, str) for s in ids) or len(set(ids)) != len(ids):
            raise CheckpointError("users must be a list of distinct ids")
        count = int_list(state["count"], len(ids), "count")
        k = self.max_participations
        if np.any(count < 0) or (k is not None and np.any(count > k)):
            raise CheckpointError("count holds an impossible number of selections")
        return ids, count

    def _set_population(self, ids: list[str], count: np.ndarray) -> None:
        self._ids = list(ids)
        self._names = [encode_id(s) for s in ids]
        self._index = {s: i for i, s in enumerate(ids)}
        self._count = count
