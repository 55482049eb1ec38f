"""``fedmf audit-empirical``: run a preset task (default ``tiny``) with canary users and print a
statistical lower bound on ε from the released models (fedmf/audit/empirical.py), beside the
accounted ε."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..sampling import GRAMMAR
from .common import UsageError

#: more canaries than this is a typo, not an audit (each needs a direction of the model's size)
MAX_CANARIES = 100_000

__all__ = ["register", "cmd_audit_empirical"]


def _overrides(args: argparse.Namespace) -> dict:
    if args.epsilon is not None and args.noise_multiplier is not None:
        raise UsageError("give --epsilon or --noise-multiplier, not both")
    for option, value in (("--epsilon", args.epsilon), ("--noise-multiplier", args.noise_multiplier)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{option} must be a finite number > 0, got {value:g}")
    values: dict = {}
    for option, key in (("mechanism", "mechanism"), ("rounds", "rounds"), ("clients_per_round", "clients-per-round"),
                        ("sampling", "sampling"), ("server_lr", "server-lr"), ("delta", "delta"),
                        ("min_sep", "min-sep")):
        value = getattr(args, option)
        if value is not None:
            values[key] = value
    if args.epsilon is not None:
        values["target-epsilon"] = args.epsilon
        values["noise-multiplier"] = 0.0
    if args.noise_multiplier is not None:
        values["noise-multiplier"] = args.noise_multiplier
    return values


def cmd_audit_empirical(args: argparse.Namespace) -> int:
    """Build the preset's plan with the overrides, run the canary audit, print the bound."""
    from fedmf.tasks import ClientHyper, get_task

    from ..audit.empirical import run_canary_audit
    from ..config import RunConfig
    from ..files import atomic_write
    from ..run.simulate import preset_values

    if not 2 <= args.canaries <= MAX_CANARIES:
        raise UsageError(f"--canaries must lie in [2, {MAX_CANARIES}], got {args.canaries}")
    if not (math.isfinite(args.confidence) and 0 < args.confidence < 1):
        raise UsageError(f"--confidence must lie in (0, 1), got {args.confidence:g}")
    if args.seed is not None and args.seed < 0:
        raise UsageError("--seed must be a non-negative integer")
    out = Path(args.out) if args.out else None
    if out is not None and (out.is_file() or (out.is_dir() and any(out.iterdir()))):
        raise UsageError(f"--out {str(out)!r} exists and is not an empty directory; the audit needs a new run "
                         "directory")
    config = RunConfig.from_mapping(preset_values(args.preset, _overrides(args)))
    task = get_task(config.task, **config.task_options)
    plan = config.build_plan()
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    result = run_canary_audit(task.model(), task.users(), plan, task.as_local_update(hyper), canaries=args.canaries,
                              seed=args.seed, confidence=args.confidence, server_lr=config.server_lr,
                              checkpoint_dir=out)  # a private SQLite ledger: it reveals the canaries' coins
    report = result.to_dict()
    if out is not None:
        atomic_write(out / "audit.json", lambda f: json.dump(report, f, indent=1, allow_nan=False), text=True,
                     mode=0o600)
    if args.json:
        print(json.dumps(report, allow_nan=False))
        return 0
    lines = [result.summary(),
             f"canaries {result.canaries} ({result.canaries_in} in, {result.canaries_out} out, "
             f"{result.canaries_scored} scored); best rule: {result.correct} of {result.guesses} guesses correct; "
             f"delta {result.delta:g}; {result.rounds_done} rounds, {result.dimension} parameters"]
    if result.violated():
        lines.append("the lower bound exceeds the accounted epsilon: evidence of a privacy bug "
                     f"(or a {100 * (1 - result.confidence):g}% chance event)")
    lines += result.notes
    if out is not None:
        lines.append(f"output {out} (ledger, checkpoints, audit.json)")
    print("\n".join(lines))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from ..run.simulate import PRESETS

    p = sub.add_parser("audit-empirical", help="empirical lower bound on epsilon from a run with canary users",
                       description="Run a preset task privately with canary users added (each, by a fair coin, "
                                   "sends a fixed random direction at the clip norm or a zero update), recover the "
                                   "privatized updates from the released models, and print a lower bound on epsilon "
                                   "that holds with the given confidence (Steinke, Nasr and Jagielski 2023, one-run "
                                   "auditing), beside the accounted epsilon. A bound above the accounted epsilon is "
                                   "evidence of a privacy bug.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="the task the canaries join (default: tiny, seconds; see fedmf simulate --help for the "
                        "others' cost)")
    p.add_argument("--canaries", type=int, default=200, help="canary users added to the population (default 200)")
    p.add_argument("--epsilon", type=float, help="target epsilon (calibrates the noise multiplier)")
    p.add_argument("--noise-multiplier", type=float,
                   help="a fixed noise multiplier z instead of a target --epsilon")
    p.add_argument("--delta", type=float, help="delta of the accounted (epsilon, delta) (default: the preset's)")
    p.add_argument("--rounds", type=int, help="rounds in the run (default: the preset's)")
    p.add_argument("--min-sep", type=int,
                   help="least rounds between two participations of one user (default: the preset's)")
    p.add_argument("--clients-per-round", type=float, default=40.0,
                   help="users per round, canaries included (default 40); with --sampling the expected "
                        "number planned for (the real mean grows with the canaries)")
    p.add_argument("--mechanism", help="mechanism kind or a mechanism file (default: the preset's)")
    p.add_argument("--sampling", help=f"the sampling scheme, {GRAMMAR}")
    p.add_argument("--server-lr", type=float, help="the server optimizer's learning rate (default: the preset's)")
    p.add_argument("--seed", type=int, help="the audit's seed: canary directions and coins (default: random; "
                                            "never printed)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound (default 0.95)")
    p.add_argument("--out", help="a new run directory to keep (ledger, checkpoints, audit.json); default: a "
                                 "temporary one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_audit_empirical)
