"""The ``fedmf`` command line. Bad input: one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Sequence

from .mechanisms import KINDS, Mechanism, build
from .mechanisms.io import load_with_schema, save
from .participation import FixedEpoch, MinSep, Schema
from .workloads import parse_workload

__all__ = ["main"]


class UsageError(ValueError):
    """Bad command-line input."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        raise UsageError(message)


def _minsep_schema(rounds: int, participations: int | None, min_sep: int | None) -> MinSep:
    """MinSep from the options: k defaults to ceil(n/b); b defaults to floor(n/k); neither: b = n."""
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


def _report(mechanism: Mechanism, schema: Schema, started: float, extra: dict[str, Any]) -> dict[str, Any]:
    metrics = mechanism.evaluate(schema)
    params = mechanism.params()
    out: dict[str, Any] = {
        "kind": mechanism.kind,
        "rounds": mechanism.rounds,
        "participations": schema.participations(mechanism.rounds),
        "min_sep": schema.min_sep,
        "schema": schema.name,
        "workload": mechanism.workload.name,
    }
    for key in ("num_bands", "gamma"):
        value = params.get(key, getattr(mechanism, key, None))
        if value is not None:
            out[key] = value
    out.update(metrics)
    out.update(extra)
    out["seconds"] = round(time.perf_counter() - started, 6)
    return out


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    width = max(len(k) for k in report)
    for key, value in report.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        print(f"{key:<{width}}  {value}")


def _cmd_mechanism(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.rounds <= 0:
        raise UsageError(f"--rounds must be positive, got {args.rounds}")
    if args.kind not in KINDS:
        raise UsageError(f"unknown mechanism kind {args.kind!r} (available: {', '.join(KINDS)})")
    if args.gamma is not None and not 0.0 < args.gamma < 1.0:
        raise UsageError(f"--gamma must lie in (0, 1), got {args.gamma}")
    if args.bands is not None and not 1 <= args.bands <= args.rounds:
        raise UsageError(f"--bands must lie in [1, rounds={args.rounds}], got {args.bands}")
    schema = _minsep_schema(args.rounds, args.participations, args.min_sep)
    workload = parse_workload(args.workload)
    mechanism = build(args.kind, args.rounds, schema, workload, args.bands, args.gamma)
    extra: dict[str, Any] = {}
    if args.out:
        extra["checksum"] = save(mechanism, args.out, schema)
        extra["file"] = args.out
    _print(_report(mechanism, schema, started, extra), args.json)
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    mechanism, planned, checksum = load_with_schema(args.mechanism)
    n = mechanism.rounds
    k = args.participations
    if args.fixed_epoch:
        if k is None:
            k = planned.participations(n) if planned is not None else None
        if k is None or k <= 0 or n % k:
            raise UsageError(f"--fixed-epoch needs --participations k dividing rounds={n}")
        schema: Schema = FixedEpoch(k, n // k)
    else:
        # options override the planned schema; what is not given keeps its planned value
        b = args.min_sep
        if isinstance(planned, MinSep):
            k = planned.max_participations if k is None else k
            b = planned.min_sep if b is None else b
        schema = _minsep_schema(n, k, b)
    _print(_report(mechanism, schema, started, {"checksum": checksum, "file": args.mechanism}), args.json)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedmf", description="Correlated-noise DP for federated learning.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mech = sub.add_parser("mechanism", help="build a mechanism and print its error")
    mech.add_argument("kind", help=f"one of: {', '.join(KINDS)}")
    mech.add_argument("--rounds", type=int, required=True, help="n, rounds in the run")
    mech.add_argument("--participations", type=int, help="k, most rounds per user (default ceil(n/b))")
    mech.add_argument("--min-sep", type=int, help="b, least rounds between two participations (default n/k)")
    mech.add_argument("--bands", type=int, help="p, bands of C (bsr) or C^-1 (bisr, bifr); default min(b, 64)")
    mech.add_argument("--gamma", type=float, help="bifr exponent in (0, 1); default: optimized for the schema")
    mech.add_argument("--workload", default="prefix", help="prefix | momentum:BETA[:cooldown=F][:final=G]")
    mech.add_argument("--out", help="save the mechanism to this file")
    mech.add_argument("--json", action="store_true", help="print one JSON object")
    mech.set_defaults(func=_cmd_mechanism)

    ev = sub.add_parser("evaluate", help="evaluate a saved mechanism under another schema")
    ev.add_argument("--mechanism", required=True, help="a file written by `fedmf mechanism --out`")
    ev.add_argument("--participations", type=int, help="k (default: as planned)")
    group = ev.add_mutually_exclusive_group()
    group.add_argument("--min-sep", type=int, help="b for MinSep(b, k) (default: as planned)")
    group.add_argument("--fixed-epoch", action="store_true", help="FixedEpoch(k, n/k)")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=_cmd_evaluate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return args.func(args)
    except ValueError as e:  # UsageError, MechanismFileError and library validation errors
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"fedmf: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedmf: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
