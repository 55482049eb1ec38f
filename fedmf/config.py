"""The run configuration of a private training job, validated once where it enters.

The Flower app reads it from ``[tool.flwr.app.config]`` (overridable with ``flwr run .
--run-config``); ``fedmf simulate`` builds the same object from a preset (``fedmf.run.simulate.PRESETS``:
overrides of ``DEFAULTS``). Keys use Flower's kebab-case; every value is checked here and a bad one
is a one-line ``ConfigError`` before round 1. ``DEFAULTS`` holds the engine's keys, the keys every
backend reads; the Flower adapter's own keys (reply and identity timeouts, how users prove who they
are) are its table, ``server.config.FLOWER_DEFAULTS``, after these. The two make the one defaults
table, ``server.config.APP_DEFAULTS``: ``pyproject.toml``'s app config equals it key for key, in order
(tests/test_config.py).

    task              "tiny"                      client task (fedmf/tasks)
    task-options      '{"num_users": 20}'         JSON object of task options
    mechanism         "bsr" | "so.mech.json"       a kind (built or optimized for the schema) or a file
    num-bands         0                           bands for banded kinds (0: the default, min(b, 64))
    rounds            5                           n
    schema            "min-sep" | "fixed-epoch"
    min-sep           2                           b
    max-participations 0                          k (0: ceil(n / b))
    sampling          "none"                      a sampling scheme (fedmf.sampling.GRAMMAR)
    clients-per-round 5                           users per round (planned expected users)
    clip-norm         1.0                         ζ (with adaptive clipping: ζ₀)
    adaptive-clipping 0.0                         target quantile γ ∈ (0, 1) of the update norms ζ follows
                                                  (0: ζ is fixed; Andrew et al. 2021)
    adaptive-clipping-lr 0.2                      η of the geometric update of ζ
    adaptive-clipping-count-noise 0.0             σ_b, std of the noise on the count of unclipped updates
                                                  (0: clients-per-round / 20)
    adaptive-clipping-range 10.0                  R ≥ 1: ζ never leaves [ζ₀/R, ζ₀·G]
    adaptive-clipping-max-growth 0.0              G ≥ 1: ζ never exceeds ζ₀·G (0: G = R; 1: ζ₀ is a ceiling)
    noise-multiplier  0.5                         z (0: calibrate for target-epsilon)
    target-epsilon    0.0                         ε target (0: none; exactly one of the two is set)
    delta             1e-5
    zero-threshold    "default" | "none" | 100.0  ℓ∞ zeroing (default 100·ζ)
    accountant        "pld" | "rdp"
    server-lr         1.0                         η
    server-momentum   0.0                         β of the workload A
    server-cooldown   0.0                         fraction of final rounds with a linear lr cooldown
    client-lr         0.1
    local-epochs      1
    batch-size        16
    run-dir           "fedmf-run"                 checkpoints, secrets, and the default SQLite ledger
    ledger-url        ""                          ledger URL (default: <run-dir>/ledger.db)
    ledger-diagnostics false                      also record update norms and clipping in the ledger
                                                  (data-dependent: outside the DP guarantee)
    budget-key        ""                          the ledger's budget secret file (``fedmf budget``); needed
                                                  when the ledger enforces lifetime per-user budgets
    client-metrics    "none" | "private"          what leaves the server of the clients' reported training
                                                  loss: nothing, or its private release (fedmf.round.client_metrics:
                                                  clipped, summed, Gaussian noise, ÷ clients-per-round; accounted)
    client-metrics-clip 10.0                      L: each client's loss is clipped to [0, L]
    client-metrics-noise 0.0                      σ_m, std of the noise on the sum (0: L · clients-per-round / 20)
    witness           ""                          the release witness's directory (fedmf.run.witness), on storage
                                                  other than the run directory's and the ledger's; "": the
                                                  user's state directory; "off": none (tests only, unsafe)
    min-clients-per-round 0                       the fewest users a round must be able to select, else it is
                                                  not played: the run stops (in process) or the server waits
                                                  (0: clients-per-round; fixed-epoch: 1; sampling none only:
                                                  fedmf/run/cohort.py)
    stop-when-diverging false                     stop when the held-out loss diverges (fedmf/run/learning_check.py;
                                                  a non-finite model always stops)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import checks
from .errors import ConfigError, ConfigTypeError
from .run.witness import WITNESS_OFF
from .sampling import parse_sampling

__all__ = ["RunConfig", "DEFAULTS", "read_int", "read_bool", "read_float", "read_text"]

#: the defaults of every engine key: what ``flwr run .`` users get (pyproject.toml's [tool.flwr.app.config]
#: begins with this table, types included; server.config.FLOWER_DEFAULTS follows) and what
#: RunConfig.from_mapping fills in; never zero noise by default
DEFAULTS: dict[str, Any] = {
    "task": "tiny", "task-options": '{"num_users": 20}', "mechanism": "bsr", "num-bands": 0, "rounds": 5,
    "schema": "min-sep", "min-sep": 2, "max-participations": 0, "sampling": "none", "clients-per-round": 5,
    "clip-norm": 1.0, "noise-multiplier": 0.5, "target-epsilon": 0.0, "delta": 1e-5, "zero-threshold": "default",
    "accountant": "pld", "server-lr": 1.0, "server-momentum": 0.0, "server-cooldown": 0.0, "client-lr": 0.1,
    "local-epochs": 1, "batch-size": 16, "run-dir": "fedmf-run", "ledger-url": "",
    "ledger-diagnostics": False,
    "adaptive-clipping": 0.0, "adaptive-clipping-lr": 0.2, "adaptive-clipping-count-noise": 0.0,
    "adaptive-clipping-range": 10.0,
    "adaptive-clipping-max-growth": 0.0,
    "budget-key": "",
    "client-metrics": "none", "client-metrics-clip": 10.0, "client-metrics-noise": 0.0,
    "witness": "",
    "min-clients-per-round": 0, "stop-when-diverging": False,
}


def read_int(key: str, value: Any, minimum: int) -> int:
    """An integer ≥ ``minimum``, or its text."""
    if isinstance(value, float) and value.is_integer():  # a run config value may come as 2.0 or "2"
        value = int(value)
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    return checks.integer(key, value, minimum=minimum)


def read_bool(key: str, value: Any) -> bool:
    """True or False (or their text)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def read_float(key: str, value: Any, *, minimum: float = 0.0, strict: bool = False, maximum: float = math.inf) -> float:
    """A number in [minimum, maximum] (``strict``: above ``minimum``), or its text."""
    if isinstance(value, str):  # a run config value may come as text
        try:
            value = float(value)
        except ValueError:
            raise ConfigTypeError(f"{key} must be a number, got {value!r}") from None
    return checks.interval(key, value, minimum, maximum, low_open=strict)


def read_text(key: str, value: Any) -> str:
    """A string, stripped."""
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value.strip()


def _sampling(value: Any) -> str:
    """The sampling scheme's string form as given, once ``parse_sampling`` accepts it."""
    text = read_text("sampling", value)
    parse_sampling(text)
    return text


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration (see the module docstring for the keys)."""

    task: str
    task_options: dict[str, Any]
    mechanism: str
    num_bands: int | None
    rounds: int
    schema: str
    min_sep: int
    max_participations: int | None
    sampling: str
    clients_per_round: float
    clip_norm: float
    noise_multiplier: float | None
    target_epsilon: float | None
    delta: float
    zero_threshold: float | None | str
    accountant: str
    server_lr: float
    server_momentum: float
    server_cooldown: float
    client_lr: float
    local_epochs: int
    batch_size: int
    run_dir: str
    ledger_url: str | None
    ledger_diagnostics: bool = False
    adaptive_clipping: float | None = None  # γ; None: ζ is fixed
    adaptive_clipping_lr: float = 0.2
    adaptive_clipping_count_noise: float | None = None  # σ_b; None: clients-per-round / 20
    adaptive_clipping_range: float = 10.0  # R: ζ within [ζ₀/R, ζ₀·G]
    adaptive_clipping_max_growth: float | None = None  # G; None: R
    budget_key: str | None = None  # the budget secret file (absolute); None: the ledger has no budgets
    client_metrics: str = "none"  # "none": nothing of the clients' metrics is published; "private": its release
    client_metrics_clip: float = 10.0  # L
    client_metrics_noise: float | None = None  # σ_m; None: L · clients-per-round / 20
    witness: str | None = None  # the release witness's directory (absolute), "off", or None: the default one
    min_clients_per_round: int | None = None  # None: the default (fedmf.run.cohort.resolve_min_cohort)
    stop_when_diverging: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base_dir: str | os.PathLike | None = None) -> RunConfig:
        """Validate a mapping of kebab-case keys (unknown keys are refused; missing ones default).
        Relative paths are taken from ``base_dir`` (default: the working directory)."""
        unknown = sorted(set(values) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"unknown configuration key {unknown[0]!r} (known: {', '.join(sorted(DEFAULTS))})")
        v = {**DEFAULTS, **values}
        try:
            options = json.loads(read_text("task-options", v["task-options"]) or "{}")
        except json.JSONDecodeError:
            raise ConfigError(f"task-options must be a JSON object, got {v['task-options']!r}") from None
        if not isinstance(options, dict):
            raise ConfigError(f"task-options must be a JSON object, got {v['task-options']!r}")
        schema = read_text("schema", v["schema"])
        if schema not in ("min-sep", "fixed-epoch"):
            raise ConfigError(f"schema must be min-sep or fixed-epoch, got {schema!r}")
        zero = v["zero-threshold"]
        if isinstance(zero, str) and zero.strip() in ("default", "none"):
            zero_threshold: float | None | str = None if zero.strip() == "none" else "default"
        else:
            zero_threshold = read_float("zero-threshold", zero, strict=True)
        accountant = read_text("accountant", v["accountant"])
        if accountant not in ("pld", "rdp"):
            raise ConfigError(f"accountant must be pld or rdp, got {accountant!r}")
        noise = read_float("noise-multiplier", v["noise-multiplier"])
        target = read_float("target-epsilon", v["target-epsilon"])
        if noise == 0 and target == 0:
            raise ConfigError("set noise-multiplier or target-epsilon (both are 0)")
        if noise and target:  # z fixes epsilon: a target that disagrees would stop the run before or during it
            raise ConfigError(f"set noise-multiplier or target-epsilon, not both (got {noise:g} and {target:g}): "
                              "set the other to 0")
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        run_dir = read_text("run-dir", v["run-dir"])
        if not run_dir:
            raise ConfigError("run-dir must not be empty")
        mechanism = read_text("mechanism", v["mechanism"])
        if not mechanism:
            raise ConfigError("mechanism must name a kind or a mechanism file")
        if mechanism.endswith(".json") and not Path(mechanism).is_absolute():
            mechanism = str(base / mechanism)
        ledger = read_text("ledger-url", v["ledger-url"]) or None
        bands = read_int("num-bands", v["num-bands"], 0)
        k = read_int("max-participations", v["max-participations"], 0)
        gamma = read_float("adaptive-clipping", v["adaptive-clipping"], maximum=1.0)
        if gamma == 1.0:
            raise ConfigError("adaptive-clipping is a target quantile in (0, 1) (0: off), got 1")
        clip_lr = read_float("adaptive-clipping-lr", v["adaptive-clipping-lr"], strict=True)
        count_noise = read_float("adaptive-clipping-count-noise", v["adaptive-clipping-count-noise"])
        clip_range = read_float("adaptive-clipping-range", v["adaptive-clipping-range"], strict=True, maximum=1e6)
        if clip_range < 1.0:
            raise ConfigError("adaptive-clipping-range is a factor R >= 1 (ζ never goes below ζ₀/R, nor above ζ₀·R "
                              f"unless adaptive-clipping-max-growth is set), got {clip_range:g}")
        max_growth = read_float("adaptive-clipping-max-growth", v["adaptive-clipping-max-growth"], maximum=1e6)
        if 0.0 < max_growth < 1.0:
            raise ConfigError(f"adaptive-clipping-max-growth is a factor G >= 1 (ζ never exceeds ζ₀·G; 0: G = "
                              f"adaptive-clipping-range), got {max_growth:g}")
        budget_key = read_text("budget-key", v["budget-key"])
        client_metrics = read_text("client-metrics", v["client-metrics"])
        if client_metrics not in ("none", "private"):
            raise ConfigError(f"client-metrics must be none or private, got {client_metrics!r}")
        metrics_clip = read_float("client-metrics-clip", v["client-metrics-clip"], strict=True)
        metrics_noise = read_float("client-metrics-noise", v["client-metrics-noise"])
        if not (math.isfinite(metrics_clip) and math.isfinite(metrics_noise)):
            raise ConfigError("client-metrics-clip and client-metrics-noise must be finite")
        witness = read_text("witness", v["witness"]).strip()
        return cls(
            task=read_text("task", v["task"]), task_options=options, mechanism=mechanism, num_bands=bands or None,
            rounds=read_int("rounds", v["rounds"], 1), schema=schema, min_sep=read_int("min-sep", v["min-sep"], 1),
            max_participations=k or None, sampling=_sampling(v["sampling"]),
            clients_per_round=read_float("clients-per-round", v["clients-per-round"], strict=True),
            clip_norm=read_float("clip-norm", v["clip-norm"], strict=True), noise_multiplier=noise or None,
            target_epsilon=target or None, delta=read_float("delta", v["delta"], strict=True, maximum=0.5),
            zero_threshold=zero_threshold, accountant=accountant,
            server_lr=read_float("server-lr", v["server-lr"], strict=True),
            server_momentum=read_float("server-momentum", v["server-momentum"], maximum=0.999),
            server_cooldown=read_float("server-cooldown", v["server-cooldown"], maximum=1.0),
            client_lr=read_float("client-lr", v["client-lr"], strict=True),
            local_epochs=read_int("local-epochs", v["local-epochs"], 1),
            batch_size=read_int("batch-size", v["batch-size"], 1),
            run_dir=str(base / run_dir), ledger_url=ledger,
            ledger_diagnostics=read_bool("ledger-diagnostics", v["ledger-diagnostics"]),
            adaptive_clipping=gamma or None, adaptive_clipping_lr=clip_lr,
            adaptive_clipping_count_noise=count_noise or None, adaptive_clipping_range=clip_range,
            adaptive_clipping_max_growth=max_growth or None,
            budget_key=str(base / budget_key) if budget_key else None,
            client_metrics=client_metrics, client_metrics_clip=metrics_clip,
            client_metrics_noise=metrics_noise or None,
            witness=(witness if witness == WITNESS_OFF else str(base / witness)) if witness else None,
            min_clients_per_round=read_int("min-clients-per-round", v["min-clients-per-round"], 0) or None,
            stop_when_diverging=read_bool("stop-when-diverging", v["stop-when-diverging"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- what the configuration builds ---------------------------------------------------
    def participation_schema(self):
        from .participation import FixedEpoch, MinSep

        if self.schema == "fixed-epoch":
            if self.rounds % self.min_sep:
                raise ConfigError(f"fixed-epoch needs rounds = epochs x min-sep; {self.rounds} is not a multiple of "
                                  f"{self.min_sep}")
            return FixedEpoch(self.rounds // self.min_sep, self.min_sep)
        k = self.max_participations or -(-self.rounds // self.min_sep)
        return MinSep(self.min_sep, k)

    def workload(self):
        from .workloads import Workload

        return Workload(momentum=self.server_momentum, cooldown=self.server_cooldown)

    def build_mechanism(self, progress=None):
        """The mechanism: loaded from its file (it must be planned for this configuration's
        rounds and workload) or built / optimized for the schema."""
        from .mechanisms import plan as plan_mechanism
        from .mechanisms.io import load

        schema, workload = self.participation_schema(), self.workload()
        if self.mechanism.endswith(".json"):
            mechanism = load(self.mechanism)
            if mechanism.rounds != self.rounds:
                raise ConfigError(f"mechanism file covers {mechanism.rounds} rounds, the configuration {self.rounds}")
            if mechanism.workload != workload:
                raise ConfigError(f"mechanism file was made for workload {mechanism.workload.name}, the configuration "
                                  f"uses {workload.name} (server-momentum / server-cooldown)")
            return mechanism
        mechanism, _ = plan_mechanism(self.mechanism, self.rounds, schema, workload, num_bands=self.num_bands,
                                      progress=progress)
        return mechanism

    def build_plan(self, mechanism=None):
        """The RunPlan (calibrating z once when only a target ε is given)."""
        from .plan import RunPlan
        from .round.adaptive_clipping import AdaptiveClipping

        mechanism = mechanism if mechanism is not None else self.build_mechanism()
        adaptive = None
        if self.adaptive_clipping is not None:
            adaptive = AdaptiveClipping.create(self.adaptive_clipping, expected_users=self.clients_per_round,
                                               learning_rate=self.adaptive_clipping_lr,
                                               count_noise_std=self.adaptive_clipping_count_noise,
                                               clip_norm_range=self.adaptive_clipping_range,
                                               max_growth=self.adaptive_clipping_max_growth)
        metrics = None
        if self.client_metrics == "private":
            from .round.client_metrics import ClientMetricRelease

            metrics = ClientMetricRelease.create(self.client_metrics_clip, self.client_metrics_noise,
                                                 expected_users=self.clients_per_round)
        return RunPlan.create(mechanism, self.participation_schema(), clip_norm=self.clip_norm, delta=self.delta,
                              expected_users=self.clients_per_round, noise_multiplier=self.noise_multiplier,
                              target_epsilon=self.target_epsilon, sampling=self.sampling,
                              zero_threshold=self.zero_threshold, accountant=self.accountant,
                              adaptive_clipping=adaptive, client_metrics=metrics)
