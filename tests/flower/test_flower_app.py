"""The Flower app as operators run it: `flwr run .` in simulation (Ray) and against a SuperLink with
SuperNodes as processes, and the ServerApp's crash-exact resume. Every process started is killed by
PID (tests/flower_harness.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedmf.ledger import Ledger
from fedmf.run.federated import train
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.tasks import ClientHyper, get_task
from server.config import ServerConfig
from tests import _federated_task as task
from tests.flower_harness import Deployment, enrolled_users, run_simulation

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _repeatable_noise(monkeypatch):
    """Every test here compares a Flower run with the in-process loop (or an uninterrupted run) bit
    for bit: the ServerApp processes inherit FEDMF_UNSAFE_REPEATABLE_NOISE=1 (no noise salts)."""
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")


def _values(run_dir: Path, users: int, rounds: int, per_round: int, **over) -> dict:
    values = {"task": "tiny", "task-options": f'{{"num_users": {users}}}', "mechanism": "bsr", "rounds": rounds,
              "min-sep": 2, "clients-per-round": per_round, "noise-multiplier": 0.6, "server-momentum": 0.5,
              "client-lr": 0.2, "batch-size": 8, "run-dir": str(run_dir), "reply-timeout": 120.0}
    values.update(over)
    return values


def _in_process_reference(values: dict, secrets_from: Path, directory: Path) -> dict:
    """The same run in the plain-PyTorch loop with the Flower run's secrets."""
    task.share_secrets(secrets_from, directory)
    config = ServerConfig.from_mapping({**values, "run-dir": str(directory)})
    tiny = get_task(config.task, **config.task_options)
    model = tiny.model()
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    train(model, tiny.users(), config.build_plan(), tiny.as_local_update(hyper), server_lr=config.server_lr,
          checkpoint_dir=directory, repeatable_noise=True)
    return model.state_dict()


def _committed(run_dir: Path) -> list[int]:
    secret = (run_dir / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(run_dir / "ledger.db", secret=secret) as book:
        run = book.run(book.runs()[-1].id)
        return [t for t in range(run.info.rounds) if run.round(t).status == "committed"]


@pytest.mark.heavy  # CI keeps fedmf simulate --backend flower's twin (test_simulate_backends) and flwr run on a SuperLink
def test_flwr_run_simulation_matches_the_in_process_loop(tmp_path):
    values = _values(tmp_path / "sim", users=20, rounds=5, per_round=5)
    result = run_simulation(ROOT, num_supernodes=20, run_config=values, timeout=400, tmp_path=tmp_path / "flwr")
    assert result.rc == 0, result.output[-3000:]
    assert _committed(tmp_path / "sim") == [0, 1, 2, 3, 4]
    final = torch.load(tmp_path / "sim" / "final-model.pt", weights_only=True)
    reference = _in_process_reference(values, tmp_path / "sim", tmp_path / "loop")
    for name, value in reference.items():
        assert torch.equal(final[name], value), name


def test_flwr_run_against_a_superlink_and_two_supernodes(tmp_path):
    """Two SuperNodes whose users prove enrolled keys (the README's deployment quick-start)."""
    enrollment, node_configs = enrolled_users(tmp_path / "users", ["0", "1"])
    values = _values(tmp_path / "deploy", users=2, rounds=2, per_round=1,
                     **{"min-sep": 1, "user-enrollment": str(enrollment),
                        "identity-timeout": 60.0})  # a ClientApp process per message, on 2 shared cores
    with Deployment(tmp_path / "flwr", node_configs) as deployment:
        result = deployment.run(ROOT, values, timeout=400)
    assert result.rc == 0, result.output[-3000:]
    assert _committed(tmp_path / "deploy") == [0, 1]
    # by default nothing a client reports leaves the server (issue 34): not in the round log, the outcome or
    # the ServerApp's output, though every ClientApp sends its train-loss and num-examples
    published = "".join((tmp_path / "deploy" / f).read_text() for f in ("rounds.jsonl", "outcome.json"))
    assert "fedmf round 1 (2/2 done)" in result.output and "client metrics: none published" in result.output
    for text in (published, result.output):
        assert "train-loss" not in text and "num-examples" not in text
    reference = _in_process_reference(values, tmp_path / "deploy", tmp_path / "loop")
    final = torch.load(tmp_path / "deploy" / "final-model.pt", weights_only=True)
    for name, value in reference.items():
        assert torch.equal(final[name], value), name


_SERVER_SCRIPT = textwrap.dedent("""
    import json, sys
    from client.app import app as client_app
    from server.app import run_server
    from server.local_grid import LocalGrid, client_node
    values = json.loads(sys.argv[1])
    users = json.loads(values["task-options"])["num_users"]
    nodes = {100 + i: client_node(client_app, {"partition-id": i}, 100 + i) for i in range(users)}
    run_server(LocalGrid(nodes), values)
""")


@pytest.mark.parametrize("kill_at", ["noised:1", pytest.param("checkpointed:2", marks=pytest.mark.heavy),
                                     pytest.param("committed:3", marks=pytest.mark.heavy)])
def test_a_sigkilled_server_resumes_bit_identically(tmp_path, kill_at):
    """The ServerApp's code path (configuration, strategy, PrivateRun) SIGKILLed at a point of a
    round and started again with the same configuration ends with the uninterrupted model."""
    import json
    import os

    values = _values(tmp_path / "run", users=8, rounds=6, per_round=3)
    task.write_secrets(tmp_path / "run")
    env = {**os.environ, "FEDMF_KILL_AT": kill_at}
    killed = subprocess.run([sys.executable, "-c", _SERVER_SCRIPT, json.dumps(values)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "run" / "final-model.pt").exists()
    env.pop("FEDMF_KILL_AT")
    resumed = subprocess.run([sys.executable, "-c", _SERVER_SCRIPT, json.dumps(values)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _committed(tmp_path / "run") == list(range(6))
    final = torch.load(tmp_path / "run" / "final-model.pt", weights_only=True)
    reference = _in_process_reference(values, tmp_path / "run", tmp_path / "loop")
    for name, value in reference.items():
        assert torch.equal(final[name], value), name


@pytest.mark.heavy
def test_a_sigkilled_serverapp_under_flwr_run_resumes_bit_identically(tmp_path):
    """The real runtime: the ServerApp process of a `flwr run` simulation is SIGKILLed after round
    2's checkpoint and before its commit; a second `flwr run` with the same configuration resumes."""
    from tests.flower_harness import flower_env

    values = _values(tmp_path / "run", users=10, rounds=5, per_round=4)
    env = {**flower_env(tmp_path / "flwr1"), "FEDMF_KILL_AT": "checkpointed:2"}
    killed = run_simulation(ROOT, num_supernodes=10, run_config=values, timeout=400, tmp_path=tmp_path / "flwr1",
                            env=env)
    assert killed.rc != 0
    assert _committed(tmp_path / "run") == [0, 1]
    resumed = run_simulation(ROOT, num_supernodes=10, run_config=values, timeout=400, tmp_path=tmp_path / "flwr2")
    assert resumed.rc == 0, resumed.output[-3000:]
    assert _committed(tmp_path / "run") == [0, 1, 2, 3, 4]
    final = torch.load(tmp_path / "run" / "final-model.pt", weights_only=True)
    reference = _in_process_reference(values, tmp_path / "run", tmp_path / "loop")
    for name, value in reference.items():
        assert torch.equal(final[name], value), name
