"""The scheduler state format: what ``Scheduler.state_dict`` writes and ``load_state_dict``
reads back. JSON-ready (ints, strings, lists, dicts; user ids as ``str(user)``): the format
number, the scheme, its parameters, a keyed check value of the key (never the key), the next
round, the last round's selection, then the scheme's own part. A state that is not one of
these raises ``CheckpointError``, one of another scheduler ``PlanMismatch``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .. import checks
from ..errors import CheckpointError, PlanMismatch

__all__ = ["STATE_FORMAT", "header", "check_header", "read_position", "params_of", "nonneg", "int_list"]

STATE_FORMAT = 1


def params_of(description: Mapping[str, Any]) -> dict:
    """A ``describe()`` in ints and strings: floats as repr, bools as 0/1, None left out."""
    out: dict[str, Any] = {}
    for name, value in description.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, float):
            value = repr(value)
        out[name] = value
    return out


def header(scheme: str, params: dict, key_check: str, next_round: int, last_round: int | None,
           last_ids: Iterable[str]) -> dict:
    """The part of a state every scheme writes."""
    state = {
        "format": STATE_FORMAT, "scheme": scheme, "params": params,
        "key_check": key_check, "next_round": next_round,
        "last_selected": sorted(last_ids),
    }
    if last_round is not None:
        state["last_round"] = last_round
    return state


def check_header(state: object, scheme: str, params: dict, key_check: str) -> None:
    """Refuse a state of another format, scheme, parameters or key."""
    checks.state_format(state, "the scheduler state", STATE_FORMAT)
    if state.get("scheme") != scheme:
        raise PlanMismatch(f"the scheduler state is for scheme {state.get('scheme')!r}, not {scheme!r}")
    if state.get("params") != params:
        raise PlanMismatch(f"the scheduler state has parameters {state.get('params')!r}, "
                           f"this {scheme} scheduler has {params!r}")
    if state.get("key_check") != key_check:
        raise PlanMismatch("the scheduler state was written with another scheduler key")


def read_position(state: Mapping) -> tuple[int, int | None, list[str]]:
    """(next round, last round or None, last selected ids); a malformed one raises
    ``CheckpointError`` (a missing field ``KeyError``)."""
    next_round = int(nonneg(state["next_round"]))
    last_round = state.get("last_round")
    last_ids = state["last_selected"]
    if last_round is not None and nonneg(last_round) + 1 != next_round:
        raise CheckpointError("last_round is not next_round - 1")
    if not isinstance(last_ids, list) or not all(isinstance(s, str) for s in last_ids):
        raise CheckpointError("last_selected must be a list of ids")
    return next_round, last_round, last_ids


def nonneg(value: object) -> int:
    """A JSON integer >= 0 of a state (a round, a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"expected a non-negative integer, got {value!r}")
    return value


def int_list(value: object, size: int, name: str) -> np.ndarray:
    """A JSON list of ``size`` integers of a state, as int64."""
    if not isinstance(value, list) or len(value) != size or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointError(f"{name} must be a list of {size} integers")
    return np.asarray(value, dtype=np.int64).reshape(size)
