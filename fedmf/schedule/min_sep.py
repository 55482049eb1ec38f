"""MinSep(b, k) enforcement with uniform selection (sampling ``none``; un-amplified)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

import numpy as np

from .. import checks
from ..errors import CheckpointError
from .base import Scheduler, canonical
from .state import nonneg
from .stream import encode_id

__all__ = ["MinSepSelection"]


class MinSepSelection(Scheduler):
    """Each round, a uniform ``users_per_round``-subset of the eligible available users:
    fewer than k selections so far and the last one >= b rounds back (MinSep(b, k))."""

    scheme = "min-sep"

    def __init__(self, min_sep: int, max_participations: int | None, users_per_round: int, key: bytes) -> None:
        self.min_sep = checks.positive_int("min_sep", min_sep)
        self.max_participations = (None if max_participations is None
                                   else checks.positive_int("max_participations", max_participations))
        self.users_per_round = checks.positive_int("users_per_round", users_per_round)
        super().__init__(key)
        self._history: dict[str, tuple[int, int]] = {}  # id -> (selections, last selected round)

    def describe(self) -> dict:
        return {"scheme": self.scheme, "min_sep": self.min_sep, "max_participations": self.max_participations,
                "users_per_round": self.users_per_round}

    def expected_users(self, population: int) -> float:
        """``users_per_round``: the planned count (fewer only when fewer are eligible)."""
        checks.integer("population", population, minimum=0)
        return float(self.users_per_round)

    def eligible(self, t: int, available: Iterable[Hashable]) -> int:
        """How many of ``available`` have fewer than k selections and none in the last b-1 rounds."""
        return len(self._eligible(t, canonical(available, "available users")))

    def _eligible(self, t: int, users: dict[str, Hashable]) -> list[str]:
        b, k, get = self.min_sep, self.max_participations, self._history.get
        eligible = []
        for s in users:
            h = get(s)  # (selections, last round) or None: never selected
            if h is None or (t - h[1] >= b and (k is None or h[0] < k)):
                eligible.append(s)
        return eligible

    def _decide(self, t: int, users: dict[str, Hashable]) -> list[str]:
        eligible = self._eligible(t, users)
        m = self.users_per_round
        if len(eligible) > m:
            # the m smallest keyed hashes form a uniform m-subset (ties, p ~ 2^-64, by id)
            w = self._stream.words(b"pick", t, [encode_id(s) for s in eligible])
            kth = np.partition(w, m - 1)[m - 1]
            chosen = [eligible[i] for i in np.flatnonzero(w < kth)]
            tied = sorted(eligible[i] for i in np.flatnonzero(w == kth))
            eligible = chosen + tied[: m - len(chosen)]
        for s in eligible:
            count = self._history.get(s, (0, 0))[0]
            self._history[s] = (count + 1, t)
        return eligible

    def _extra_state(self) -> dict:
        return {"history": {s: [c, last] for s, (c, last) in sorted(self._history.items())}}

    def _parse_state(self, state: Mapping, next_round: int) -> Callable[[], None]:
        raw = state["history"]
        if not isinstance(raw, dict):
            raise CheckpointError("history must be a dict")
        history: dict[str, tuple[int, int]] = {}
        k = self.max_participations
        for s, entry in raw.items():
            if not isinstance(entry, list) or len(entry) != 2:
                raise CheckpointError(f"history of {s!r} must be [selections, last round]")
            count, last = nonneg(entry[0]), nonneg(entry[1])
            if count == 0 or last >= next_round or (k is not None and count > k):
                raise CheckpointError(f"history of {s!r} is impossible: {entry!r}")
            history[str(s)] = (count, last)

        def apply() -> None:
            self._history = history

        return apply
