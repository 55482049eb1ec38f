"""``fedmf mechanism`` (build or optimize a mechanism, print its error, save it) and
``fedmf evaluate`` (a saved mechanism under another participation schema)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import TYPE_CHECKING, Any

from .common import UsageError, check_output, fixed_epoch_schema, minsep_schema

if TYPE_CHECKING:
    from ..mechanisms import Mechanism
    from ..participation import Schema

__all__ = ["register", "cmd_mechanism", "cmd_evaluate"]


def _parse_range(text: str) -> tuple[int, int]:
    try:
        b0, b1 = (int(x) for x in text.split(":"))
    except ValueError:
        raise UsageError(f"--min-sep-range must look like B0:B1, got {text!r}") from None
    if not 1 <= b0 <= b1:
        raise UsageError(f"--min-sep-range needs 1 <= B0 <= B1, got {b0}:{b1}")
    return b0, b1


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
    for key in ("num_bands", "gamma", "num_buffers", "min_sep_range"):
        value = params.get(key, getattr(mechanism, key, None))
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
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
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in value.items())
        print(f"{key:<{width}}  {value}")


def cmd_mechanism(args: argparse.Namespace) -> int:
    """``fedmf mechanism KIND …``: build or optimize a mechanism, print its error, optionally save it."""
    from ..mechanisms import KINDS, mechanism_class, plan
    from ..mechanisms.io import save
    from ..participation import FixedEpoch
    from ..run.progress import ProgressBar
    from ..workloads import parse_workload

    started = time.perf_counter()
    if args.rounds <= 0:
        raise UsageError(f"--rounds must be positive, got {args.rounds}")
    if args.kind not in KINDS:
        raise UsageError(f"unknown mechanism kind {args.kind!r} (available: {', '.join(KINDS)})")
    if args.gamma is not None and not 0.0 < args.gamma < 1.0:
        raise UsageError(f"--gamma must lie in (0, 1), got {args.gamma}")
    if args.bands is not None and not 1 <= args.bands <= args.rounds:
        raise UsageError(f"--bands must lie in [1, rounds={args.rounds}], got {args.bands}")
    if args.buffers is not None and not 1 <= args.buffers <= 15:
        raise UsageError(f"--buffers must lie in [1, 15], got {args.buffers}")
    check_output("--out", args.out)
    workload = parse_workload(args.workload)
    family = mechanism_class(args.kind)
    min_sep_range = None
    if "min_sep_range" in family.options:
        if args.min_sep_range is None:
            raise UsageError(f"{args.kind} needs --min-sep-range B0:B1")
        if args.min_sep is not None:
            raise UsageError(f"{args.kind} takes --min-sep-range instead of --min-sep")
        min_sep_range = _parse_range(args.min_sep_range)
        if min_sep_range[1] > args.rounds:
            raise UsageError(f"--min-sep-range B1={min_sep_range[1]} exceeds the number of rounds n={args.rounds}")
        k = args.participations if args.participations is not None else math.ceil(args.rounds / min_sep_range[1])
        schema: Schema = minsep_schema(args.rounds, k, min_sep_range[1])
    elif args.min_sep_range is not None or args.taper:
        takers = [k for k in KINDS if "min_sep_range" in mechanism_class(k).options]
        raise UsageError(f"--min-sep-range and --taper apply to {', '.join(takers)} only")
    elif family.planned_schema is FixedEpoch:
        schema = fixed_epoch_schema(args.rounds, args.participations, args.min_sep)
    else:
        schema = minsep_schema(args.rounds, args.participations, args.min_sep)
    if family.bands_within_min_sep and args.bands is not None and args.bands > schema.min_sep:
        raise UsageError(f"{args.kind} needs --bands p <= --min-sep b under MinSep (got {args.bands} > {schema.min_sep})")
    progress = None if args.quiet else ProgressBar(f"fedmf mechanism {args.kind}", unit="steps")
    mechanism, result = plan(
        args.kind, args.rounds, schema, workload,
        num_bands=args.bands, gamma=args.gamma, error=args.error, num_buffers=args.buffers,
        min_sep_range=min_sep_range, taper=args.taper, weighting=args.weighting,
        tolerance=args.tolerance, max_steps=args.max_steps, device=args.device, progress=progress,
    )
    extra: dict[str, Any] = {}
    if result is not None:
        extra.update(result.to_dict())
        extra["optimizer_seconds"] = round(result.seconds, 6)
    if min_sep_range is not None:
        from ..mechanisms.robust import rmse_by_min_sep, separation_grid

        by_sep = rmse_by_min_sep(mechanism, separation_grid(*min_sep_range, points=5), schema.max_participations)
        extra["rmse_by_min_sep"] = {str(s): v for s, v in by_sep.items()}
        extra["worst_case_rmse"] = max(by_sep.values())
    code = 0
    if args.out:
        if result is not None and not result.converged and not args.save_unconverged:
            extra["file"] = None
            print(f"fedmf: error: optimization did not converge; {args.out!r} not written "
                  "(--save-unconverged keeps it, marked unconverged)", file=sys.stderr)
            code = 1
        else:
            marks = {"converged": result.converged, **result.to_dict()} if result is not None else None
            extra["checksum"] = save(mechanism, args.out, schema, extra=marks)
            extra["file"] = args.out
    _print(_report(mechanism, schema, started, extra), args.json)
    return code


def cmd_evaluate(args: argparse.Namespace) -> int:
    """``fedmf evaluate``: a saved mechanism's error under its planned schema or another one."""
    from ..mechanisms.io import load_with_schema
    from ..participation import MinSep

    started = time.perf_counter()
    mechanism, planned, checksum = load_with_schema(args.mechanism)
    n = mechanism.rounds
    k = args.participations
    if args.fixed_epoch:
        if k is None and planned is not None:
            k = planned.participations(n)
        schema: Schema = fixed_epoch_schema(n, k, None)
    elif k is None and args.min_sep is None and planned is not None:
        schema = planned
    else:
        # options override the planned schema; what is not given keeps its planned value
        b = args.min_sep
        if isinstance(planned, MinSep):
            k = planned.max_participations if k is None else k
            b = planned.min_sep if b is None else b
        schema = minsep_schema(n, k, b)
    _print(_report(mechanism, schema, started, {"checksum": checksum, "file": args.mechanism}), args.json)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``mechanism`` and ``evaluate`` to fedmf's sub-parsers."""
    from ..mechanisms import KINDS

    mech = sub.add_parser("mechanism", help="build a mechanism and print its error")
    mech.add_argument("kind", help=f"one of: {', '.join(KINDS)}")
    mech.add_argument("--rounds", type=int, required=True, help="n, rounds in the run")
    mech.add_argument("--participations", type=int, help="k, most rounds per user (default ceil(n/b))")
    mech.add_argument("--min-sep", type=int, help="b, least rounds between two participations (default n/k)")
    mech.add_argument("--bands", type=int, help="p, bands of C (bsr) or C^-1 (bisr, bifr); default min(b, 64)")
    mech.add_argument("--gamma", type=float, help="bifr exponent in (0, 1); default: optimized for the schema")
    mech.add_argument("--workload", default="prefix", help="prefix | momentum:BETA[:cooldown=F][:final=G]")
    mech.add_argument("--error", choices=("mean", "max"), default="mean", help="objective of optimized kinds")
    mech.add_argument("--buffers", type=int, help="blt: number of buffers (default: chosen automatically)")
    mech.add_argument("--min-sep-range", help="robust: B0:B1, the range the real min-separation lies in")
    mech.add_argument("--taper", action="store_true", help="robust: the App. H taper heuristic instead")
    mech.add_argument("--weighting", choices=("worst", "mean"), default="worst", help="robust: over the range")
    mech.add_argument("--tolerance", type=float, help="optimizer stopping tolerance (kind-specific default)")
    mech.add_argument("--max-steps", type=int, help="optimizer step limit")
    mech.add_argument("--device", help="dense: torch device (default cuda when available)")
    mech.add_argument("--quiet", action="store_true",
                      help="no progress on stderr (default: a live bar with the time left on a terminal, a plain "
                           "line every 10 s on a pipe or in a log)")
    mech.add_argument("--save-unconverged", action="store_true", help="save even if the optimizer did not converge")
    mech.add_argument("--out", help="save the mechanism to this file")
    mech.add_argument("--json", action="store_true", help="print one JSON object")
    for name, flag in (("num_bands", "--bands"), ("num_buffers", "--buffers"), ("max_participations",
                                                                                 "--participations")):
        mech.alias(name, flag)  # the engine's names for these options (errors name the flag)
    mech.set_defaults(func=cmd_mechanism)

    ev = sub.add_parser("evaluate", help="evaluate a saved mechanism under another schema")
    ev.add_argument("--mechanism", required=True, help="a file written by `fedmf mechanism --out`")
    ev.add_argument("--participations", type=int, help="k (default: as planned)")
    group = ev.add_mutually_exclusive_group()
    group.add_argument("--min-sep", type=int, help="b for MinSep(b, k) (default: as planned)")
    group.add_argument("--fixed-epoch", action="store_true", help="FixedEpoch(k, n/k)")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=cmd_evaluate)
