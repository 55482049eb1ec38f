"""``fedmf user keygen|enroll|rotate|revoke|list``: user key pairs and the operator's enrollment file.

The data owner runs ``keygen`` on their own machine and sends only the ``.pub`` file; the operator
runs ``enroll`` / ``rotate`` / ``revoke`` on the enrollment file the server reads (``user-enrollment``
in the run configuration). Every write of the enrollment file is atomic; the private key is never printed.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["register"]


def _load_or_empty(path: str, create: bool):
    from ..enrollment import Enrollment

    if create and not os.path.exists(path):
        return Enrollment({})
    return Enrollment.load(path)


def cmd_keygen(args: argparse.Namespace) -> int:
    from ..enrollment import fingerprint, generate_key_pair

    public = generate_key_pair(args.out)
    print(f"private key {args.out} (0600: keep it on this machine; give its path as the SuperNode's user-key)")
    print(f"public key  {args.out}.pub (fingerprint {fingerprint(public)}): send it to the operator")
    return 0


def cmd_change(args: argparse.Namespace) -> int:
    from ..enrollment import check_user_id, fingerprint, read_public_key

    user = check_user_id(args.user)
    enrollment = _load_or_empty(args.enrollment, create=args.command_name == "enroll")
    if args.command_name == "revoke":
        enrollment.without_user(user).save(args.enrollment)
        print(f"revoked {user!r} in {args.enrollment}")
        return 0
    public = read_public_key(args.public_key)
    enrollment.with_user(user, public, replace=args.command_name == "rotate").save(args.enrollment)
    print(f"{'enrolled' if args.command_name == 'enroll' else 'rotated'} {user!r} (key fingerprint "
          f"{fingerprint(public)}) in {args.enrollment}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from ..enrollment import Enrollment, fingerprint

    for user, key in sorted(Enrollment.load(args.enrollment).users.items()):
        print(f"{user}\t{fingerprint(key)}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``user`` and its sub-commands to fedmf's sub-parsers."""
    p = subparsers.add_parser("user", help="user key pairs and the enrollment file",
                              description="Make a user key pair; enroll, rotate or revoke users in the "
                                          "enrollment file the server verifies identities against.")
    sub = p.add_subparsers(dest="user_command", required=True, parser_class=type(p))
    keygen = sub.add_parser("keygen", help="make a user key pair (on the data owner's machine)")
    keygen.add_argument("--out", required=True, metavar="FILE",
                        help="private key file to create (0600); the public key goes to FILE.pub")
    keygen.set_defaults(func=cmd_keygen)
    for name, text in (("enroll", "enroll a user with a public key (creates the file if missing)"),
                       ("rotate", "replace an enrolled user's public key"),
                       ("revoke", "remove a user from the enrollment file")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--enrollment", required=True, metavar="FILE", help="the enrollment file")
        q.add_argument("--user", required=True, metavar="ID", help="the user id (as in the SuperNode's user-id)")
        if name != "revoke":
            q.add_argument("--public-key", required=True, metavar="FILE.pub", help="the user's public key file")
        q.set_defaults(func=cmd_change, command_name=name)
    listing = sub.add_parser("list", help="enrolled users and their key fingerprints")
    listing.add_argument("--enrollment", required=True, metavar="FILE", help="the enrollment file")
    listing.set_defaults(func=cmd_list)
