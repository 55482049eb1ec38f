"""The scheduler interface: ``Scheduler`` decides each round's ``Selection`` in order and
saves and restores its state (``fedmf.schedule.state``)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import ClassVar

from .. import checks
from ..errors import CheckpointError, ConfigError, FedmfError, RoundOrderError
from .state import check_header, header, params_of, read_position
from .stream import Stream, check_key

__all__ = ["Selection", "Scheduler", "canonical"]


def canonical(users: Iterable[Hashable], what: str) -> dict[str, Hashable]:
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
        self._stream = Stream(check_key(key))
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
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise RoundOrderError(f"a round must be an integer, got {t!r}")
        t = int(t)
        if t != self._next_round:
            raise RoundOrderError(f"the scheduler decides round {self._next_round} next, not round {t}")
        users = canonical(available, "available users")
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

    def eligible(self, t: int, available: Iterable[Hashable]) -> int | None:
        """How many of ``available`` round t may select, deciding nothing (``fedmf.run.cohort``); None
        for the samplers whose round size is their own random draw (amplified)."""
        return None

    @abc.abstractmethod
    def expected_users(self, population: int) -> float:
        """Planned expected number of users per round for ``population`` users."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """Scheme and parameters (never the key)."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "scheme")
        return f"{type(self).__name__}({params})"

    def __reduce__(self):  # it holds its secret key: never pickled
        checks.refuse_pickle(self, instead="save state_dict()")

    def state_dict(self) -> dict:
        """JSON-serializable state (``fedmf.schedule.state``); user ids as ``str(user)``."""
        state = header(self.scheme, self._state_params(), self._stream.check(), self._next_round,
                       self._last_round, self._last_ids)
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()`` of a scheduler of this scheme, parameters and key."""
        check_header(state, self.scheme, self._state_params(), self._stream.check())
        try:
            next_round, last_round, last_ids = read_position(state)
            apply = self._parse_state(state, next_round)
        except CheckpointError as e:  # a field the readers (``fedmf.schedule.state``) refused
            raise CheckpointError(f"the {self.scheme} scheduler state is malformed: {e}") from None
        except FedmfError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # a missing field, a value of the wrong type
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
        """``describe()`` in ints and strings (``state.params_of``)."""
        return params_of(self.describe())
