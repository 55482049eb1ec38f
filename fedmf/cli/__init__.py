"""The ``fedmf`` command line (argparse lives only in this package).

Each module in ``COMMANDS`` adds its sub-commands with ``register(subparsers)`` and imports
its heavy dependencies inside the commands, so that start-up stays fast. Bad input (a
``FedmfError``, an ``OSError``) is one line on stderr and exit code 2; any other exception is
a bug and stays a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..errors import FedmfError
from .common import Parser, name_flags, one_line

__all__ = ["main", "build_parser", "COMMANDS"]

#: command modules, in the order ``fedmf --help`` lists them
COMMANDS = ("mechanism", "accounting", "audit", "audit_empirical", "simulate", "user", "budget", "ledger")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedmf`` parser with every command module's sub-commands."""
    parser = Parser(prog="fedmf", description="Correlated-noise DP for federated learning.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def _named(message: str, args: argparse.Namespace | None) -> str:
    parser = getattr(args, "cli_parser", None)
    return message if parser is None else name_flags(message, parser.flags())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedmf`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except FedmfError as e:  # named by the flags the user typed, not the engine's parameter names
        print(f"fedmf: error: {_named(one_line(e), args)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fedmf: error: {e.strerror or e}{(': ' + e.filename) if getattr(e, 'filename', None) else ''}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedmf: interrupted", file=sys.stderr)
        return 130
