"""``fedmf budget``: lifetime per-user privacy budgets across the runs of one ledger (``fedmf.budgets``;
stored by ``fedmf.ledger.budgets``). ``default`` sets the ledger-wide ε (and the lifetime δ) and creates
the budget secret file on first use; ``set`` gives users their own ε (several ids, or a file of them, in one
transaction); ``show`` lists the accounts, or looks up users by id (with the budget secret)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import ConfigError

__all__ = ["register", "cmd_default", "cmd_set", "cmd_show", "account_lines", "read_users_file"]


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


def read_users_file(path: str, epsilon: float | None) -> dict[str, float | None]:
    """User → ε from ``path``: one user id per line, optionally followed (after a comma or blanks) by
    that user's own ε or ``none``, else ``epsilon``; blank lines and lines starting with # are skipped."""
    out: dict[str, float | None] = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.replace(",", " ").split()
            if len(fields) > 2:
                raise ConfigError(f"--users-file {path}, line {number}: expected USER [EPS], got {line!r}")
            if len(fields) == 2:
                try:
                    out[fields[0]] = _epsilon(fields[1])
                except argparse.ArgumentTypeError as e:
                    raise ConfigError(f"--users-file {path}, line {number}: {e}") from None
            else:
                out[fields[0]] = epsilon
    return out


def cmd_set(args: argparse.Namespace) -> int:
    from ..enrollment import check_user_id
    from ..ledger.budgets import set_users

    if not args.users and args.users_file is None:
        raise ConfigError("give the users: USER … EPS, or --users-file FILE")
    budgets: dict[str, float | None] = {}
    if args.users_file is not None:
        budgets.update(read_users_file(args.users_file, args.epsilon))
    for user in args.users:
        budgets[user] = args.epsilon
    budgets = {check_user_id(user): eps for user, eps in budgets.items()}
    book, secret = _open(args, create=False)
    with book:
        count = set_users(book, secret, budgets)
    if count == 1:
        (user, eps), = budgets.items()
        print(f"lifetime budget of {user}: " + ("the default" if eps is None else f"epsilon {eps:g}"))
    else:
        shown = {"the default" if e is None else f"epsilon {e:g}" for e in budgets.values()}
        print(f"lifetime budgets of {count} users set"
              + (f": {shown.pop()}" if len(shown) == 1 else " (their own epsilons)"))
    return 0


def _account_row(a) -> str:
    budget = "unlimited" if a.budget_epsilon is None else f"{a.budget_epsilon:.4g}"
    remaining = "-" if a.remaining_epsilon is None else f"{a.remaining_epsilon:.4g}"
    return f"{a.label:<18} {a.runs:>4} {a.mu:>8.4g} {a.spent_epsilon:>10.4g} {budget:>10} {remaining:>10}"


_HEADER = f"{'user (key prefix)':<18} {'runs':>4} {'mu':>8} {'spent eps':>10} {'budget eps':>10} {'remaining':>10}"


def user_lines(url: str, key: str, users: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The lifetime accounts of ``users``, looked up by id with the budget secret in ``key`` (read-only)."""
    from ..budgets import user_account
    from ..enrollment import check_user_id
    from ..ledger.budgets import load_budget_secret, settings
    from ..ledger.db import check_version, read_snapshot, resolve_url

    users = [check_user_id(u) for u in users]
    secret = load_budget_secret(key)
    resolved = resolve_url(url)

    def read(conn):
        check_version(conn, resolved, allow_empty=False, allow_older=False)
        return settings(conn), [user_account(conn, secret, u) for u in users]

    info, accounts = read_snapshot(resolved, read)
    if info is None:
        return ["this ledger has no lifetime budgets"], {"budgets": None, "users": []}
    lines = [f"{'user':<18} " + _HEADER]
    for user, a in zip(users, accounts):
        lines.append(f"{user:<18.18} " + _account_row(a))
    data = {"budgets": {"default_epsilon": info.default_epsilon, "delta": info.delta},
            "users": [{"user": u, **a.__dict__} for u, a in zip(users, accounts)]}
    return lines, data


def account_lines(url: str) -> tuple[list[str], dict[str, Any]]:
    """The ledger's lifetime accounts as lines and as JSON (read-only; needs no secret)."""
    from ..budgets import user_accounts
    from ..ledger.budgets import settings
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
             _HEADER]
    lines += [_account_row(a) for a in accounts]
    data = {"budgets": {"default_epsilon": info.default_epsilon, "delta": info.delta},
            "users": [a.__dict__ for a in accounts]}
    return lines, data


def cmd_show(args: argparse.Namespace) -> int:
    if args.user:
        if args.key is None:
            raise ConfigError("--user needs --key FILE (a user's id is found through the budget secret)")
        lines, data = user_lines(args.ledger, args.key, args.user)
    else:
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
    q = commands.add_parser("set", help="set users' own lifetime budgets (one transaction: all or none)",
                            description="Give users their own lifetime epsilon: USER … EPS, and/or --users-file "
                                        "FILE; every user in one transaction.")
    q.add_argument("users", nargs="*", metavar="USER", help="user ids, as the runs know them")
    q.add_argument("epsilon", type=_epsilon, metavar="EPS",
                   help="lifetime epsilon, or 'none' (back to the default), for every user given")
    q.add_argument("--users-file", metavar="FILE",
                   help="more users: one id per line, optionally followed by a comma or blanks and that user's own "
                        "EPS; blank lines and # comments are skipped")
    common(q)
    q.set_defaults(func=cmd_set)
    q = commands.add_parser("show", help="list every user's spent and remaining lifetime budget (pseudonymous), "
                                         "or look users up by id")
    common(q, key=False)
    q.add_argument("--user", action="append", metavar="USER",
                   help="look up this user's account by id (repeatable; needs --key)")
    q.add_argument("--key", metavar="FILE", help="the budget secret file (for --user)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_show)
