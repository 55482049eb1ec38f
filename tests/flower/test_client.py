"""client/: the task registry, the tiny task (determinism, the SGD delta, learning) and the
ClientApp handlers called directly on hand-built Messages (no simulation)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

import fedmf.tasks
from client.app import ERROR_CODE, app, load_task, user_id
from fedmf.errors import ConfigError
from fedmf.tasks import TASKS, ClientHyper, get_task, stable_seed

HYPER = ClientHyper(client_lr=0.1, local_epochs=2, batch_size=8)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task():
    return get_task("tiny")


def _params(task):
    return {k: v.clone() for k, v in task.model().state_dict().items()}


def _equal(a, b) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ---- registry and options ------------------------------------------------------------------

def test_registry_and_tiny_shape(task):
    assert set(TASKS) == {"tiny", "so-synthetic", "stackoverflow", "shakespeare"}
    assert task.name == "tiny"
    assert task.options == {"num_users": 20, "seed": 0, "examples_per_user": [8, 64], "eval_users": 10}
    assert task.users() == [str(i) for i in range(20)]
    model = task.model()
    assert sum(p.numel() for p in model.parameters()) == 212
    assert all(p.dtype == torch.float32 for p in model.parameters())
    sizes = [len(task.user_data(u)[1]) for u in task.users()]
    assert min(sizes) >= 8 and max(sizes) == 64 and len(set(sizes)) > 5  # heavy-ish tail, capped
    # non-IID: users' class mixes differ
    mixes = {tuple((torch.bincount(task.user_data(u)[1], minlength=4) > 0).tolist()) for u in task.users()}
    assert len(mixes) > 3


@pytest.mark.parametrize("name, options, match", [
    ("nope", {}, "unknown task"),
    ("tiny", {"num_user": 3}, "unknown tiny task option"),
    ("tiny", {"num_users": 0}, "num_users"),
    ("tiny", {"num_users": True}, "num_users"),
    ("tiny", {"seed": -1}, "seed"),
    ("tiny", {"seed": 1.5}, "seed"),
    ("tiny", {"examples_per_user": [10, 5]}, "examples_per_user max"),
    ("tiny", {"examples_per_user": "8-64"}, "examples_per_user"),
    ("tiny", {"eval_users": 0}, "eval_users"),
])
def test_bad_options(name, options, match):
    with pytest.raises(ConfigError, match=match) as e:
        get_task(name, **options)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"client_lr": 0.0}, "client-lr"), ({"client_lr": float("nan")}, "client-lr"), ({"client_lr": True}, "client-lr"),
    ({"local_epochs": 0}, "local-epochs"), ({"local_epochs": 1.0}, "local-epochs"), ({"batch_size": 0}, "batch-size"),
])
def test_bad_hyper(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ClientHyper(**{"client_lr": 0.1, "local_epochs": 1, "batch_size": 4, **kwargs})


def test_bad_local_update_inputs(task):
    params = _params(task)
    with pytest.raises(ConfigError, match="unknown tiny user"):
        task.local_update(params, "20", 0, HYPER)
    with pytest.raises(ConfigError, match="unknown tiny user"):
        task.local_update(params, "05", 0, HYPER)
    with pytest.raises(ConfigError, match="do not match"):
        task.local_update({k: v for k, v in params.items() if k != "0.bias"}, "1", 0, HYPER)
    with pytest.raises(ConfigError, match="shape"):
        task.local_update({**params, "0.bias": torch.zeros(3)}, "1", 0, HYPER)
    with pytest.raises(ConfigError, match="round"):
        task.local_update(params, "1", -1, HYPER)


def test_tasks_import_no_flwr():
    for path in (ROOT / "client" / "tasks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "flwr" for n in names), path


# ---- determinism and the delta ---------------------------------------------------------------

def test_stable_seed_pinned():
    # a change of this value changes every generated data set and shuffle: do it on purpose only
    assert stable_seed(0, "train", "3", 1) == stable_seed(0, "train", "3", 1)
    assert stable_seed(0, "train", "3", 1) != stable_seed(0, "train", "3", 2)
    assert 0 <= stable_seed("x") < 2**63


def test_local_update_deterministic(task):
    params = _params(task)
    before = {k: v.clone() for k, v in params.items()}
    g = torch.random.get_rng_state()
    a = task.local_update(params, "3", 5, HYPER)
    b = get_task("tiny").local_update(_params(get_task("tiny")), "3", 5, HYPER)  # a freshly built task
    assert torch.equal(torch.random.get_rng_state(), g)  # the global RNG is never used
    assert _equal(params, before)  # params are not modified
    assert _equal(a.update, b.update) and a.num_examples == b.num_examples and a.metrics == b.metrics
    assert list(a.update) == list(params)
    assert all(a.update[k].shape == params[k].shape and a.update[k].dtype == torch.float32 for k in params)
    other_round = task.local_update(params, "3", 6, HYPER).update
    assert not _equal(a.update, other_round)  # another round shuffles differently
    other_user = task.local_update(params, "4", 5, HYPER).update
    assert not _equal(a.update, other_user)
    other_seed = get_task("tiny", seed=1)
    assert not torch.equal(other_seed.user_data("3")[0][:8], task.user_data("3")[0][:8])


_SUBPROCESS = """
import sys, torch
torch.set_num_threads(1)
from fedmf.tasks import get_task, ClientHyper
t = get_task("tiny", num_users=5, seed=7)
r = t.local_update(t.model().state_dict(), "2", 4, ClientHyper(0.05, 3, 4))
torch.save(r.update, sys.argv[1])
"""


def test_local_update_identical_in_another_process(tmp_path):
    out = tmp_path / "update.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "123"}
    subprocess.run([sys.executable, "-c", _SUBPROCESS, str(out)], check=True, cwd=ROOT, env=env, timeout=120)
    t = get_task("tiny", num_users=5, seed=7)
    here = t.local_update(t.model().state_dict(), "2", 4, ClientHyper(0.05, 3, 4)).update
    assert _equal(torch.load(out), here)


def test_update_is_one_sgd_step(task):
    """One epoch with a batch covering all data: delta = −lr · ∇ mean cross-entropy at params."""
    params = _params(task)
    x, y = task.user_data("2")
    result = task.local_update(params, "2", 0, ClientHyper(client_lr=0.3, local_epochs=1, batch_size=len(y)))
    model = task.model()
    model.load_state_dict(params)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = {name: -0.3 * g for (name, _), g in zip(model.named_parameters(), grads)}
    assert result.num_examples == len(y)
    assert result.metrics["train-loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for name in params:
        torch.testing.assert_close(result.update[name], expected[name], rtol=1e-4, atol=1e-6)
    assert max(float(v.abs().max()) for v in result.update.values()) > 1e-3  # a real step


def test_tiny_learns_with_fedavg(task):
    """10 rounds of plain FedAvg over all users: held-out accuracy from chance level to ~0.9."""
    hyper = ClientHyper(client_lr=0.1, local_epochs=1, batch_size=16)
    model = task.model()
    start = task.evaluate(model)
    params = _params(task)
    update = task.as_local_update(hyper)  # the shape fedmf.run.federated.train calls
    started = time.perf_counter()
    for t in range(10):
        updates = [update(params, user, t) for user in task.users()]
        params = {k: params[k] + torch.stack([u[k] for u in updates]).mean(0) for k in params}
    elapsed = time.perf_counter() - started
    model.load_state_dict(params)
    end = task.evaluate(model)
    assert start["accuracy"] < 0.4
    assert end["accuracy"] > 0.8  # chance is 0.25; this seed reaches ~0.9
    assert end["loss"] < start["loss"] - 0.5
    assert elapsed < 20  # 200 local updates (milliseconds each)
    n, scores = task.evaluate_user(model, "0")
    assert n == len(task.user_data("0")[1]) and 0.0 <= scores["accuracy"] <= 1.0
    assert model.training  # evaluation leaves the mode alone


# ---- identity ------------------------------------------------------------------------------

@pytest.mark.parametrize("node_config, expected", [
    ({"user-id": "alice"}, "alice"),
    ({"user-id": "alice", "partition-id": 3}, "alice"),
    ({"user-id": 17}, "17"),
    ({"partition-id": 0}, "0"),
    ({"partition-id": 12, "num-partitions": 20}, "12"),
])
def test_user_id(node_config, expected):
    assert user_id(node_config) == expected


def test_a_simulated_node_is_the_tasks_partition_th_user():
    """Numbered tasks keep str(partition-id); a task with named users (shakespeare's roles) maps
    partition i to its i-th user, the order fedmf simulate --backend flower numbers them in."""
    from client.app import simulation_user
    from fedmf.tasks import get_task

    tiny = {"task": "tiny", "task-options": json.dumps({"num_users": 12})}
    assert [user_id({"partition-id": i}, tiny) for i in range(12)] == [str(i) for i in range(12)]
    roles = get_task("shakespeare", model_size="small").users()
    shakespeare = {"task": "shakespeare", "task-options": json.dumps({"model_size": "small"})}
    assert [simulation_user(i, shakespeare) for i in (0, 5, len(roles) - 1)] == [roles[0], roles[5], roles[-1]]
    assert user_id({"user-id": "alice", "partition-id": 3}, shakespeare) == "alice"  # deployment: the config wins
    with pytest.raises(ConfigError, match="beyond the task's"):
        simulation_user(len(roles), shakespeare)


@pytest.mark.parametrize("node_config, match", [
    ({}, "neither user-id nor partition-id"),
    ({"num-partitions": 3}, "neither"),
    ({"user-id": ""}, "user-id"),
    ({"user-id": "a\nb"}, "user-id"),
    ({"user-id": "x" * 201}, "user-id"),
    ({"user-id": True}, "user-id"),
    ({"partition-id": -1}, "partition-id"),
    ({"partition-id": "3"}, "partition-id"),
])
def test_user_id_errors(node_config, match):
    with pytest.raises(ConfigError, match=match):
        user_id(node_config)


# ---- handlers --------------------------------------------------------------------------------

def _message(content: RecordDict, message_type: str) -> Message:
    metadata = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=7, reply_to_message_id="",
                        group_id="g", created_at=time.time(), ttl=3600.0, message_type=message_type)
    return Message(content, metadata=metadata)


def _context(**node_config) -> Context:
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def _config(**overrides) -> ConfigRecord:
    config = {"round": 3, "run-nonce": "n0nce", "user-id": "5", "task": "tiny",
              "task-options": json.dumps({"num_users": 8, "seed": 2}), "client-lr": 0.1, "local-epochs": 2,
              "batch-size": 8}
    config.update(overrides)
    return ConfigRecord({k: v for k, v in config.items() if v is not None})


def _train_message(source, **overrides) -> Message:
    arrays = ArrayRecord(source.model().state_dict())
    return _message(RecordDict({"arrays": arrays, "config": _config(**overrides)}), MessageType.TRAIN)


def test_query_handler():
    reply = app(_message(RecordDict({"config": ConfigRecord({"request": "identity"})}), MessageType.QUERY),
                _context(**{"partition-id": 4}))
    assert not reply.has_error() and dict(reply.content.config_records["identity"]) == {"user-id": "4"}
    assert reply.metadata.reply_to_message_id == "m1" and reply.metadata.dst_node_id == 1
    reply = app(_message(RecordDict(), MessageType.QUERY), _context())
    assert reply.has_error() and reply.error.code == ERROR_CODE and "no user identity" in reply.error.reason


def test_train_handler_end_to_end():
    task = get_task("tiny", num_users=8, seed=2)
    reply = app(_train_message(task), _context(**{"partition-id": 5}))
    assert not reply.has_error()
    assert reply.metadata.reply_to_message_id == "m1" and reply.metadata.message_type == MessageType.TRAIN
    expected = task.local_update(task.model().state_dict(), "5", 3, ClientHyper(0.1, 2, 8))
    assert _equal(reply.content.array_records["arrays"].to_torch_state_dict(), expected.update)  # bit for bit
    metrics = reply.content.metric_records["metrics"]
    assert dict(metrics) == {"num-examples": expected.num_examples, "train-loss": expected.metrics["train-loss"]}
    assert dict(reply.content.config_records["config"]) == {"round": 3, "run-nonce": "n0nce", "user-id": "5"}
    # deployment identity, and the per-process task cache
    reply = app(_train_message(task, **{"user-id": "7"}), _context(**{"user-id": "7"}))
    assert not reply.has_error()
    assert load_task("tiny", '{"seed": 2, "num_users": 8}') is load_task("tiny", {"num_users": 8, "seed": 2})


@pytest.mark.parametrize("overrides, node_config, match", [
    ({}, {"partition-id": 4}, "for user '5', this node is '4'"),
    ({}, {}, "no user identity"),
    ({"round": None}, {"partition-id": 5}, "'round'"),
    ({"round": -1}, {"partition-id": 5}, "'round'"),
    ({"client-lr": "0.1"}, {"partition-id": 5}, "client-lr"),
    ({"client-lr": -1.0}, {"partition-id": 5}, "client-lr"),
    ({"batch-size": 0}, {"partition-id": 5}, "batch-size"),
    ({"task": "nope"}, {"partition-id": 5}, "unknown task"),
    ({"task-options": "{bad"}, {"partition-id": 5}, "task-options"),
    ({"task-options": "[1]"}, {"partition-id": 5}, "task-options"),
    ({"task-options": '{"num_users": 3}'}, {"partition-id": 5}, "arrays|unknown tiny user"),
])
def test_train_handler_errors(overrides, node_config, match):
    task = get_task("tiny", num_users=8, seed=2)
    reply = app(_train_message(task, **overrides), _context(**node_config))
    assert reply.has_error() and reply.error.code == ERROR_CODE
    assert reply.error.reason.startswith("fedmf: ") and "\n" not in reply.error.reason
    assert re.search(match, reply.error.reason), reply.error.reason


def test_train_handler_wrong_arrays():
    task = get_task("tiny", num_users=8, seed=2)
    params = task.model().state_dict()
    del params["2.bias"]
    content = RecordDict({"arrays": ArrayRecord(params), "config": _config()})
    reply = app(_message(content, MessageType.TRAIN), _context(**{"partition-id": 5}))
    assert reply.has_error() and "do not match" in reply.error.reason
    reply = app(_message(RecordDict({"config": _config()}), MessageType.TRAIN), _context(**{"partition-id": 5}))
    assert reply.has_error() and "no arrays record" in reply.error.reason


def test_evaluate_handler():
    task = get_task("tiny", num_users=8, seed=2)
    content = RecordDict({"arrays": ArrayRecord(task.model().state_dict()),
                          "config": _config(**{"client-lr": None, "local-epochs": None, "batch-size": None})})
    reply = app(_message(content, MessageType.EVALUATE), _context(**{"partition-id": 5}))
    assert not reply.has_error()
    n, scores = task.evaluate_user(task.model(), "5")
    assert dict(reply.content.metric_records["metrics"]) == {
        "num-examples": n, "eval-loss": scores["loss"], "eval-accuracy": scores["accuracy"]}
    assert dict(reply.content.config_records["config"]) == {"round": 3, "run-nonce": "n0nce", "user-id": "5"}
    reply = app(_message(content, MessageType.EVALUATE), _context(**{"partition-id": 6}))
    assert reply.has_error() and "this node is '6'" in reply.error.reason


def test_client_tasks_package_exports():
    assert set(fedmf.tasks.__all__) >= {"get_task", "TASKS", "Task", "ClientHyper", "LocalResult"}
