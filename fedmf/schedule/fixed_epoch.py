"""The fixed-epoch order (sampling ``none``, schema ``FixedEpoch(k, b)``; "Multi-Epoch Matrix
Factorization Mechanisms", Sec. 2: user slot j takes part in rounds j, j+b, ...)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Iterable

import numpy as np

from .. import checks
from ..errors import ConfigError, HorizonReached
from .base import Scheduler, canonical
from .stream import encode_id

__all__ = ["FixedEpochOrder"]


class FixedEpochOrder(Scheduler):
    """FixedEpoch(k, b): a keyed secret shuffle splits the fixed population into b slots
    of sizes differing by at most 1; round t < k·b takes all of slot t mod b."""

    scheme = "fixed-epoch"

    def __init__(self, min_sep: int, epochs: int, population: Iterable[Hashable], key: bytes) -> None:
        self.min_sep = checks.positive_int("min_sep", min_sep)
        self.epochs = checks.positive_int("epochs", epochs)
        ids = sorted(canonical(population, "population users"))
        if not ids:
            raise ConfigError("the fixed-epoch population is empty")
        super().__init__(key)
        # Rank by keyed hash (ties by id): a uniformly random order; rank r goes to slot r mod b.
        w = self._stream.words(b"slot", 0, [encode_id(s) for s in ids])
        order = np.argsort(w, kind="stable")
        slots: list[list[str]] = [[] for _ in range(self.min_sep)]
        for r, i in enumerate(order):
            slots[r % self.min_sep].append(ids[i])
        self._slots = tuple(tuple(sorted(s)) for s in slots)
        self._slot_index = {s: j for j, members in enumerate(self._slots) for s in members}
        self._population = len(ids)
        self._population_sha256 = hashlib.sha256(json.dumps(ids).encode()).hexdigest()

    @property
    def population(self) -> int:
        return self._population

    def describe(self) -> dict:
        return {"scheme": self.scheme, "min_sep": self.min_sep, "epochs": self.epochs,
                "population": self._population}

    def _state_params(self) -> dict:
        return {**super()._state_params(), "population_sha256": self._population_sha256}

    def expected_users(self, population: int) -> float:
        """N/b: each user exactly once per epoch of b rounds (Multi-Epoch MF, Sec. 2)."""
        return checks.integer("population", population, minimum=0) / self.min_sep

    def slot_of(self, user: Hashable) -> int | None:
        """The user's slot (rounds ≡ slot mod b), None outside the population."""
        return self._slot_index.get(str(user))

    def eligible(self, t: int, available: Iterable[Hashable]) -> int | None:
        """How many of round t's slot are in ``available`` (None past the order's last round)."""
        if t >= self.epochs * self.min_sep:
            return None  # select() refuses the round
        users = canonical(available, "available users")
        return sum(s in users for s in self._slots[t % self.min_sep])

    def _decide(self, t: int, users: dict[str, Hashable]) -> list[str]:
        if t >= self.epochs * self.min_sep:
            raise HorizonReached(f"fixed-epoch order covers rounds 0..{self.epochs * self.min_sep - 1}, not round {t}")
        return list(self._slots[t % self.min_sep])
