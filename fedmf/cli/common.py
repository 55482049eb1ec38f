"""Helpers shared by the command modules: the one-line parser, schemas from options, output checks."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..participation import FixedEpoch, MinSep

__all__ = ["UsageError", "Parser", "one_line", "minsep_schema", "fixed_epoch_schema", "check_output"]


class UsageError(ConfigError):
    """Bad command-line input."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``UsageError`` (one line, exit 2) instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def one_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type name when it has none)."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def minsep_schema(rounds: int, participations: int | None, min_sep: int | None) -> "MinSep":
    """MinSep from the options: k defaults to ceil(n/b); b defaults to floor(n/k); neither: b = n."""
    from ..participation import MinSep

    if participations is not None and participations <= 0:
        raise UsageError(f"--participations must be positive, got {participations}")
    if min_sep is not None and min_sep <= 0:
        raise UsageError(f"--min-sep must be positive, got {min_sep}")
    if min_sep is None:
        if participations is None:
            min_sep = rounds
        elif participations > rounds:
            raise UsageError(f"--participations {participations} exceeds --rounds {rounds}")
        else:
            min_sep = rounds // participations
    if min_sep > rounds:
        raise UsageError(f"--min-sep b={min_sep} exceeds the number of rounds n={rounds}")
    return MinSep(min_sep, participations)


def fixed_epoch_schema(rounds: int, participations: int | None, min_sep: int | None) -> "FixedEpoch":
    """FixedEpoch(k, b) with k·b = n from whichever of k, b is given."""
    from ..participation import FixedEpoch

    k, b = participations, min_sep
    if k is None and b is None:
        raise UsageError("fixed-epoch needs --participations K or --min-sep B with K x B = rounds")
    for name, value in (("--participations", k), ("--min-sep", b)):
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    if k is None:
        k = rounds // b if rounds % b == 0 else 0
    if b is None:
        b = rounds // k if rounds % k == 0 else 0
    if k * b != rounds or k == 0:
        raise UsageError(f"fixed-epoch needs participations x min_sep = rounds, got {participations} x {min_sep} "
                         f"!= {rounds}")
    return FixedEpoch(k, b)


def check_output(option: str, path: str | None, suffix: str | None = None) -> None:
    """Refuse, before any work, an output ``path`` that cannot be written (or lacks ``suffix``)."""
    if path is None:
        return
    if suffix is not None and not path.lower().endswith(suffix):
        raise UsageError(f"{option}: {path!r} must end in {suffix}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{option}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{option}: directory {directory!r} is not writable")
    if os.path.isdir(path):
        raise UsageError(f"{option}: {path!r} is a directory")
