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
from typing import Sequence

from ..errors import FedmfError
from .common import Parser, one_line

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedmf`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except FedmfError as e:
        print(f"fedmf: error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fedmf: error: {e.strerror or e}{(': ' + e.filename) if getattr(e, 'filename', None) else ''}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedmf: interrupted", file=sys.stderr)
        return 130
