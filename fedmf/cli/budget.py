"""``fedmf budget``: lifetime per-user privacy budgets across the runs of one ledger
(``fedmf.ledger.budgets``). ``default`` sets the ledger-wide ε (and the lifetime δ) and creates the
budget secret file on first use; ``set`` gives one user their own ε; ``show`` lists the accounts."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["register", "cmd_default", "cmd_set", "cmd_show", "account_lines"]


def _epsilon(text: str) -> float | None:
    """A lifetime ε (>= 0, finite) or ``none`` (unlimited)."""
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"epsilon must be a number >= 0 or 'none', got {text!r}") from None
    if not (value >= 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"epsilon must be a finite number >= 0 or 'none', got {text!r}")
    return value


def _open(args: argparse.Namespace, create: bool):
    from ..ledger import Ledger
    from ..ledger.budgets import load_budget_secret

    return Ledger.open(args.ledger), load_budget_secret(args.key, create=create)


def cmd_default(args: argparse.Namespace) -> int:
    from ..ledger.budgets import set_default

    book, secret = _open(args, create=True)
    with book:
        info = set_default(book, secret, args.epsilon, args.delta)
    shown = "unlimited" if info.default_epsilon is None else f"{info.default_epsilon:g}"
    print(f"default lifetime budget: epsilon {shown} at delta {info.delta:g}")
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    from ..enrollment import check_user_id
    from ..ledger.budgets import set_user

    user = check_user_id(args.user)
    book, secret = _open(args, create=False)
    with book:
        set_user(book, secret, user, args.epsilon)
    print(f"lifetime budget of {user}: " + ("the default" if args.epsilon is None else f"epsilon {args.epsilon:g}"))
    return 0


def account_lines(url: str) -> tuple[list[str], dict[str, Any]]:
    """The ledger's lifetime accounts as lines and as JSON (read-only; needs no secret)."""
    from ..ledger.budgets import settings, user_accounts
    from ..ledger.db import check_version, read_snapshot, resolve_url

    resolved = resolve_url(url)

    def read(conn):
        check_version(conn, resolved, allow_empty=False, allow_older=False)
        return settings(conn), user_accounts(conn)

    info, accounts = read_snapshot(resolved, read)
    if info is None:
        return ["this ledger has no lifetime budgets"], {"budgets": None, "users": []}
    default = "unlimited" if info.default_epsilon is None else f"{info.default_epsilon:g}"
    lines = [f"lifetime budgets: default epsilon {default} at delta {info.delta:g} (spent: worst case of every run "
             "that selected the user, mu-GDP composition)",
             f"{'user (key prefix)':<18} {'runs':>4} {'mu':>8} {'spent eps':>10} {'budget eps':>10} {'remaining':>10}"]
    for a in accounts:
        budget = "unlimited" if a.budget_epsilon is None else f"{a.budget_epsilon:.4g}"
        remaining = "-" if a.remaining_epsilon is None else f"{a.remaining_epsilon:.4g}"
        lines.append(f"{a.label:<18} {a.runs:>4} {a.mu:>8.4g} {a.spent_epsilon:>10.4g} {budget:>10} {remaining:>10}")
    data = {"budgets": {"default_epsilon": info.default_epsilon, "delta": info.delta},
            "users": [a.__dict__ for a in accounts]}
    return lines, data


def cmd_show(args: argparse.Namespace) -> int:
    lines, data = account_lines(args.ledger)
    print(json.dumps(data, allow_nan=False) if args.json else "\n".join(lines))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("budget", help="lifetime per-user privacy budgets across the runs of a ledger",
                       description="Set and show lifetime budgets (epsilon at a lifetime delta) that every run on "
                                   "the ledger enforces when it selects users.")
    commands = p.add_subparsers(dest="budget_command", required=True, parser_class=type(p))

    def common(q, key: bool = True) -> None:
        q.add_argument("--ledger", required=True, metavar="URL", help="a SQLite path or postgresql://USER@HOST/DB")
        if key:
            q.add_argument("--key", required=True, metavar="FILE",
                           help="the budget secret file (0600; `default` creates it), given to every run")

    q = commands.add_parser("default", help="set the ledger-wide lifetime budget (creates the budget secret)")
    q.add_argument("epsilon", type=_epsilon, metavar="EPS", help="lifetime epsilon, or 'none' (unlimited)")
    q.add_argument("--delta", type=float, help="lifetime delta (default 1e-10; fixed once a run charged a user)")
    common(q)
    q.set_defaults(func=cmd_default)
    q = commands.add_parser("set", help="set one user's own lifetime budget")
    q.add_argument("user", metavar="USER", help="the user's id, as the runs know it")
    q.add_argument("epsilon", type=_epsilon, metavar="EPS", help="lifetime epsilon, or 'none' (back to the default)")
    common(q)
    q.set_defaults(func=cmd_set)
    q = commands.add_parser("show", help="list every user's spent and remaining lifetime budget (pseudonymous)")
    common(q, key=False)
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_show)
