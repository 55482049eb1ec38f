"""Who takes part in each round: the participation scheduler.

The privacy guarantee of an amplified run is a statement about the *sampler*, so each
scheme below is exactly the sampler its accountant assumes (``fedmf.accounting``):

* ``MinSepSelection`` (sampling ``none``, schema ``MinSep(b, k)``): each round a uniform
  subset of ``users_per_round`` available users among those with fewer than k selections
  whose last selection is >= b rounds back.
* ``BMinSepPoisson`` (``bminsep:P[:warm]``; Dong & Ganesh, "Privacy Amplification for
  BandMF via b-Min-Sep Subsampling", Alg. 1 cold / Alg. 2 warm start).
* ``CyclicPoisson`` (``cyclic-poisson:Q``; Choquette-Choo et al., "Scaling up BandMF", Alg. 2).
* ``FixedEpochOrder`` (sampling ``none``, schema ``FixedEpoch(k, b)``; "Multi-Epoch Matrix
  Factorization Mechanisms", Sec. 2: user slot j takes part in rounds j, j+b, ...).
* ``PoissonSampling`` (``poisson:P``; MMCC, Choquette-Choo et al. 2023: Poisson in every round).

Selections, not contributions, drive every rule: a selected user that drops out still used
its participation and still blocks for b-1 rounds (b-min-sep notes §7.1 item 2: actual
participations are then <= modelled ones elementwise). The schedule therefore never depends
on what clients send. Amplified schemes sample the whole population (every user ever
registered or seen in ``available``), whether or not a user is reachable now; a sampled
user who is not available is ``unreachable``: a dropout, i.e. a zero contribution.

Secret-seeded deterministic stream. Every random decision is a keyed BLAKE2b hash (the
caller's secret key of 16..64 bytes, made with ``secrets.token_bytes(32)`` and kept in a
0600 file; ``person=b"fedmf-sched-v1"``; 8-byte digest) of the message
``purpose + b"\\0" + round as 8-byte big-endian signed + str(user) as UTF-8``, read as a
big-endian unsigned 64-bit integer w. Purposes: ``pick`` (MinSep ranking), ``coin``
(Bernoulli coins), ``join`` (a b-min-sep user's chain state when it joins), ``group``
(cyclic group, round 0), ``slot`` (fixed-epoch shuffle, round 0). A coin of probability p
shows heads iff (w >> 11)·2⁻⁵³ < p (probability ⌈p·2⁵³⌉/2⁵³). Keyed BLAKE2b is a PRF, so
to anyone without the key the decisions are independent uniform draws, as the accountants
assume, and who was sampled stays secret. The same key, state and available *set* (in any
order) give the same ``Selection``, so a resumed run or a Flower run matches an in-process
run bit for bit. The key never appears in ``state_dict``, ``describe``, ``repr`` or errors;
the state carries only a keyed check value (a MAC of a constant) to refuse another key.

User identity is ``str(user)``. In a ``Selection``, reachable users are the caller's own
objects from ``available``; unreachable ones are their ids (``str``).
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Sequence

import numpy as np

from .accounting.sampling import Sampling, parse_sampling
from .errors import CheckpointError, ConfigError, FedmfError, HorizonReached, PlanMismatch, RoundOrderError
from .participation import FixedEpoch, MinSep

__all__ = [
    "Selection", "Scheduler", "MinSepSelection", "BMinSepPoisson", "CyclicPoisson", "FixedEpochOrder",
    "PoissonSampling", "make_scheduler", "STATE_FORMAT",
]

STATE_FORMAT = 1
_PERSON = b"fedmf-sched-v1"
_KEY_BYTES = (16, 64)
_UNIT = 2.0**-53


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------
def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _optional_int(name: str, value: object) -> int | None:
    return None if value is None else _positive_int(name, value)


def _probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}")
    p = float(value)
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise ConfigError(f"{name} must lie in (0, 1], got {value!r}")
    return p


def _check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise ConfigError(f"the scheduler key must be bytes (secrets.token_bytes(32)), got {type(key).__name__}")
    lo, hi = _KEY_BYTES
    if not lo <= len(key) <= hi:
        raise ConfigError(f"the scheduler key must be {lo} to {hi} bytes long, got {len(key)} bytes")
    return bytes(key)


def _round_index(t: object) -> int:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise RoundOrderError(f"a round must be an integer, got {t!r}")
    return int(t)


def _canonical(users: Iterable[Hashable], what: str) -> dict[str, Hashable]:
    """{str(user): user}; duplicates of one user collapse, two users with one id are refused."""
    if isinstance(users, (str, bytes)) or not isinstance(users, Iterable):
        raise ConfigError(f"{what} must be a collection of users (e.g. range(N)), not {type(users).__name__}")
    items = users if isinstance(users, (list, tuple)) else list(users)
    ids = list(map(str, items))
    out = dict(zip(ids, items))
    if len(out) != len(items):
        for s, u in zip(ids, items):
            v = out[s]
            if v is not u and v != u:
                raise ConfigError(f"two {what} share the id {s!r} (identity is str(user))")
    return out


def _encode(user_id: str) -> bytes:
    return user_id.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------------------
# the secret-seeded stream
# ---------------------------------------------------------------------------------------
class _Stream:
    """Keyed BLAKE2b of (purpose, round, user) -> uniform 64-bit words (module docstring)."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=key, person=_PERSON, digest_size=8)

    def __repr__(self) -> str:
        return "_Stream(<secret>)"

    def words(self, purpose: bytes, t: int, names: Sequence[bytes]) -> np.ndarray:
        h = self._base.copy()
        h.update(purpose + b"\0" + struct.pack(">q", t))
        copy = h.copy  # the key block and the prefix are absorbed once per call

        def one(name: bytes) -> bytes:
            x = copy()
            x.update(name)
            return x.digest()

        return np.frombuffer(b"".join(map(one, names)), dtype=">u8").astype(np.uint64)

    def uniforms(self, purpose: bytes, t: int, names: Sequence[bytes]) -> np.ndarray:
        """Uniform on the grid k·2⁻⁵³ of [0, 1): the top 53 bits of each word."""
        return (self.words(purpose, t, names) >> np.uint64(11)).astype(np.float64) * _UNIT

    def check(self) -> str:
        """A keyed check value that identifies the key without revealing it."""
        return f"{int(self.words(b'check', 0, [b''])[0]):016x}"


# ---------------------------------------------------------------------------------------
# selection and the scheduler interface
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selection:
    """Who takes part in ``round``: ``selected`` (sorted by ``str(user)``) = ``reachable``
    (in ``available``; the caller's objects) ∪ ``unreachable`` (ids; dropouts)."""

    round: int
    selected: tuple
    reachable: tuple
    unreachable: tuple[str, ...]


class Scheduler(abc.ABC):
    """Decides the next round's participants; ``state_dict`` makes it resumable."""

    scheme: ClassVar[str]

    def __init__(self, key: bytes) -> None:
        self._stream = _Stream(_check_key(key))
        self._next_round = 0
        self._last_round: int | None = None
        self._last_ids: frozenset[str] = frozenset()

    # ---- the interface ---------------------------------------------------------------
    @property
    def next_round(self) -> int:
        """The only round ``select`` accepts."""
        return self._next_round

    def select(self, t: int, available: Iterable[Hashable]) -> Selection:
        """Decide round t (must be ``next_round``) given the users reachable now; advances."""
        t = _round_index(t)
        if t != self._next_round:
            raise RoundOrderError(f"the scheduler decides round {self._next_round} next, not round {t}")
        users = _canonical(available, "available users")
        ids = sorted(self._decide(t, users))
        selected = tuple(users.get(s, s) for s in ids)
        reachable = tuple(users[s] for s in ids if s in users)
        unreachable = tuple(s for s in ids if s not in users)
        self._last_round, self._last_ids = t, frozenset(ids)
        self._next_round = t + 1
        return Selection(t, selected, reachable, unreachable)

    def is_selected(self, t: int, user: Hashable) -> bool:
        """Whether ``user`` was selected in round t, the last decided round (else False)."""
        return self._last_round is not None and t == self._last_round and str(user) in self._last_ids

    @abc.abstractmethod
    def expected_users(self, population: int) -> float:
        """Planned expected number of users per round for ``population`` users."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """Scheme and parameters (never the key)."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "scheme")
        return f"{type(self).__name__}({params})"

    def __getstate__(self) -> dict:
        raise TypeError("a scheduler holds its secret key and is not picklable: save state_dict() instead")

    def state_dict(self) -> dict:
        """JSON-serializable state (ints, strings, lists, dicts); user ids as ``str(user)``."""
        state = {
            "format": STATE_FORMAT, "scheme": self.scheme, "params": self._state_params(),
            "key_check": self._stream.check(), "next_round": self._next_round,
            "last_selected": sorted(self._last_ids),
        }
        if self._last_round is not None:
            state["last_round"] = self._last_round
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()`` of a scheduler of this scheme, parameters and key."""
        if not isinstance(state, Mapping):
            raise CheckpointError(f"a scheduler state must be a dict, got {type(state).__name__}")
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"scheduler state format {state.get('format')!r} is not supported "
                                  f"(this fedmf writes {STATE_FORMAT})")
        if state.get("scheme") != self.scheme:
            raise PlanMismatch(f"the scheduler state is for scheme {state.get('scheme')!r}, not {self.scheme!r}")
        params = self._state_params()
        if state.get("params") != params:
            raise PlanMismatch(f"the scheduler state has parameters {state.get('params')!r}, "
                               f"this {self.scheme} scheduler has {params!r}")
        if state.get("key_check") != self._stream.check():
            raise PlanMismatch("the scheduler state was written with another scheduler key")
        try:
            next_round = int(_nonneg(state["next_round"]))
            last_round = state.get("last_round")
            last_ids = state["last_selected"]
            if last_round is not None and _nonneg(last_round) + 1 != next_round:
                raise ValueError("last_round is not next_round - 1")
            if not isinstance(last_ids, list) or not all(isinstance(s, str) for s in last_ids):
                raise ValueError("last_selected must be a list of ids")
            apply = self._parse_state(state, next_round)
        except FedmfError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(f"the {self.scheme} scheduler state is malformed: {e}") from None
        apply()
        self._next_round = next_round
        self._last_round = None if last_round is None else int(last_round)
        self._last_ids = frozenset(last_ids)

    # ---- what a scheme provides ------------------------------------------------------
    @abc.abstractmethod
    def _decide(self, t: int, users: dict[str, Hashable]) -> list[str]:
        """Ids selected in round t (``users``: the available ones); updates the state."""

    def _extra_state(self) -> dict:
        return {}

    def _parse_state(self, state: Mapping, next_round: int) -> Callable[[], None]:
        """Validate the scheme's part of ``state``; return the function that applies it."""
        return lambda: None

    def _state_params(self) -> dict:
        """``describe()`` in ints and strings: floats as repr, bools as 0/1, None left out."""
        out: dict[str, Any] = {}
        for name, value in self.describe().items():
            if value is None:
                continue
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, float):
                value = repr(value)
            out[name] = value
        return out


def _nonneg(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _int_list(value: object, size: int, name: str) -> np.ndarray:
    if not isinstance(value, list) or len(value) != size or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a list of {size} integers")
    return np.asarray(value, dtype=np.int64).reshape(size)


def _population_arg(population: object) -> int:
    if isinstance(population, bool) or not isinstance(population, (int, np.integer)) or population < 0:
        raise ConfigError(f"population must be a non-negative integer, got {population!r}")
    return int(population)


# ---------------------------------------------------------------------------------------
# 1. MinSep enforcement with uniform selection (un-amplified)
# ---------------------------------------------------------------------------------------
class MinSepSelection(Scheduler):
    """Each round, a uniform ``users_per_round``-subset of the eligible available users:
    fewer than k selections so far and the last one >= b rounds back (MinSep(b, k))."""

    scheme = "min-sep"

    def __init__(self, min_sep: int, max_participations: int | None, users_per_round: int, key: bytes) -> None:
        self.min_sep = _positive_int("min_sep", min_sep)
        self.max_participations = _optional_int("max_participations", max_participations)
        self.users_per_round = _positive_int("users_per_round", users_per_round)
        super().__init__(key)
        self._history: dict[str, tuple[int, int]] = {}  # id -> (selections, last selected round)

    def describe(self) -> dict:
        return {"scheme": self.scheme, "min_sep": self.min_sep, "max_participations": self.max_participations,
                "users_per_round": self.users_per_round}

    def expected_users(self, population: int) -> float:
        """``users_per_round``: the planned count (fewer only when fewer are eligible)."""
        _population_arg(population)
        return float(self.users_per_round)

    def _decide(self, t: int, users: dict[str, Hashable]) -> list[str]:
        b, k, get = self.min_sep, self.max_participations, self._history.get
        eligible = []
        for s in users:
            h = get(s)  # (selections, last round) or None: never selected
            if h is None or (t - h[1] >= b and (k is None or h[0] < k)):
                eligible.append(s)
        m = self.users_per_round
        if len(eligible) > m:
            # the m smallest keyed hashes form a uniform m-subset (ties, p ~ 2^-64, by id)
            w = self._stream.words(b"pick", t, [_encode(s) for s in eligible])
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
            raise ValueError("history must be a dict")
        history: dict[str, tuple[int, int]] = {}
        k = self.max_participations
        for s, entry in raw.items():
            if not isinstance(entry, list) or len(entry) != 2:
                raise ValueError(f"history of {s!r} must be [selections, last round]")
            count, last = _nonneg(entry[0]), _nonneg(entry[1])
            if count == 0 or last >= next_round or (k is not None and count > k):
                raise ValueError(f"history of {s!r} is impossible: {entry!r}")
            history[str(s)] = (count, last)

        def apply() -> None:
            self._history = history

        return apply


# ---------------------------------------------------------------------------------------
# population-based schemes (amplified samplers, every registered user flips its own coin)
# ---------------------------------------------------------------------------------------
class _PopulationScheduler(Scheduler):
    """A scheme that samples the whole population: every user registered by ``add_users``
    or ever seen in ``available``. Users join at ``next_round``, sorted by id."""

    def __init__(self, key: bytes, max_participations: int | None) -> None:
        self.max_participations = _optional_int("max_participations", max_participations)
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
        return self._join(self._next_round, _canonical(users, "users"))

    def _join(self, t: int, users: dict[str, Hashable]) -> int:
        new = sorted(users.keys() - self._index.keys())
        if not new:
            return 0
        names = [_encode(s) for s in new]
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
            raise ValueError("users must be a list of distinct ids")
        count = _int_list(state["count"], len(ids), "count")
        k = self.max_participations
        if np.any(count < 0) or (k is not None and np.any(count > k)):
            raise ValueError("count holds an impossible number of selections")
        return ids, count

    def _set_population(self, ids: list[str], count: np.ndarray) -> None:
        self._ids = list(ids)
        self._names = [_encode(s) for s in ids]
        self._index = {s: i for i, s in enumerate(ids)}
        self._count = count


class BMinSepPoisson(_PopulationScheduler):
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
        self.min_sep = _positive_int("min_sep", min_sep)
        self.probability = _probability("bminsep probability", probability)
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
        return p / (1.0 + (b - 1) * p) * _population_arg(population)

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
        last = _int_list(state["last"], len(ids), "last")
        if np.any(last >= next_round) or np.any(last < -self.min_sep):
            raise ValueError("last holds a round outside [-min_sep, next_round)")

        def apply() -> None:
            self._set_population(ids, count)
            self._last = last
            self._law_at = (0, self._initial_law())

        return apply


class CyclicPoisson(_PopulationScheduler):
    """Cyclic Poisson sampling ("Scaling up BandMF", Alg. 2): users fall into b groups by
    keyed hash (group = w mod b, fixed for the run); in round t group t mod b is active and
    each of its users is selected independently with probability p. With
    ``max_participations`` k a user is not selected after its k-th selection (zero updates
    from then on, which the per-step Poisson accounting dominates)."""

    scheme = "cyclic-poisson"

    def __init__(self, min_sep: int, probability: float, key: bytes, max_participations: int | None = None) -> None:
        self.min_sep = _positive_int("min_sep", min_sep)
        self.probability = _probability("cyclic-poisson probability", probability)
        super().__init__(key, max_participations)
        self._group = np.zeros(0, dtype=np.int64)

    def describe(self) -> dict:
        return {"scheme": self.scheme, "min_sep": self.min_sep, "probability": self.probability,
                "max_participations": self.max_participations}

    def expected_users(self, population: int) -> float:
        """p·N/b: one group of about N/b users, each with probability p (Alg. 2)."""
        return self.probability * _population_arg(population) / self.min_sep

    def group_of(self, user: Hashable) -> int:
        """The user's group (active in rounds ≡ group mod b)."""
        return int(self._groups([_encode(str(user))])[0])

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


class PoissonSampling(_PopulationScheduler):
    """Poisson sampling in every round (MMCC's assumption): every population user is
    selected independently with probability p in every round. No min-sep; an optional cap
    ``max_participations`` as in ``CyclicPoisson``."""

    scheme = "poisson"

    def __init__(self, probability: float, key: bytes, max_participations: int | None = None) -> None:
        self.probability = _probability("poisson probability", probability)
        super().__init__(key, max_participations)

    def describe(self) -> dict:
        return {"scheme": self.scheme, "probability": self.probability,
                "max_participations": self.max_participations}

    def expected_users(self, population: int) -> float:
        """p·N (Poisson sampling with rate p; MMCC, arXiv 2310.15526 §2)."""
        return self.probability * _population_arg(population)

    def _sample(self, t: int) -> list[str]:
        return self._id_list(self._coins(t, np.flatnonzero(self._below_cap()), self.probability))

    def _parse_state(self, state: Mapping, next_round: int) -> Callable[[], None]:
        ids, count = self._parse_population(state)
        return lambda: self._set_population(ids, count)


# ---------------------------------------------------------------------------------------
# 4. the fixed-epoch order
# ---------------------------------------------------------------------------------------
class FixedEpochOrder(Scheduler):
    """FixedEpoch(k, b): a keyed secret shuffle splits the fixed population into b slots
    of sizes differing by at most 1; round t < k·b takes all of slot t mod b."""

    scheme = "fixed-epoch"

    def __init__(self, min_sep: int, epochs: int, population: Iterable[Hashable], key: bytes) -> None:
        self.min_sep = _positive_int("min_sep", min_sep)
        self.epochs = _positive_int("epochs", epochs)
        ids = sorted(_canonical(population, "population users"))
        if not ids:
            raise ConfigError("the fixed-epoch population is empty")
        super().__init__(key)
        # Rank by keyed hash (ties by id): a uniformly random order; rank r goes to slot r mod b.
        w = self._stream.words(b"slot", 0, [_encode(s) for s in ids])
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
        return _population_arg(population) / self.min_sep

    def slot_of(self, user: Hashable) -> int | None:
        """The user's slot (rounds ≡ slot mod b), None outside the population."""
        return self._slot_index.get(str(user))

    def _decide(self, t: int, users: dict[str, Hashable]) -> list[str]:
        if t >= self.epochs * self.min_sep:
            raise HorizonReached(f"fixed-epoch order covers rounds 0..{self.epochs * self.min_sep - 1}, not round {t}")
        return list(self._slots[t % self.min_sep])


# ---------------------------------------------------------------------------------------
# from a plan's schema and sampling
# ---------------------------------------------------------------------------------------
def make_scheduler(schema: MinSep | FixedEpoch, sampling: Sampling | str | None, *, key: bytes,
                   users_per_round: int | None = None, population: Iterable[Hashable] | None = None,
                   rounds: int | None = None) -> Scheduler:
    """The scheduler that realizes ``schema`` under ``sampling`` (what the accountant assumes).
    k = ``schema.participations(rounds)`` when ``rounds`` is given, else the schema's own k."""
    try:
        sampling = parse_sampling(sampling)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(schema, (MinSep, FixedEpoch)):
        raise ConfigError(f"a scheduler follows a MinSep or FixedEpoch schema, not {type(schema).__name__}")
    if rounds is not None:
        try:
            schema.validate(rounds)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    k = schema.participations(rounds) if rounds is not None else schema.max_participations
    b, kind = schema.min_sep, sampling.kind
    plain_min_sep = isinstance(schema, MinSep) and kind == "none"
    if users_per_round is not None and not plain_min_sep:
        raise ConfigError(f"users_per_round applies to MinSep without sampling; {schema.name} with sampling "
                          f"{sampling} decides the number of users itself")
    scheduler: Scheduler
    if isinstance(schema, FixedEpoch):
        if kind == "none":
            if population is None:
                raise ConfigError("the fixed-epoch order needs the population (the users, fixed for the run)")
            return FixedEpochOrder(b, schema.max_participations, population, key)
        if kind != "cyclic-poisson":
            raise ConfigError(f"{kind} sampling does not follow the fixed-epoch order; plan it with MinSep")
        scheduler = CyclicPoisson(b, sampling.probability, key, max_participations=k)
    elif kind == "none":
        if users_per_round is None:
            raise ConfigError("MinSep without sampling needs users_per_round")
        return MinSepSelection(b, k, users_per_round, key)
    elif kind == "bminsep":
        scheduler = BMinSepPoisson(b, sampling.probability, key, max_participations=k,
                                   warm_start=sampling.warm_start)
    elif kind == "cyclic-poisson":
        scheduler = CyclicPoisson(b, sampling.probability, key, max_participations=k)
    else:
        if b != 1:
            raise ConfigError(f"poisson sampling (MMCC) samples every user in every round: plan it with "
                              f"MinSep(1, n), not min_sep={b}")
        scheduler = PoissonSampling(sampling.probability, key, max_participations=k)
    if population is not None:
        scheduler.add_users(population)
    return scheduler
