"""The operator's path: contradictory or unreachable configurations are one-line errors before round 1
(RunConfig, `fedmf simulate`, train / PrivateRun, the ServerApp); a preset's min-sep follows a smaller
--rounds; the final summary suggests the auditor's ledger, never the server's role or password."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from fedmf.audit.auditor import AUDITOR_ROLE, audit_command, auditor_ledger
from fedmf.cli import main
from fedmf.config import RunConfig
from fedmf.errors import ConfigError
from fedmf.run.federated import train
from fedmf.run.simulate import preset_values
from tests import _federated_task as task

BASE = {"noise-multiplier": 1.0, "rounds": 12, "min-sep": 3, "clients-per-round": 4}


# ---- contradictory and unreachable configurations ----------------------------------------------


def test_noise_multiplier_with_target_epsilon_is_refused():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({**BASE, "target-epsilon": 8.0})
    assert "not both" in str(info.value) and "\n" not in str(info.value)
    for one in ({"noise-multiplier": 0, "target-epsilon": 8.0}, {"noise-multiplier": 0.5, "target-epsilon": 0}):
        RunConfig.from_mapping({**BASE, **one})


def test_more_clients_per_round_than_users_is_refused_before_anything_is_written(tmp_path):
    plan = task.plan(rounds=8, expected_users=21)
    with pytest.raises(ConfigError, match=r"clients-per-round .* 21 exceeds the population of 20 users"):
        train(task.Tiny(), task.users(20), plan, task.local_update, checkpoint_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    task.plan(rounds=8, expected_users=20).check_population(20)  # every user in every round is reachable


def test_the_server_app_refuses_both_before_round_one(tmp_path, caplog):
    from server.app import run_server
    from server.local_grid import LocalGrid

    grid = LocalGrid({})
    values = {"task": "tiny", "task-options": '{"num_users": 12}', "rounds": 6, "min-sep": 2,
              "noise-multiplier": 0.7, "run-dir": str(tmp_path / "run"), "reply-timeout": 5.0}
    with pytest.raises(ConfigError, match="exceeds the population of 12 users"):
        run_server(grid, {**values, "clients-per-round": 13})
    with pytest.raises(ConfigError, match="not both"):
        run_server(grid, {**values, "clients-per-round": 4, "target-epsilon": 3.0})
    assert not grid.sent and not (tmp_path / "run").exists()


def test_fedmf_simulate_refuses_both_with_exit_2_and_one_line(tmp_path):
    for argv, fragment in ((["--clients-per-round", "41"], "exceeds the population of 40 users"),
                           (["--backend", "flower", "--clients-per-round", "41"], "exceeds the population of 40")):
        done = subprocess.run([sys.executable, "-m", "fedmf.cli", "simulate", "--preset", "tiny", "--out",
                               str(tmp_path / "o"), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("fedmf: error:") and fragment in done.stderr, done.stderr
        assert not (tmp_path / "o").exists()


# ---- a preset's min-sep follows a smaller --rounds -----------------------------------------------


def test_a_presets_min_sep_follows_a_smaller_rounds_and_the_users_is_kept():
    def schema(overrides):
        config = RunConfig.from_mapping(preset_values("so-small", {"run-dir": "x", **overrides}))
        return config.min_sep, config.num_bands

    assert schema({}) == (40, 32)
    assert schema({"rounds": 3}) == (3, None)  # b = n: each user at most once; the preset's 32 bands go too
    assert schema({"rounds": 60}) == (40, 32)
    assert schema({"rounds": 3, "min-sep": 2}) == (2, None)
    with pytest.raises(ConfigError, match="exceeds the number of rounds"):  # a min-sep the user gives is checked
        RunConfig.from_mapping(preset_values("so-small", {"run-dir": "x", "rounds": 3, "min-sep": 40})).build_plan()


def test_so_small_with_three_rounds_plans(tmp_path):
    """The issue's command: `fedmf simulate --preset so-small --rounds 3` no longer fails on a min-sep
    the user never gave (its plan is built, here without training so-small's 5000 users)."""
    config = RunConfig.from_mapping(preset_values("so-small", {"run-dir": str(tmp_path), "rounds": 3}))
    plan = config.build_plan()
    assert plan.rounds == 3 and plan.schema.min_sep == 3 and plan.epsilon() <= 8.0 * (1 + 1e-6)


# ---- the audit command is the auditor's --------------------------------------------------------


def test_the_auditor_ledger_is_a_path_for_sqlite_and_the_auditor_role_for_postgresql(tmp_path):
    assert auditor_ledger(tmp_path / "ledger.db") == str(tmp_path / "ledger.db")
    assert auditor_ledger(f"sqlite:///{tmp_path}/ledger.db") == f"{tmp_path}/ledger.db"
    server = ("postgresql+psycopg://fedmf_server:s3cret@db.example:5432/fedmf?sslmode=verify-full&PASSWORD=p2"
              "&sslpassword=p3&sslkey=/etc/fedmf/server.key&options=-csearch_path%3Dledger")
    url = auditor_ledger(server)
    assert url == (f"postgresql+psycopg://{AUDITOR_ROLE}@db.example:5432/fedmf?options=-csearch_path%3Dledger"
                   "&sslmode=verify-full")
    for secret in ("s3cret", "p2", "p3", "fedmf_server", "server.key"):
        assert secret not in url
    assert audit_command(server, 7) == f"fedmf audit --ledger '{url}' --run 7"
    assert audit_command(tmp_path / "a b.db", 1) == f"fedmf audit --ledger '{tmp_path}/a b.db' --run 1"


def test_train_suggests_the_auditors_postgresql_url(tmp_path, pg_url):
    from sqlalchemy.engine import make_url

    with_password = make_url(pg_url).set(password="never-printed").render_as_string(hide_password=False)
    result = train(task.Tiny(), task.users(), task.plan(rounds=8), task.local_update, checkpoint_dir=tmp_path,
                   ledger=with_password, rounds=1)
    command = result.audit_command()
    assert "never-printed" not in command and f"//{AUDITOR_ROLE}@127.0.0.1:5432/test" in command
    assert command.endswith(f" --run {result.run_id}")


def test_the_server_apps_last_line_suggests_the_auditors_ledger(tmp_path, caplog):
    from client.app import app as client_app
    from server.app import run_server
    from server.local_grid import LocalGrid, client_node

    values = {"task": "tiny", "task-options": '{"num_users": 4}', "rounds": 2, "min-sep": 1,
              "clients-per-round": 2, "noise-multiplier": 0.7, "run-dir": str(tmp_path / "run"),
              "reply-timeout": 5.0}
    nodes = {100 + i: client_node(client_app, {"partition-id": i}, 100 + i) for i in range(4)}
    with caplog.at_level(logging.INFO, logger="fedmf.server"):
        run_server(LocalGrid(nodes), values)
    last = [r.getMessage() for r in caplog.records if "rounds committed" in r.getMessage()]
    ledger = tmp_path / "run" / "ledger.db"
    assert len(last) == 1 and last[0].endswith(f"; audit with: fedmf audit --ledger {ledger} --run 1"), last
    assert main(["audit", "--ledger", str(ledger), "--run", "1", "--json"]) == 0


def test_simulate_prints_the_auditors_command(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--preset", "tiny", "--rounds", "2", "--min-sep", "1", "--epsilon", "6", "--out",
                 str(out), "--json", "--no-plot"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["audit"] == audit_command(out / "ledger.db", result["run_id"])
