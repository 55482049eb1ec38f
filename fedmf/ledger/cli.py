"""``fedmf audit``: the read-only privacy audit of a ledger.

Wired into ``fedmf.cli._parser()`` by ``add_commands(sub)``; also runnable on its own as
``python -m fedmf.ledger.cli audit …``. Bad input (an unreachable database, a wrong URL,
a ledger from a newer fedmf, an unknown run) is one line on stderr and exit code 2, and
nothing is written: the CSV and PNG only after the audit succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

__all__ = ["add_commands", "cmd_audit", "main"]


def _check_output(option: str, path: str | None, suffix: str | None = None) -> None:
    if path is None:
        return
    from .db import LedgerError

    if suffix is not None and not path.lower().endswith(suffix):
        raise LedgerError(f"{option}: {path!r} must end in {suffix}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise LedgerError(f"{option}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise LedgerError(f"{option}: directory {directory!r} is not writable")
    if os.path.isdir(path):
        raise LedgerError(f"{option}: {path!r} is a directory")


def cmd_audit(args: argparse.Namespace) -> int:
    from .audit import audit

    _check_output("--csv", args.csv)
    _check_output("--plot", args.plot, ".png")
    report = audit(args.ledger, args.run)
    if args.csv:
        report.write_csv(args.csv)
    if args.plot:
        report.plot(args.plot)
    if args.json:
        out = report.to_dict()
        if args.csv:
            out["csv"] = args.csv
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, allow_nan=False))
    else:
        print("\n".join(report.lines()))
        for option, path in (("csv", args.csv), ("plot", args.plot)):
            if path:
                print(f"{option:<19} {path}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a run id is a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a run id is a positive integer, got {text!r}")
    return value


def add_commands(subparsers) -> None:
    """Add ``audit`` to a ``fedmf`` subparsers object."""
    p = subparsers.add_parser(
        "audit", help="read-only privacy audit of a participation ledger",
        description="Recompute, from a ledger alone and without writing to it, the ε each round spent "
                    "(worst user and plan), the realized separation and participations, and the users "
                    "who broke the plan.",
    )
    p.add_argument("--ledger", required=True, metavar="URL",
                   help="a SQLite path or sqlite:///PATH, or postgresql://USER@HOST/DB")
    p.add_argument("--run", type=_positive_int, metavar="ID", help="run id (default: the latest run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--csv", metavar="FILE", help="write the per-round table as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="write ε-vs-round and the participation histogram (PNG)")
    p.set_defaults(func=cmd_audit)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point with fedmf's error convention (one line, exit 2)."""
    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:
            raise ValueError(message)

    parser = _Parser(prog="fedmf")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_commands(sub)
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except ValueError as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"fedmf: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fedmf: error: {e.strerror or e}{(': ' + e.filename) if getattr(e, 'filename', None) else ''}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
