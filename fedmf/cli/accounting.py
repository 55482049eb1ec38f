"""``fedmf epsilon`` and ``fedmf calibrate``.

    fedmf epsilon   --mechanism FILE --noise-multiplier Z --delta D [--participations K --min-sep B]
                    [--sampling SCHEME] [--per-round]
                    [--count-noise-std S] [--json]
    fedmf calibrate --mechanism FILE --epsilon E --delta D [same options] [--json]

SCHEME is a sampling scheme (``fedmf.sampling.GRAMMAR``). The schema is the one the mechanism file
was planned for, unless --participations / --min-sep override it (what is not given keeps its
planned value). The noise multiplier
follows the fedmf convention: noise std = Z · clip norm · sensitivity under that schema; the
JSON's ``noise_std_per_clip_norm`` is Z · sensitivity (the absolute std divided by the clip norm).
``--count-noise-std`` composes adaptive clipping's count release (``fedmf.accounting.count_release``);
``rho`` is the run's ρ-zCDP where the accounting is un-amplified (null, with ``rho_note``, otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

from ..sampling import GRAMMAR, parse_sampling
from .common import UsageError, minsep_schema

__all__ = ["register", "cmd_epsilon", "cmd_calibrate"]

_SAMPLING_HELP = (f"{GRAMMAR} (default none; bminsep: b-min-sep Poisson, b = min-sep; poisson: Poisson in every "
                  "round, MMCC)")


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{name} must be finite, got {text!r}")
        return value

    return parse


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mechanism", required=True, help="a file written by `fedmf mechanism --out`")
    parser.add_argument("--delta", type=_positive_float("--delta"), required=True, help="delta, in (0, 1)")
    parser.add_argument("--participations", type=int, help="k (default: as planned)")
    parser.add_argument("--min-sep", type=int, help="b (default: as planned)")
    parser.add_argument("--sampling", default="none", help=_SAMPLING_HELP)
    parser.add_argument("--accountant", choices=("pld", "rdp"), default="pld",
                        help="dp_accounting PLD (default) or RDP")
    parser.add_argument("--per-round", action="store_true", help="also epsilon after every round")
    parser.add_argument("--count-noise-std", type=_positive_float("--count-noise-std"),
                        help="adaptive clipping: std of the noise on each round's count of unclipped updates "
                             "(composed with the mechanism; sampling none or cyclic-poisson:Q)")
    mc = parser.add_argument_group("b-min-sep Monte Carlo")
    mc.add_argument("--samples", type=int, help="samples per verification (default: the fewest that certify delta)")
    mc.add_argument("--seed", type=int, help="random seed of the Monte Carlo accountant (default: fresh)")
    mc.add_argument("--workers", type=int, default=1, help="threads for the Monte Carlo accountant")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def register(subparsers: Any) -> None:
    """Register ``epsilon`` and ``calibrate`` on argparse sub-parsers (``add_subparsers()``)."""
    commands = (
        ("epsilon", "epsilon of a mechanism at a noise multiplier", "--noise-multiplier",
         "Z: noise std / (clip norm x sensitivity)", cmd_epsilon),
        ("calibrate", "the noise multiplier for a target (epsilon, delta)", "--epsilon", "target epsilon > 0",
         cmd_calibrate),
    )
    for name, summary, flag, flag_help, func in commands:
        sub = subparsers.add_parser(name, help=summary)
        sub.add_argument(flag, type=_positive_float(flag), required=True, help=flag_help)
        _common(sub)
        sub.set_defaults(func=func)


def _schema(args: argparse.Namespace, mechanism, planned):
    """The planned schema, with --participations / --min-sep overriding it."""
    from ..participation import FixedEpoch, MinSep

    n = mechanism.rounds
    k, b = args.participations, args.min_sep
    if k is not None and k <= 0:
        raise UsageError(f"--participations must be positive, got {k}")
    if b is not None and b <= 0:
        raise UsageError(f"--min-sep must be positive, got {b}")
    if k is None and b is None and planned is not None:
        return planned
    if isinstance(planned, (MinSep, FixedEpoch)):
        k = planned.max_participations if k is None else k
        b = planned.min_sep if b is None else b
    return minsep_schema(n, k, b)


def _options(args: argparse.Namespace):
    from ..accounting.accountant import MonteCarloOptions

    for name in ("samples", "workers"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name} must be positive, got {value}")
    return MonteCarloOptions(samples=args.samples, seed=args.seed, workers=args.workers)


def _load(args: argparse.Namespace):
    from ..accounting.schemes import has_per_round_curve
    from ..mechanisms.io import load_with_schema

    if not 0.0 < args.delta < 1.0:
        raise UsageError(f"--delta must lie in (0, 1), got {args.delta:g}")
    mechanism, planned, checksum = load_with_schema(args.mechanism)
    schema = _schema(args, mechanism, planned)
    schema.validate(mechanism.rounds)
    sampling = parse_sampling(args.sampling)
    if args.per_round and not has_per_round_curve(sampling):
        raise UsageError(f"--per-round is not available with {sampling.kind} sampling")
    return mechanism, schema, sampling, checksum


def _report(result, args, mechanism, schema, checksum, started: float) -> dict[str, Any]:
    out = result.to_dict()
    body: dict[str, Any] = {
        "epsilon": out.pop("epsilon"), "rho": out.pop("rho"), "delta": out.pop("delta"),
        "noise_multiplier": out.pop("noise_multiplier"),
        "sensitivity": out.pop("sensitivity"), "accountant": out.pop("accountant"),
        "noise_std_per_clip_norm": out.pop("noise_std_per_clip_norm"), "guarantee": out.pop("guarantee"), "sampling": out.pop("sampling"),
        "kind": mechanism.kind, "rounds": mechanism.rounds, "schema": schema.name,
        "participations": schema.participations(mechanism.rounds), "min_sep": schema.min_sep,
        "file": args.mechanism, "checksum": checksum,
    }
    body.update(out.pop("details"))
    out.pop("seconds")
    if "epsilon_by_round" in out:
        body["epsilon_by_round"] = out.pop("epsilon_by_round")
    body["seconds"] = round(time.perf_counter() - started, 6)
    return body


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, default=_jsonable))
        return
    width = max(len(k) for k in report)
    for key, value in report.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            value = " ".join(f"{v:.6g}" for v in value)
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, default=_jsonable)
        print(f"{key:<{width}}  {value}")


def _jsonable(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _command(args: argparse.Namespace, compute: Callable[..., Any], flag: str, value: float) -> int:
    """Shared body of ``epsilon`` and ``calibrate``: check ``flag`` (its parsed ``value``)
    is positive, load the mechanism and schema, run ``compute(mechanism, value, delta,
    schema, …)`` (``accountant.epsilon`` or ``accountant.calibrate``), print the report."""
    started = time.perf_counter()
    if not value > 0:
        raise UsageError(f"{flag} must be positive, got {value:g}")
    if args.count_noise_std is not None and not args.count_noise_std > 0:
        raise UsageError(f"--count-noise-std must be positive, got {args.count_noise_std:g}")
    mechanism, schema, sampling, checksum = _load(args)
    result = compute(mechanism, value, args.delta, schema, sampling=sampling, accountant=args.accountant,
                     per_round=args.per_round, monte_carlo=_options(args), count_noise_std=args.count_noise_std)
    _print(_report(result, args, mechanism, schema, checksum, started), args.json)
    return 0


def cmd_epsilon(args: argparse.Namespace) -> int:
    """``fedmf epsilon``: epsilon of a saved mechanism at a noise multiplier."""
    from ..accounting import accountant

    return _command(args, accountant.epsilon, "--noise-multiplier", args.noise_multiplier)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``fedmf calibrate``: the noise multiplier that reaches a target (epsilon, delta)."""
    from ..accounting import accountant

    return _command(args, accountant.calibrate, "--epsilon", args.epsilon)
