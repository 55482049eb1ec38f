"""``fedmf audit``: the read-only privacy audit of a ledger.

Bad input (an unreachable database, a wrong URL, a ledger from a newer fedmf, an unknown run)
is one line on stderr and exit code 2, and nothing is written: the CSV and PNG only after the
audit succeeded. ``--verify`` also recomputes the hash chain; a chain that does not match is
exit code 1, naming the first round that does not match (``--json``: ``verify``). ``--head
ROUND:HASH`` (implies ``--verify``) checks a chain head recorded outside the ledger (the summary of
a run and every audit print the head to record): it matches iff round ROUND's stored head is HASH
and the chain verifies through it; a ledger truncated before ROUND or rewritten is exit code 1, one
line (``--json``: ``head_check``); a malformed HASH is bad input (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import check_output

__all__ = ["register", "cmd_audit"]


def cmd_audit(args: argparse.Namespace) -> int:
    """``fedmf audit``: recompute a run's privacy from its ledger; print it, optionally CSV and PNG."""
    from ..audit.replay import ChainBroken, audit

    if args.users:
        from .budget import account_lines

        lines, data = account_lines(args.ledger)
        print(json.dumps(data, allow_nan=False) if args.json else "\n".join(lines))
        return 0
    check_output("--csv", args.csv)
    check_output("--plot", args.plot, ".png")
    try:
        report = audit(args.ledger, args.run, verify=args.verify, head=args.head)
    except ChainBroken as e:
        if args.json:
            print(json.dumps({"verify": e.chain.to_dict(), "error": str(e),
                              **({"head_check": e.head_check.to_dict()} if e.head_check else {})}, allow_nan=False))
        if e.head_check is not None and not e.head_check.ok:
            print(f"fedmf: recorded head mismatch: {e.head_check.reason}", file=sys.stderr)
        print(f"fedmf: verification failed: {_where(e.chain)}: {e.chain.reason} ({e})", file=sys.stderr)
        return 1
    skips = _budget_skips(args.ledger, report.run["id"])
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
        if skips:
            out["budget_skips"] = {str(t): n for t, n in sorted(skips.items())}
        print(json.dumps(out, allow_nan=False))
    else:
        print("\n".join(report.lines()))
        if skips:
            total = sum(skips.values())
            print(f"budget skips        {total} (users passed over for their lifetime budget)"
                  + (", by round: " + ", ".join(f"{t}: {n}" for t, n in sorted(skips.items())) if total else ""))
        for option, path in (("csv", args.csv), ("plot", args.plot)):
            if path:
                print(f"{option:<19} {path}")
    failed = False
    if report.head_check is not None and not report.head_check.ok:
        print(f"fedmf: recorded head mismatch: {report.head_check.reason}", file=sys.stderr)
        failed = True
    if report.chain is not None and not report.chain.ok:
        print(f"fedmf: verification failed: {_where(report.chain)}: {report.chain.reason}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


def _budget_skips(url: str, run_id: int) -> dict[int, int]:
    """{round: users skipped for their lifetime budget} of the run (read-only)."""
    from ..ledger.budgets import round_skips
    from ..ledger.db import read_snapshot, resolve_url

    return read_snapshot(resolve_url(url), lambda conn: round_skips(conn, run_id))


def _where(chain) -> str:
    return "the run row (genesis)" if chain.first_bad_round == -1 else f"round {chain.first_bad_round}"


def _head(text: str) -> tuple[int | None, str]:
    from ..ledger.chain import parse_head

    try:
        return parse_head(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a run id is a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a run id is a positive integer, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    """Add ``audit`` to fedmf's sub-parsers."""
    p = subparsers.add_parser(
        "audit", help="read-only privacy audit of a participation ledger",
        description="Recompute, from a ledger alone and without writing to it, the ε each round spent "
                    "(worst user and plan), the realized separation and participations, and the users "
                    "who broke the plan.",
    )
    p.add_argument("--ledger", required=True, metavar="URL",
                   help="a SQLite path or sqlite:///PATH, or postgresql://USER@HOST/DB")
    p.add_argument("--run", type=_run_id, metavar="ID", help="run id (default: the latest run)")
    p.add_argument("--verify", action="store_true",
                   help="recompute the hash chain; exit 1 naming the first round that does not match")
    p.add_argument("--head", type=_head, metavar="ROUND:HASH",
                   help="check a chain head recorded outside the ledger (printed by every audit and by a run's "
                        "summary; HASH alone is searched): exit 1 if the ledger was rewritten or truncated before "
                        "ROUND, or the chain does not verify through it (implies --verify)")
    p.add_argument("--users", action="store_true",
                   help="list every user's lifetime budget: spent and remaining epsilon (pseudonymous; fedmf budget)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--csv", metavar="FILE", help="write the per-round table as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="write ε-vs-round and the participation histogram (PNG)")
    p.set_defaults(func=cmd_audit)
