"""``fedmf simulate``: private federated training of a preset task, with its audit — in process
(``--backend inprocess``) or as the Flower app on the Flower simulation engine (``--backend flower``:
``launcher.flower_backend``, found through its entry point and loaded only then). With
``--secure-aggregation`` every round's sum is computed by SecAgg+: in process by the
``fedmf.secure_aggregation`` entry point ``secaggplus`` (``server/secagg_inprocess.py``), on Flower by
the app's ``secure-aggregation = "secaggplus"``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .. import checks
from ..errors import ConfigError
from ..sampling import GRAMMAR

__all__ = ["register", "cmd_simulate", "BACKENDS_GROUP", "SECURE_AGGREGATION_GROUP"]


def _overrides(args: argparse.Namespace) -> dict:
    values: dict = {}
    for option, key in (("mechanism", "mechanism"), ("rounds", "rounds"), ("clients_per_round", "clients-per-round"),
                        ("sampling", "sampling"), ("server_lr", "server-lr"), ("delta", "delta"),
                        ("bands", "num-bands"), ("min_sep", "min-sep"), ("clip_norm", "clip-norm"),
                        ("adaptive_clipping", "adaptive-clipping"), ("adaptive_clipping_lr", "adaptive-clipping-lr"),
                        ("adaptive_clipping_count_noise", "adaptive-clipping-count-noise"),
                        ("adaptive_clipping_range", "adaptive-clipping-range"),
                        ("adaptive_clipping_max_growth", "adaptive-clipping-max-growth"), ("ledger", "ledger-url"),
                        ("client_metrics", "client-metrics"), ("client_metrics_clip", "client-metrics-clip"),
                        ("client_metrics_noise", "client-metrics-noise"),
                        ("min_clients_per_round", "min-clients-per-round")):
        value = getattr(args, option)
        if value is not None:
            values[key] = value
    if args.adaptive_clipping is None:
        for option in ("adaptive_clipping_lr", "adaptive_clipping_count_noise", "adaptive_clipping_range",
                       "adaptive_clipping_max_growth"):
            if getattr(args, option) is not None:
                raise ConfigError(f"--{option.replace('_', '-')} needs --adaptive-clipping QUANTILE")
    elif not 0 < args.adaptive_clipping < 1:
        raise ConfigError(f"--adaptive-clipping is a target quantile in (0, 1), got {args.adaptive_clipping:g}")
    if args.adaptive_clipping_count_noise is not None and not args.adaptive_clipping_count_noise > 0:
        raise ConfigError(f"--adaptive-clipping-count-noise must be > 0, got {args.adaptive_clipping_count_noise:g}")
    if args.client_metrics != "private":
        for option in ("client_metrics_clip", "client_metrics_noise"):
            if getattr(args, option) is not None:
                raise ConfigError(f"--{option.replace('_', '-')} needs --client-metrics private")
    for option in ("client_metrics_clip", "client_metrics_noise"):
        value = getattr(args, option)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive number, got {value:g}")
    if args.adaptive_clipping_range is not None and not 1 <= args.adaptive_clipping_range <= 1e6:
        raise ConfigError("--adaptive-clipping-range is a factor R in [1, 1e6] (ζ never goes below ζ₀/R, nor above "
                          f"ζ₀·R unless --adaptive-clipping-max-growth is set), got {args.adaptive_clipping_range:g}")
    if args.adaptive_clipping_max_growth is not None and not 1 <= args.adaptive_clipping_max_growth <= 1e6:
        raise ConfigError(f"--adaptive-clipping-max-growth is a factor G in [1, 1e6] (ζ never exceeds ζ₀·G), got "
                          f"{args.adaptive_clipping_max_growth:g}")
    if args.epsilon is not None and args.noise_multiplier is not None:
        raise ConfigError("give --epsilon or --noise-multiplier, not both")
    if args.epsilon is not None:
        values["target-epsilon"] = args.epsilon
        values["noise-multiplier"] = 0.0
    if args.noise_multiplier is not None:
        values["noise-multiplier"] = args.noise_multiplier
    if args.stop_when_diverging:
        values["stop-when-diverging"] = True
    options = {}
    if args.seed is not None:
        options["seed"] = args.seed
    if args.data is not None:
        data = Path(args.data)
        vocab = Path(args.vocab) if args.vocab else data.with_name("stackoverflow.word_count")
        values["task"] = "stackoverflow"
        options.update(path=str(data.resolve()), vocab_path=str(vocab.resolve()))
    if options:
        values["task-options"] = options
    values["run-dir"] = str(Path(args.out).resolve())
    return values


#: the entry-point group of the ``--backend`` implementations other than inprocess (pyproject.toml)
BACKENDS_GROUP = "fedmf.simulate_backends"


#: the entry-point group of the in-process secure aggregation (``secaggplus``: server/secagg_inprocess.py)
SECURE_AGGREGATION_GROUP = "fedmf.secure_aggregation"
_SECAGG_OPTIONS = ("secagg_degree", "secagg_threshold", "secagg_bits", "secagg_scale")


def _entry_point(group: str, name: str, flag: str):
    """The implementation registered as ``name`` under the entry points of ``group``; a one-line
    ConfigError naming ``flag`` when it is not installed. Looked up, never imported by name: the
    engine imports no adapter."""
    from importlib.metadata import entry_points

    found = entry_points(group=group, name=name)
    if not found:
        raise ConfigError(f"{flag} is not installed (no {name!r} entry point in {group!r}: "
                          f"install fedmf from its source tree, pip install -e <checkout>)")
    try:
        return next(iter(found)).load()
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{flag} cannot be loaded ({e})") from None


def _graph(params) -> str:
    """SecAgg+'s degree and threshold as the summary says them."""
    if params.derived:
        return "degree and threshold derived from each round's cohort"
    return f"degree {params.degree}, threshold {params.threshold}"


def _backend(name: str):
    """The ``--backend name`` implementation registered under the ``fedmf.simulate_backends`` entry
    points (``flower``: ``launcher.flower_backend.simulate_flower``)."""
    return _entry_point(BACKENDS_GROUP, name, f"--backend {name}")


def _secure_aggregation(args: argparse.Namespace):
    """``--secure-aggregation`` and its ``--secagg-*`` options checked: the SecAgg+ parameters, or None
    (one-line ConfigErrors)."""
    from ..secagg import params as secagg

    given = [f"--{o.replace('_', '-')}" for o in _SECAGG_OPTIONS if getattr(args, o) is not None]
    if not args.secure_aggregation:
        if given:
            raise ConfigError(f"{given[0]} needs --secure-aggregation")
        return None
    for option in ("secagg_degree", "secagg_threshold", "secagg_bits"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive integer, got {value}")
    if args.secagg_scale is not None and not (args.secagg_scale > 0 and math.isfinite(args.secagg_scale)):
        raise ConfigError(f"--secagg-scale must be a positive number, got {args.secagg_scale:g}")
    defaults = {"secagg_degree": secagg.DEFAULT_DEGREE, "secagg_threshold": secagg.DEFAULT_THRESHOLD,
                "secagg_bits": secagg.DEFAULT_BITS, "secagg_scale": secagg.DEFAULT_SCALE}
    chosen = {o: defaults[o] if getattr(args, o) is None else getattr(args, o) for o in _SECAGG_OPTIONS}
    return secagg.SecAggParams(degree=chosen["secagg_degree"], threshold=chosen["secagg_threshold"],
                               bits=chosen["secagg_bits"], scale=chosen["secagg_scale"])  # SecAggError: one line


def _flower_secagg(params) -> dict:
    """The Flower app's run-config keys of ``params`` (server/config.py)."""
    return {"secure-aggregation": "secaggplus", "secagg-degree": params.degree,
            "secagg-threshold": params.threshold, "secagg-bits": params.bits, "secagg-scale": float(params.scale)}


def _check_device(device: str) -> None:
    import torch

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine")


def _ray_options(args: argparse.Namespace) -> dict:
    """``--ray-address``, ``--client-cpus``, ``--client-gpus`` checked, as the Flower backend's keyword
    arguments ({} when none was given); one-line ConfigErrors, and refused for --backend inprocess."""
    given = [f"--{o.replace('_', '-')}" for o in ("ray_address", "client_cpus", "client_gpus")
             if getattr(args, o) is not None]
    if not given:
        return {}
    if args.backend != "flower":
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --backend flower "
                          "(the in-process backend runs no Ray)")
    out: dict = {}
    if args.ray_address is not None:
        if "://" in args.ray_address:
            raise ConfigError(f"--ray-address takes the cluster's GCS address HOST:PORT (the head's `ray start "
                              f"--port`), not a URL: got {args.ray_address!r}")
        out["ray_address"] = checks.host_port("--ray-address", args.ray_address)
    if args.client_cpus is not None:
        cpus = args.client_cpus
        if not (math.isfinite(cpus) and cpus >= 1 and cpus == int(cpus)):
            raise ConfigError(f"--client-cpus must be a whole number of CPUs >= 1 (Flower 1.42 counts a client's "
                              f"CPUs in whole CPUs), got {args.client_cpus:g}")
        out["client_cpus"] = int(args.client_cpus)
    if args.client_gpus is not None:
        out["client_gpus"] = checks.interval("--client-gpus", args.client_gpus, 0, math.inf)
        if out["client_gpus"] > 0 and args.ray_address is None:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"--client-gpus {args.client_gpus:g}: CUDA is not available on this machine "
                                  "(the local Ray would place no client)")
    return out


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the preset (with overrides) in process or on the Flower simulation engine; print the
    summary (or one JSON object)."""
    from fedmf.tasks import ClientHyper, get_task
    from fedmf.tasks.base import MAX_WORKERS, default_workers

    from ..config import RunConfig
    from ..run.private_run import REPEATABLE_NOISE_WARNING, repeatable_noise_from_env
    from ..run.progress import ProgressBar
    from ..run.simulate import PRESET_EVAL_EVERY, preset_values, simulate

    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.device is not None and not args.vectorized:
        raise ConfigError("--device needs --vectorized (one-at-a-time clients train on the CPU)")
    if args.vectorized and args.backend == "flower":
        raise ConfigError("--vectorized is for --backend inprocess (on Flower every user is its own SuperNode)")
    if args.device is not None:
        _check_device(args.device)
    if args.chunk_users is not None:
        if not args.vectorized:
            raise ConfigError("--chunk-users needs --vectorized (users trained together, this many at a time)")
        if args.chunk_users < 1:
            raise ConfigError(f"--chunk-users must be an integer >= 1, got {args.chunk_users}")
    if args.eval_every is not None:
        if args.backend == "flower":
            raise ConfigError("--eval-every is for --backend inprocess (the ServerApp evaluates every round)")
        if args.eval_every < 1:
            raise ConfigError(f"--eval-every must be an integer >= 1, got {args.eval_every}")
    ray_options = _ray_options(args)
    secure = _secure_aggregation(args)
    if args.workers is not None:
        if args.vectorized or args.backend == "flower":
            raise ConfigError("--workers is for one-at-a-time clients in process (not --vectorized, not "
                              "--backend flower: Flower runs its own ClientApp actors)")
        if not 1 <= args.workers <= MAX_WORKERS:
            raise ConfigError(f"--workers must be an integer in [1, {MAX_WORKERS}], got {args.workers}")
    values = preset_values(args.preset, _overrides(args))
    if args.data is not None:
        values["task-options"] = json.dumps({k: v for k, v in json.loads(values["task-options"]).items()
                                             if k in ("path", "vocab_path", "max_sentences", "model_size", "seed")})
    if args.budget_key is not None:
        values["budget-key"] = args.budget_key
    if args.witness is not None:
        values["witness"] = args.witness
    config = RunConfig.from_mapping(values)
    task = get_task(config.task, **config.task_options)
    repeatable = repeatable_noise_from_env()  # the Flower app reads it too (inherited)
    if repeatable:  # even with --quiet / --json: never silent
        print(f"fedmf: warning: {REPEATABLE_NOISE_WARNING}", file=sys.stderr)
    if args.backend == "flower":
        if secure is not None:  # the app's keys, beside the engine's (RunConfig knows none of them)
            values = {**values, **_flower_secagg(secure)}
        result = _backend("flower")(config, values, task, timeout=args.timeout,
                                    echo=None if (args.quiet or args.json) else sys.stderr, plot=not args.no_plot,
                                    **ray_options)
    else:
        hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
        workers = default_workers() if args.workers is None else args.workers
        losses = config.client_metrics == "private"  # the clients' loss reaches only its private release
        if args.vectorized:
            clients = {"local_updates": task.as_local_updates(hyper, device=args.device, chunk_users=args.chunk_users,
                                                              with_metrics=losses)}
        elif workers > 1:  # the same bits as one at a time (each update depends on its own inputs only)
            clients = {"local_updates": task.as_local_updates(hyper, vectorized=False, workers=workers,
                                                              with_metrics=losses)}
        else:
            clients = {"local_update": task.as_local_update(hyper, with_metrics=losses)}
        shown = not (args.quiet or args.json)
        bar = ProgressBar("fedmf simulate", unit="rounds", enabled=shown)
        if not bar.live:
            bar.every_s = 0.0  # one plain line per round on a pipe or in a log
        plan_bar = ProgressBar(f"fedmf simulate: planning {config.mechanism}", unit="steps", enabled=shown)
        try:
            result = simulate(config, model=task.model(), users=task.users(), **clients, evaluate=task.evaluate,
                              progress=bar if shown else False, plot=not args.no_plot, repeatable_noise=repeatable,
                              plan_progress=plan_bar if shown else None,
                              evaluate_every=args.eval_every or PRESET_EVAL_EVERY.get(args.preset, 1),
                              secure_aggregation=None if secure is None else
                              (secure, _entry_point(SECURE_AGGREGATION_GROUP, "secaggplus", "--secure-aggregation")))
        finally:
            bar.close()
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
        return 0
    accuracy = "n/a" if result.accuracy is None else f"{result.accuracy:.4f}"
    how, _, why = result.stopped.partition(": ")  # "cohort: <the one line>" and the like
    lines = [
        f"preset          {args.preset} ({config.task}), {result.rounds_done} rounds ({how})"
        + (", on the Flower simulation engine" if args.backend == "flower" else "")
        + (f", secure aggregation (SecAgg+, {_graph(secure)}, 2^{secure.bits}, scale {secure.scale:g})"
           if secure is not None else "")
        + (f" (Ray cluster {ray_options['ray_address']})" if "ray_address" in ray_options else ""),
        f"accuracy        {accuracy} (held-out, after the last round)",
        f"privacy         epsilon {result.epsilon:.4g} at delta {result.delta:g} (planned, spent so far); "
        + ("" if result.rho is None else f"rho-zCDP {result.rho:.4g}; ")
        + f"noise multiplier {result.noise_multiplier:.4g}",
        *health_lines(result, why),
        f"time            {_time_line(result.seconds, result.seconds_total)}",
        f"output          {result.out_dir} (ledger, checkpoints, results.json"
        + (", final-model.pt, flower.log" if args.backend == "flower" else "")
        + (", progress.png)" if result.plot else ")"),
        f"audit           {result.audit_command()}",
    ]
    if config.adaptive_clipping is not None:
        lines += [f"warning         {line}" for line in _clip_norm_warnings(config, result.history)]
    if result.chain_head:
        lines.append(f"ledger head     {result.chain_head} (record it outside the ledger; check it later with "
                     f"fedmf audit --verify --head {result.chain_head})")
    print("\n".join(lines))
    return 0


def _time_line(seconds: float, total: float | None) -> str:
    """The summary's time: the whole run over every invocation, and this invocation's share."""
    if total is None or abs(total - seconds) < 0.05:
        return f"{seconds:.1f} s"
    return f"{total:.1f} s in all invocations of this run ({seconds:.1f} s this one)"


def preset_help() -> str:
    """Each preset and its expected cost (``fedmf.run.simulate.PRESET_COST``), for ``--help``."""
    from ..run.simulate import PRESET_COST, PRESETS

    return "; ".join(f"{name}: {PRESET_COST.get(name, 'cost not measured')}" for name in PRESETS)


def health_lines(result, stop: str = "") -> list[str]:
    """The summary's lines on how the run went: why it stopped early (the stop's one line), whether it is
    learning (``fedmf.run.learning_check``) and its cohorts (``fedmf.run.cohort``)."""
    from ..run.cohort import summary_line

    lines = [f"stopped         {stop}"] if stop else []
    learning = result.learning or {}
    if learning.get("line") and not stop.startswith("not learning"):
        lines.append(f"learning        {learning['line']}")
    if result.cohorts is not None:
        lines.append(f"cohorts         {summary_line(result.cohorts)}")
    return lines


def _clip_norm_warnings(config, history: list) -> list[str]:
    """Adaptive clipping's trajectory warnings (ζ at a bound, or still rising) from the rounds' ζₜ."""
    from ..round.adaptive_clipping import trajectory_warnings

    rows = [h for h in history if "clip-norm" in (h.get("metrics") or {})]
    return trajectory_warnings([h["metrics"]["clip-norm"] for h in rows], [h["round"] for h in rows],
                               config.clip_norm, config.adaptive_clipping_range,
                               config.adaptive_clipping_max_growth)


def register(sub: argparse._SubParsersAction) -> None:
    from ..run.simulate import PRESETS

    p = sub.add_parser("simulate", help="simulate private federated training of a preset task",
                       description="Train a preset task privately in process (the same private round the Flower "
                                   "server runs) or, with --backend flower, as the Flower app on the Flower "
                                   "simulation engine (Ray, one SuperNode per user); write the ledger, checkpoints, "
                                   "results.json and a plot, and print the summary with the audit command. Running "
                                   "it again with the same --out resumes. Rounds are numbered from 0, as the "
                                   "ledger stores them. Expected time on 2 CPU cores, in process: "
                                   + preset_help() + ".")
    p.add_argument("--preset", choices=sorted(PRESETS), default="so-tiny",
                   help="the task, its size and its privacy settings (default: so-tiny); time on 2 cores: "
                        + preset_help().replace("%", "%%"))
    p.add_argument("--mechanism", help="mechanism kind or a mechanism file (default: the preset's)")
    p.add_argument("--bands", type=int, help="bands of banded mechanisms")
    p.add_argument("--epsilon", type=float, help="target epsilon (calibrates the noise multiplier)")
    p.add_argument("--delta", type=float, help="delta of the (epsilon, delta) guarantee (default: the preset's)")
    p.add_argument("--noise-multiplier", type=float,
                   help="a fixed noise multiplier z instead of a target --epsilon (sigma = z x clip norm x "
                        "sensitivity)")
    p.add_argument("--sampling", help=f"the sampling scheme, {GRAMMAR} (default: the preset's)")
    p.add_argument("--rounds", type=int, help="rounds in the run, the mechanism's horizon (default: the preset's)")
    p.add_argument("--min-sep", type=int,
                   help="least rounds between two participations of one user (default: the preset's, at most "
                        "--rounds)")
    p.add_argument("--clients-per-round", type=float,
                   help="users per round (with sampling: the expected number; default: the preset's)")
    p.add_argument("--min-clients-per-round", type=int, metavar="N",
                   help="the fewest users a round must be able to select (lifetime budgets, min-sep), else the run "
                        "stops before it, recording nothing (default: clients-per-round; fixed-epoch: 1; sampling "
                        "none only: Poisson-style samplers keep their small and empty rounds)")
    p.add_argument("--stop-when-diverging", action="store_true",
                   help="stop when the held-out loss stays above the initial model's (by 20%% for 3 evaluations); "
                        "by default it is only reported (a non-finite model always stops the run)")
    p.add_argument("--server-lr", type=float, help="the server optimizer's learning rate (default: the preset's)")
    p.add_argument("--clip-norm", type=float, help="ℓ2 clip norm ζ (with --adaptive-clipping: ζ₀)")
    p.add_argument("--adaptive-clipping", type=float, metavar="QUANTILE",
                   help="let ζ follow this quantile in (0, 1) of the update norms (Andrew et al. 2021)")
    p.add_argument("--adaptive-clipping-lr", type=float, metavar="ETA",
                   help="learning rate of the geometric update of ζ (default 0.2)")
    p.add_argument("--adaptive-clipping-count-noise", type=float, metavar="STD",
                   help="std of the noise on the count of unclipped updates (default: clients per round / 20)")
    p.add_argument("--adaptive-clipping-range", type=float, metavar="R",
                   help="ζ never goes below ζ₀/R (default 10: one decade under --clip-norm), nor above ζ₀·R "
                        "unless --adaptive-clipping-max-growth says otherwise")
    p.add_argument("--adaptive-clipping-max-growth", type=float, metavar="G",
                   help="ζ never exceeds ζ₀·G (default: R; 1: --clip-norm is a ceiling that ζ only goes below)")
    p.add_argument("--seed", type=int, help="task data seed")
    p.add_argument("--data", help="the real StackOverflow file (TFF's stackoverflow.sqlite)")
    p.add_argument("--vocab", help="its vocabulary (default: stackoverflow.word_count beside --data)")
    p.add_argument("--backend", choices=("inprocess", "flower"), default="inprocess",
                   help="inprocess (default) or flower: the Flower app on the Flower simulation engine, from the "
                        "source tree fedmf was installed from")
    p.add_argument("--secure-aggregation", action="store_true",
                   help="sum each round's updates with SecAgg+: the server learns only the sum of the clipped, "
                        "quantized updates (and of the clipped client metric); σ grows by the quantization's "
                        "inflation, ε is unchanged. In process, or the Flower app's secure-aggregation = secaggplus")
    p.add_argument("--secagg-degree", type=int, metavar="K",
                   help="--secure-aggregation: neighbours of each client in SecAgg+'s random graph, even (default "
                        "0: K and T derived from each round's cohort, fedmf.secagg.params.graph_for)")
    p.add_argument("--secagg-threshold", type=int, metavar="T",
                   help="--secure-aggregation: shares that reconstruct a secret, 2T > K + 1 (default 0: derived, "
                        "with --secagg-degree 0)")
    p.add_argument("--secagg-bits", type=int, metavar="B",
                   help="--secure-aggregation: the sum is computed modulo 2^B, 4..62 (default 32)")
    p.add_argument("--secagg-scale", type=float, metavar="S",
                   help="--secure-aggregation: fixed-point units per unit of the clipped update (default 65536)")
    p.add_argument("--vectorized", action="store_true",
                   help="train each round's users together (the text tasks' LSTM: batched matrix products over "
                        "per-user weights; other tasks: torch.func.vmap; in process only; equal to the "
                        "one-at-a-time clients within float tolerance, not bit for bit)")
    p.add_argument("--chunk-users", type=int,
                   help="--vectorized: users trained together at most (default: as many as fit 80%% of a CUDA "
                        "device's free memory, or 4 GiB on the CPU, for the text tasks; all for vmap)")
    p.add_argument("--device", help="where --vectorized clients train: cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--workers", type=int,
                   help="users trained at a time in process, one thread each (default: the CPUs available); "
                        "the same model bit for bit for any value")
    p.add_argument("--ray-address", metavar="HOST:PORT",
                   help="--backend flower: run the virtual clients on this existing Ray cluster (the GCS address "
                        "of its head, `ray start --head --port PORT`; run fedmf on one of its nodes) instead of "
                        "a fresh local Ray")
    p.add_argument("--client-cpus", type=float, metavar="N",
                   help="--backend flower: whole CPUs Ray reserves for each virtual client (default 1)")
    p.add_argument("--client-gpus", type=float, metavar="FRACTION",
                   help="--backend flower: the fraction of a GPU Ray reserves for each virtual client, e.g. 0.25 "
                        "(default: none)")
    p.add_argument("--timeout", type=float, default=7 * 24 * 3600.0,
                   help="--backend flower: stop the Flower run after this many seconds (default: a week)")
    p.add_argument("--ledger", metavar="URL",
                   help="the ledger (a SQLite path or postgresql://…; default: <out>/ledger.db); runs may share one")
    p.add_argument("--client-metrics", choices=("none", "private"),
                   help="what leaves the server of the clients' training loss: nothing (default), or its private "
                        "release: clipped to [0, L], summed, Gaussian noise, ÷ clients per round; accounted in ε")
    p.add_argument("--client-metrics-clip", type=float, metavar="L",
                   help="with --client-metrics private: each client's loss is clipped to [0, L] (default 10)")
    p.add_argument("--client-metrics-noise", type=float, metavar="STD",
                   help="with --client-metrics private: std of the noise on the sum (default L x clients per round / 20)")
    p.add_argument("--budget-key", metavar="FILE",
                   help="the ledger's budget secret (fedmf budget); required when the ledger enforces lifetime budgets")
    p.add_argument("--witness", metavar="DIR",
                   help="the release witness's directory, on other storage than --out and the ledger (default: "
                        "$XDG_STATE_HOME/fedmf/witness or ~/.local/state/fedmf/witness): a resume whose ledger and "
                        "run directory are both behind it is refused; 'off': none (tests only, unsafe)")
    p.add_argument("--out", default="fedmf-sim", help="output directory (default: ./fedmf-sim)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="held-out evaluation after every N-th round and the last (in process; default: the "
                        "preset's, 1 but shakespeare's 10: its 20,044 held-out lines cost more than a round)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (default: a live bar with rounds per second and time left on a terminal, one "
                        "plain line per round on a pipe or in a log)")
    p.add_argument("--no-plot", action="store_true", help="do not write progress.png")
    for key, flag in (("target-epsilon", "--epsilon"), ("target_epsilon", "--epsilon"), ("num-bands", "--bands"),
                      ("num_bands", "--bands"), ("ledger-url", "--ledger"), ("ledger_url", "--ledger"),
                      ("run-dir", "--out"), ("run_dir", "--out")):
        p.alias(key, flag)
    p.set_defaults(func=cmd_simulate)
