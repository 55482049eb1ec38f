"""RunConfig: every key validated where it enters; what it builds."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from fedmf import FixedEpoch, MinSep, Workload
from fedmf.config import DEFAULTS, RunConfig
from fedmf.errors import ConfigError
from fedmf.mechanisms import build
from fedmf.mechanisms.io import save

BASE = {"noise-multiplier": 1.0, "rounds": 12, "min-sep": 3, "clients-per-round": 4}


def test_defaults_and_what_they_build(tmp_path):
    config = RunConfig.from_mapping(BASE, base_dir=tmp_path)
    assert config.run_dir == str(tmp_path / "fedmf-run") and config.ledger_url is None
    assert config.participation_schema() == MinSep(3, 4)  # k = ceil(12 / 3)
    plan = config.build_plan()
    assert plan.mechanism.kind == "bsr" and plan.expected_users == 4 and plan.zero_threshold == 100.0
    assert plan.noise_std == pytest.approx(1.0 * 1.0 * plan.sensitivity.value)
    assert set(DEFAULTS) == {k.replace("_", "-") for k in config.to_dict()} - {"extra"}
    assert config.ledger_diagnostics is False  # update norms stay out of the ledger unless asked for
    for value, expected in ((True, True), ("true", True), (" False ", False)):
        assert RunConfig.from_mapping({**BASE, "ledger-diagnostics": value}).ledger_diagnostics is expected


def test_the_app_config_is_the_defaults_table():
    """pyproject.toml's [tool.flwr.app.config] (what ``flwr run .`` users get) is the one defaults table
    ``server.config.APP_DEFAULTS`` — the engine's DEFAULTS, then the Flower adapter's FLOWER_DEFAULTS —
    key for key, in its order and with its types; and the defaults never mean zero noise."""
    from server.config import APP_DEFAULTS, FLOWER_DEFAULTS

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        app = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert [(k, type(v), v) for k, v in app.items()] == [(k, type(v), v) for k, v in APP_DEFAULTS.items()]
    assert list(APP_DEFAULTS) == list(DEFAULTS) + list(FLOWER_DEFAULTS)  # merged, not overridden: no key in both
    config = RunConfig.from_mapping({})
    assert config.noise_multiplier == 0.5 and config.target_epsilon is None
    assert (config.min_sep, config.clients_per_round, config.task_options) == (2, 5, {"num_users": 20})


def test_presets_list_only_run_config_keys_they_change():
    from fedmf.run.simulate import PRESETS

    for name, preset in PRESETS.items():
        assert set(preset) <= set(DEFAULTS), (name, sorted(set(preset) - set(DEFAULTS)))
        for key, value in preset.items():
            default = json.loads(DEFAULTS[key]) if key == "task-options" else DEFAULTS[key]
            assert value != default, (name, key)


def test_fixed_epoch_momentum_cooldown_and_strings_from_the_command_line(tmp_path):
    config = RunConfig.from_mapping({**BASE, "schema": "fixed-epoch", "server-momentum": "0.9",
                                     "server-cooldown": 0.25, "rounds": "12", "zero-threshold": "none",
                                     "mechanism": "bisr", "num-bands": 2, "target-epsilon": 5.0,
                                     "noise-multiplier": 0}, base_dir=tmp_path)
    assert config.participation_schema() == FixedEpoch(4, 3)
    assert config.workload() == Workload(0.9, 0.25)
    plan = config.build_plan()
    assert plan.zero_threshold is None and plan.target_epsilon == 5.0
    assert plan.epsilon() <= 5.0 * (1 + 1e-6) and plan.epsilon() == pytest.approx(5.0, rel=1e-2)


def test_mechanism_file_must_match_rounds_and_workload(tmp_path):
    path = tmp_path / "m.mech.json"
    save(build("bsr", 12, MinSep(3, 4), Workload(0.5), num_bands=3), path, MinSep(3, 4))
    ok = RunConfig.from_mapping({**BASE, "mechanism": "m.mech.json", "server-momentum": 0.5}, base_dir=tmp_path)
    assert ok.build_mechanism().strategy_bands == 3
    with pytest.raises(ConfigError, match="workload"):
        RunConfig.from_mapping({**BASE, "mechanism": str(path)}).build_mechanism()
    with pytest.raises(ConfigError, match="rounds"):
        RunConfig.from_mapping({**BASE, "mechanism": str(path), "rounds": 13, "server-momentum": 0.5}).build_mechanism()


@pytest.mark.parametrize("bad, fragment", [
    ({"rounds": 0}, "rounds"), ({"rounds": "many"}, "rounds"), ({"rounds": 2.5}, "rounds"), ({"delta": 1.0}, "delta"),
    ({"clip-norm": 0}, "clip-norm"), ({"clip-norm": math.nan}, "clip-norm"), ({"schema": "epochs"}, "schema"),
    ({"unknown-key": 1}, "unknown"), ({"task-options": "[1]"}, "task-options"), ({"task-options": "{"}, "task-options"),
    ({"noise-multiplier": 0}, "noise-multiplier or target-epsilon"), ({"accountant": "gdp"}, "accountant"),
    ({"server-momentum": 1.0}, "server-momentum"), ({"local-epochs": 0}, "local-epochs"), ({"batch-size": True}, "batch-size"),
    ({"zero-threshold": "big"}, "zero-threshold"), ({"run-dir": ""}, "run-dir"), ({"mechanism": " "}, "mechanism"),
    ({"clients-per-round": -3}, "clients-per-round"), ({"ledger-diagnostics": "yes"}, "ledger-diagnostics"),
    ({"ledger-diagnostics": 1}, "ledger-diagnostics"),
])
def test_bad_values_are_one_line_errors(bad, fragment):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({**BASE, **bad})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_combinations_fail_before_round_one():
    with pytest.raises(ConfigError, match="multiple"):
        RunConfig.from_mapping({**BASE, "schema": "fixed-epoch", "rounds": 13}).participation_schema()
    with pytest.raises(ConfigError):
        RunConfig.from_mapping({**BASE, "mechanism": "no-such-kind"}).build_plan()
    with pytest.raises(ConfigError):
        RunConfig.from_mapping({**BASE, "sampling": "bminsep:2"}).build_plan()


def test_budget_key_is_resolved_against_the_base_directory(tmp_path):
    assert RunConfig.from_mapping(BASE).budget_key is None
    config = RunConfig.from_mapping({**BASE, "budget-key": "keys/budget.key"}, base_dir=tmp_path)
    assert config.budget_key == str(tmp_path / "keys" / "budget.key")
    from launcher.flower_backend import flower_run_config

    assert flower_run_config({**BASE, "budget-key": "keys/budget.key"}, config)["budget-key"] == config.budget_key
