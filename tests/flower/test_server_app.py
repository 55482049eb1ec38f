"""The ServerApp's main path with the real ClientApp in process: configuration → plan → strategy,
bit-identical to the in-process loop on the same task, plan, secrets and users."""

from __future__ import annotations

import logging

import pytest
import torch

from client.app import app as client_app
from fedmf.errors import ConfigError
from fedmf.run.federated import train
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.tasks import ClientHyper, get_task
from server.app import run_server
from server.config import ServerConfig
from server.local_grid import LocalGrid, client_node
from tests import _federated_task as task

USERS = 12


def _config(tmp_path, name, **over):
    values = {"task": "tiny", "task-options": f'{{"num_users": {USERS}}}', "mechanism": "bsr", "rounds": 6,
              "min-sep": 2, "clients-per-round": 4, "noise-multiplier": 0.7, "server-momentum": 0.5,
              "client-lr": 0.2, "batch-size": 8, "run-dir": str(tmp_path / name), "reply-timeout": 5.0}
    values.update(over)
    return values


def _nodes():
    return {9000 + 7 * i: client_node(client_app, {"partition-id": i, "num-partitions": USERS}, 9000 + 7 * i)
            for i in range(USERS)}


def test_server_app_with_the_client_app_matches_the_in_process_loop(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: unsalted noise in the ServerApp, as in the loop
    values = _config(tmp_path, "loop")
    config = ServerConfig.from_mapping(values)
    tiny = get_task("tiny", num_users=USERS)
    model = tiny.model()
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    train(model, tiny.users(), config.build_plan(), tiny.as_local_update(hyper), server_lr=config.server_lr,
          checkpoint_dir=config.run_dir, repeatable_noise=True)
    task.share_secrets(tmp_path / "loop", tmp_path / "flower")
    # server.app.main (run by other tests) stops "fedmf.server" propagating: caplog needs it
    monkeypatch.setattr(logging.getLogger("fedmf.server"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        strategy = run_server(LocalGrid(_nodes()), _config(tmp_path, "flower"))
    assert "UNSAFE, for tests only" in caplog.text
    assert task.checkpoint_salts(tmp_path / "flower") == [b""] * 6
    final = strategy.run.model.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(final[name], value), name
    assert len(strategy.history) == 6 and all(r.contributed == 4 for r in strategy.history)
    assert all("accuracy" in r.metrics for r in strategy.history)


def test_the_server_app_salts_every_round_by_default(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(REPEATABLE_NOISE_ENV, raising=False)
    # server.app.main (run by other tests) stops "fedmf.server" propagating: caplog needs it
    monkeypatch.setattr(logging.getLogger("fedmf.server"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="fedmf.server"):
        run_server(LocalGrid(_nodes()), _config(tmp_path, "run", rounds=3))
    assert "UNSAFE" not in caplog.text
    salts = task.checkpoint_salts(tmp_path / "run")
    assert len(salts) == 3 and len(set(salts)) == 3 and all(len(s) == 16 for s in salts)


def test_a_bad_configuration_fails_before_round_one(tmp_path):
    grid = LocalGrid({})
    with pytest.raises(ConfigError, match="clients-per-round"):
        run_server(grid, _config(tmp_path, "bad", **{"clients-per-round": 0}))
    with pytest.raises(ConfigError):
        run_server(grid, _config(tmp_path, "bad", **{"task-options": '{"num_users": -1}'}))
    assert not grid.sent


def _selected(ledger_url, run_dir, index: int) -> dict[int, set[str]]:
    """round → the users with a participation row in the ledger's ``index``-th run, recorded from ``run_dir`` (keys mapped
    back with that run's own ledger secret)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from fedmf.ledger import Ledger
    from fedmf.ledger.models import Participation

    secret = (run_dir / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(ledger_url, secret=secret) as book:
        info = book.runs()[index]
        run = book.run(info.id)
        back = {run.key(str(u)): str(u) for u in range(USERS)}
        with Session(book.engine) as session:
            rows = session.execute(select(Participation.round_index, Participation.client_key)
                                   .where(Participation.run_id == info.id)).all()
    out: dict[int, set[str]] = {}
    for t, key in rows:
        out.setdefault(int(t), set()).add(back[bytes(key)])
    return out


def test_the_server_app_enforces_lifetime_budgets_with_its_budget_key(tmp_path):
    """Two ServerApp runs on one ledger (run-config key budget-key): everyone has room for one run,
    users 0–5 for two. The second run selects only users the first did not, or users 0–5; without
    the key the app refuses the ledger before round one."""
    import math

    from fedmf.accounting.gdp import epsilon_for, run_mu_squared
    from fedmf.ledger import Ledger
    from fedmf.ledger.budgets import load_budget_secret, round_skips, set_default, set_user

    ledger_url = f"sqlite:///{tmp_path / 'shared.db'}"
    key = tmp_path / "budget.key"
    over = {"rounds": 2, "min-sep": 2, "clients-per-round": 3, "ledger-url": ledger_url, "budget-key": str(key)}
    mu2 = run_mu_squared(ServerConfig.from_mapping(_config(tmp_path, "probe", **over)).build_plan())
    secret = load_budget_secret(key, create=True)
    with Ledger.open(ledger_url) as book:
        set_default(book, secret, epsilon_for(math.sqrt(mu2) * (1 + 1e-6), 1e-10), 1e-10)
        for u in range(6):
            set_user(book, secret, str(u), epsilon_for(math.sqrt(2 * mu2) * (1 + 1e-6), 1e-10))
    with pytest.raises(ConfigError, match="budget secret"):
        run_server(LocalGrid(_nodes()), _config(tmp_path, "nokey", **{**over, "budget-key": ""}))
    run_server(LocalGrid(_nodes()), _config(tmp_path, "a", **over))
    run_server(LocalGrid(_nodes()), _config(tmp_path, "b", **over))
    first = set().union(*_selected(ledger_url, tmp_path / "a", 0).values())
    second = _selected(ledger_url, tmp_path / "b", 1)
    assert len(first) == 6 and sum(len(s) for s in second.values()) == 6
    again = set().union(*second.values()) & first
    assert again <= {str(u) for u in range(6)}
    with Ledger.open(ledger_url) as book:
        skips = round_skips(book.engine, [r.id for r in book.runs()][-1])
    # round 0 of run b: every user of run a outside 0–5 is passed over
    assert skips.get(0, 0) == len(first - {str(u) for u in range(6)})
