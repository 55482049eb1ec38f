"""b-min-sep Poisson sampling (``bminsep:P[:warm]``; Dong & Ganesh, "Privacy Amplification for
BandMF via b-Min-Sep Subsampling", Alg. 1 cold / Alg. 2 warm start)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .. import checks
from ..errors import CheckpointError, ConfigError
from .population import PopulationScheduler
from .state import int_list

__all__ = ["BMinSepPoisson"]


class BMinSepPoisson(PopulationScheduler):
    """b-min-sep Poisson sampling (Dong & Ganesh, Alg. 1 cold start / Alg. 2 warm start):
    in round t every population user not selected in rounds t-b+1 … t-1 is selected
    independently with probability p, whether or not it is reachable.

    Cold start: every user is eligible at round 0; warm start: its chain starts in the
    stationary law (Alg. 2), as ``accounting.bminsep`` assumes for ``bminsep:P:warm``. A user
    who joins at round t0 > 0 draws its chain state from the chain's law at t0, so its
    selections are distributed exactly as in a run from round 0 in which it dropped out before
    t0. With ``max_participations`` k a user is not selected after its k-th selection: Alg. 1
    with zero updates after the k-th (dominated like a dropout, notes §7.1 item 2), and the
    un-amplified fallback's MinSep(b, k) holds."""

    scheme = "bminsep"

    def __init__(self, min_sep: int, probability: float, key: bytes, max_participations: int | None = None,
                 warm_start: bool = False) -> None:
        self.min_sep = checks.positive_int("min_sep", min_sep)
        self.probability = checks.probability("bminsep probability", probability)
        if not isinstance(warm_start, bool):
            raise ConfigError(f"warm_start must be True or False, got {warm_start!r}")
        self.warm_start = warm_start
        super().__init__(key, max_participations)
        self._last = np.zeros(0, dtype=np.int64)  # last (possibly virtual) selection round
        self._law_at: tuple[int, np.ndarray] = (0, self._initial_law())

    def describe(self) -> dict:
        return {"scheme": self.scheme, "min_sep": self.min_sep, "probability": self.probability,
                "max_participations": self.max_participations, "warm_start": self.warm_start}

    def expected_users(self, population: int) -> float:
        """Stationary rate p0·N, p0 = p/(1+(b-1)p) (Dong & Ganesh §3.2, Fig. 1 chain: 1/p0 = 1/p + b-1)."""
        p, b = self.probability, self.min_sep
        return p / (1.0 + (b - 1) * p) * checks.integer("population", population, minimum=0)

    # ---- the per-user chain (Dong & Ganesh §3.2, Fig. 1) ---------------------------
    # State s at the start of a round: 0 = eligible, s >= 1 = barred for s more rounds.
    # 0 -> b-1 w.p. p (a selection), 0 -> 0 w.p. 1-p, s -> s-1 for s >= 1.
    def _initial_law(self) -> np.ndarray:
        """Law of s at round 0: cold start s = 0 (Alg. 1); warm start the stationary law
        π_0 = 1/(1+(b-1)p), π_s = p/(1+(b-1)p) for s = 1..b-1 (Alg. 2)."""
        b, p = self.min_sep, self.probability
        law = np.zeros(b)
        if self.warm_start:
            law[:] = p / (1.0 + (b - 1) * p)
            law[0] = 1.0 / (1.0 + (b - 1) * p)
        else:
            law[0] = 1.0
        return law

    def _law(self, t: int) -> np.ndarray:
        """Law of the chain state at round t (initial law · Mᵗ; the warm law is stationary)."""
        if self.warm_start or self.min_sep == 1:
            return self._initial_law()
        r, law = self._law_at  # rounds only increase; load_state_dict resets this cache
        p = self.probability
        while r < t:
            nxt = np.empty_like(law)
            nxt[0] = (1.0 - p) * law[0] + law[1]
            nxt[1:-1] = law[2:]
            nxt[-1] = p * law[0]
            law, r = nxt, r + 1
        self._law_at = (r, law)
        return law

    def _joined(self, t: int, names: list[bytes]) -> None:
        # A user joining at round t gets its chain state drawn from the chain's law at round t,
        # so its selections from t on have exactly the law of Alg. 1/2 run from round 0 in
        # which the rounds before t were dropouts (zero contributions): what the accountant models.
        u = self._stream.uniforms(b"join", t, names)
        b = self.min_sep
        s = np.minimum(np.searchsorted(np.cumsum(self._law(t)), u, side="right"), b - 1)
        self._last = np.concatenate([self._last, t - b + s.astype(np.int64)])

    def _sample(self, t: int) -> list[str]:
        eligible = (t - self._last >= self.min_sep) & self._below_cap()
        candidates = np.flatnonzero(eligible)
        chosen = self._coins(t, candidates, self.probability)
        self._last[chosen] = t
        return self._id_list(chosen)

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "last": self._last.tolist()}

    def _parse_state(self, state: Mapping, next_round: int) -> Callable[[], None]:
        ids, count = self._parse_population(state)
        last = int_list(state["last"], len(ids), "last")
        if np.any(last >= next_round) or np.any(last < -self.min_sep):
            raise CheckpointError("last holds a round outside [-min_sep, next_round)")

        def apply() -> None:
            self._set_population(ids, count)
            self._last = last
            self._law_at = (0, self._initial_law())

        return apply
