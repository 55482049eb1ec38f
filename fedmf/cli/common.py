"""Helpers shared by the command modules: the one-line parser, schemas from options, output checks."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..participation import FixedEpoch, MinSep

__all__ = ["UsageError", "Parser", "one_line", "name_flags", "minsep_schema", "fixed_epoch_schema", "check_output"]


class UsageError(ConfigError):
    """Bad command-line input."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``UsageError`` (one line, exit 2) instead of exiting.

    It also knows its options' flags by the names the engine gives the same parameters (``budget_key``,
    ``budget-key`` → ``--budget-key``; ``alias`` adds a configuration key spelled otherwise) and leaves
    itself in the parsed arguments as ``cli_parser`` (a sub-command's replaces its parent's): ``main``
    rewrites an engine error with ``name_flags(message, parser.flags())`` so that it names the flag the
    user typed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._aliases: dict[str, str] = {}
        self.set_defaults(cli_parser=self)

    def flags(self) -> dict[str, str]:
        """Engine name → flag, for every long option (argument groups included) and alias."""
        out: dict[str, str] = {}
        for action in self._actions:
            long = [o for o in action.option_strings if o.startswith("--")]
            if long and action.dest != "help":
                out.setdefault(action.dest, long[0])
                out.setdefault(action.dest.replace("_", "-"), long[0])
        return {**out, **self._aliases}

    def alias(self, name: str, flag: str) -> None:
        """The engine's ``name`` (a configuration key, a parameter) is the option ``flag`` here."""
        self._aliases[name] = flag

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with the engine's parameter names replaced by the command's flags: a name with a
    ``_`` or ``-`` wherever it stands as a word; a plain word only where it opens the message as its
    subject (``rounds must be …``), so that prose keeps its words."""
    names = sorted((n for n in flags if "_" in n or "-" in n), key=len, reverse=True)
    if names:
        pattern = re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in names) + r")(?![\w-])")
        message = pattern.sub(lambda m: flags[m.group(1)], message)
    first = re.match(r"([a-z]+)(?= (?:must|is|needs|should|=|:))", message)
    if first and first.group(1) in flags:
        message = flags[first.group(1)] + message[first.end():]
    return message


def one_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type name when it has none)."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def minsep_schema(rounds: int, participations: int | None, min_sep: int | None) -> MinSep:
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


def fixed_epoch_schema(rounds: int, participations: int | None, min_sep: int | None) -> FixedEpoch:
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
