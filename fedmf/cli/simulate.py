"""``fedmf simulate``: private federated training of a preset task, in process, with its audit."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ConfigError

__all__ = ["register", "cmd_simulate"]


def _overrides(args: argparse.Namespace) -> dict:
    values: dict = {}
    for option, key in (("mechanism", "mechanism"), ("rounds", "rounds"), ("clients_per_round", "clients-per-round"),
                        ("sampling", "sampling"), ("server_lr", "server-lr"), ("delta", "delta"),
                        ("bands", "num-bands"), ("min_sep", "min-sep")):
        value = getattr(args, option)
        if value is not None:
            values[key] = value
    if args.epsilon is not None and args.noise_multiplier is not None:
        raise ConfigError("give --epsilon or --noise-multiplier, not both")
    if args.epsilon is not None:
        values["target-epsilon"] = args.epsilon
        values["noise-multiplier"] = 0.0
    if args.noise_multiplier is not None:
        values["noise-multiplier"] = args.noise_multiplier
    options = {}
    if args.seed is not None:
        options["seed"] = args.seed
    if args.data is not None:
        data = Path(args.data)
        vocab = Path(args.vocab) if args.vocab else data.with_name("stackoverflow.word_count")
        values["task"] = "stackoverflow"
        options.update(path=str(data), vocab_path=str(vocab))
    if options:
        values["task-options"] = options
    values["run-dir"] = str(Path(args.out).resolve())
    return values


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the preset (with overrides) in process; print the summary (or one JSON object)."""
    from client.tasks import ClientHyper, get_task

    from ..config import RunConfig
    from ..simulate import preset_values, simulate

    if args.backend != "inprocess":
        raise ConfigError("the flower backend of fedmf simulate is not available yet: run the Flower app with "
                          "`flwr run .` (README, 'The Flower app'), or use --backend inprocess")
    values = preset_values(args.preset, _overrides(args))
    if args.data is not None:
        values["task-options"] = json.dumps({k: v for k, v in json.loads(values["task-options"]).items()
                                             if k in ("path", "vocab_path", "max_sentences", "model_size", "seed")})
    config = RunConfig.from_mapping(values)
    task = get_task(config.task, **config.task_options)
    result = simulate(config, model=task.model(), users=task.users(),
                      local_update=task.as_local_update(ClientHyper(config.client_lr, config.local_epochs,
                                                                    config.batch_size)),
                      evaluate=task.evaluate, progress=not (args.quiet or args.json), plot=not args.no_plot)
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
        return 0
    accuracy = "n/a" if result.accuracy is None else f"{result.accuracy:.4f}"
    lines = [
        f"preset          {args.preset} ({config.task}), {result.rounds_done} rounds ({result.stopped})",
        f"accuracy        {accuracy} (held-out, after the last round)",
        f"privacy         epsilon {result.epsilon:.4g} at delta {result.delta:g} (planned, spent so far); "
        f"noise multiplier {result.noise_multiplier:.4g}",
        f"time            {result.seconds:.1f} s",
        f"output          {result.out_dir} (ledger, checkpoints, results.json"
        + (", progress.png)" if result.plot else ")"),
        f"audit           {result.audit_command()}",
    ]
    print("\n".join(lines))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from ..simulate import PRESETS

    p = sub.add_parser("simulate", help="simulate private federated training of a preset task",
                       description="Train a preset task privately in process (the same private round the Flower "
                                   "server runs), write the ledger, checkpoints, results.json and a plot, and print "
                                   "the summary with the audit command. Running it again with the same --out resumes.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="so-tiny")
    p.add_argument("--mechanism", help="mechanism kind or a mechanism file (default: the preset's)")
    p.add_argument("--bands", type=int, help="bands of banded mechanisms")
    p.add_argument("--epsilon", type=float, help="target epsilon (calibrates the noise multiplier)")
    p.add_argument("--delta", type=float)
    p.add_argument("--noise-multiplier", type=float)
    p.add_argument("--sampling", help="none, bminsep:P, cyclic-poisson:Q or poisson:P")
    p.add_argument("--rounds", type=int)
    p.add_argument("--min-sep", type=int)
    p.add_argument("--clients-per-round", type=float)
    p.add_argument("--server-lr", type=float)
    p.add_argument("--seed", type=int, help="task data seed")
    p.add_argument("--data", help="the real StackOverflow file (TFF's stackoverflow.sqlite)")
    p.add_argument("--vocab", help="its vocabulary (default: stackoverflow.word_count beside --data)")
    p.add_argument("--backend", choices=("inprocess", "flower"), default="inprocess")
    p.add_argument("--out", default="fedmf-sim", help="output directory (default: ./fedmf-sim)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="do not write progress.png")
    p.set_defaults(func=cmd_simulate)
