"""The loopback Flower harness (tests/flower_harness.py) on a throwaway Message-API app.

The app is generated from the strings below: a ServerApp that drives rounds itself through the Grid
(QUERY for each node's user id from its node_config, then TRAIN + EVALUATE per round) and a ClientApp
with @train / @evaluate / @query handlers. Both tests start real Flower processes (heavy: about
25 s for the simulation, about 60 s for the deployment on 2 cores) and check that none is left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.flower_harness import TAG_VAR, Deployment, flower_env, pid_alive, run_simulation, tagged_pids

PYPROJECT = """\
[project]
name = "harnessprobe"
version = "0.1.0"
description = "throwaway Flower app for the harness tests"
license = "Apache-2.0"
dependencies = ["flwr[simulation]==1.42.0", "numpy>=1.26"]

[tool.flwr.app]
publisher = "fedmf"

[tool.flwr.app.components]
serverapp = "harnessprobe.server_app:app"
clientapp = "harnessprobe.client_app:app"

[tool.flwr.app.config]
num-server-rounds = 2
min-nodes = 2
boom = false
fail-at-start = false
"""

CLIENT = '''\
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def _uid(context):
    nc = context.node_config  # simulation: partition-id/num-partitions; deployment: --node-config
    return int(nc.get("user-id", nc.get("partition-id", -1)))


@app.query()
def query(msg: Message, context: Context) -> Message:
    if msg.content["config"].get("boom", False):
        raise RuntimeError("client asked to explode")
    return Message(content=RecordDict({"info": ConfigRecord({"user-id": _uid(context)})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    value = int(msg.content["config"]["server-round"]) * 1000 + _uid(context)
    return Message(content=RecordDict({"metrics": MetricRecord({"value": value})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(content=RecordDict({"metrics": MetricRecord({"uid": _uid(context)})}), reply_to=msg)
'''

SERVER = '''\
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def _send(grid, node_ids, mtype, group, config):
    msgs = [Message(content=RecordDict({"config": ConfigRecord(config)}), dst_node_id=n, message_type=mtype,
                    group_id=group) for n in node_ids]
    return list(grid.send_and_receive(msgs, timeout=120))


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    if rc["fail-at-start"]:
        raise RuntimeError("server asked to fail")
    t0 = time.time()
    while len(list(grid.get_node_ids())) < int(rc["min-nodes"]):
        if time.time() - t0 > 120:
            raise RuntimeError("nodes never came")
        time.sleep(0.5)
    node_ids = sorted(grid.get_node_ids())
    uid_of = {}
    for r in _send(grid, node_ids, MessageType.QUERY, "query", {"boom": False}):
        assert not r.has_error(), r.error
        assert r.metadata.group_id == "query" and r.metadata.message_type == MessageType.QUERY
        assert r.metadata.reply_to_message_id
        uid_of[r.metadata.src_node_id] = int(r.content["info"]["user-id"])
    assert set(uid_of) == set(node_ids)
    print(f"PROBE users={sorted(uid_of.values())} sum={sum(uid_of.values())}", flush=True)
    if rc["boom"]:
        (r,) = _send(grid, node_ids[:1], MessageType.QUERY, "boom", {"boom": True})
        print(f"PROBE boom has_error={r.has_error()} code={r.error.code} content={r.has_content()}", flush=True)
    for rnd in range(1, int(rc["num-server-rounds"]) + 1):
        replies = _send(grid, node_ids, MessageType.TRAIN, str(rnd), {"server-round": rnd})
        total = sum(int(r.content["metrics"]["value"]) for r in replies if not r.has_error())
        evals = _send(grid, node_ids, MessageType.EVALUATE, str(rnd), {"server-round": rnd})
        uids = sorted(int(r.content["metrics"]["uid"]) for r in evals if not r.has_error())
        print(f"PROBE round={rnd} replies={len(replies)} sum={total} eval_uids={uids}", flush=True)
    print("PROBE done", flush=True)
'''


def make_app(root: Path) -> Path:
    app = root / "probe-app"
    (app / "harnessprobe").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "harnessprobe" / "__init__.py").write_text("")
    (app / "harnessprobe" / "client_app.py").write_text(CLIENT)
    (app / "harnessprobe" / "server_app.py").write_text(SERVER)
    return app


def assert_all_gone(pids, tag):
    assert pids, "the harness saw no Flower process at all"
    assert [p for p in pids if pid_alive(p)] == []
    assert tagged_pids(tag) == []


@pytest.mark.heavy
def test_simulation_three_supernodes_two_rounds(tmp_path):
    app = make_app(tmp_path)
    env = flower_env(tmp_path)
    res = run_simulation(app, num_supernodes=3, run_config={"num-server-rounds": 2, "min-nodes": 3},
                         timeout=300, tmp_path=tmp_path, env=env)
    res.check()
    assert res.status == "finished:completed" and res.run_id is not None
    out = res.output
    assert "PROBE users=[0, 1, 2] sum=3" in out  # partition-id 0..2 of 3 simulated SuperNodes
    assert "PROBE round=1 replies=3 sum=3003 eval_uids=[0, 1, 2]" in out
    assert "PROBE round=2 replies=3 sum=6003 eval_uids=[0, 1, 2]" in out
    assert "PROBE done" in out
    home = Path(env["FLWR_HOME"])
    assert not (home / "runtime-envs").exists()  # no `uv sync` of [project].dependencies
    assert len(res.pids_seen) >= 3  # SuperLink, SuperExec, flwr-simulation (+ Ray) were tracked...
    assert_all_gone(res.pids_seen, env[TAG_VAR])  # ...and are all gone


@pytest.mark.heavy
def test_deployment_superlink_two_supernodes(tmp_path):
    app = make_app(tmp_path)
    with Deployment(tmp_path, [{"user-id": 10}, {"user-id": 11}]) as d:
        tag = d.env[TAG_VAR]
        started = d.pids()
        assert len(started) >= 6  # SuperLink + 2 SuperNodes, each with a flower-superexec
        res = d.run(app, {"num-server-rounds": 2, "boom": True}, timeout=300).check()
        out = res.output
        assert "PROBE users=[10, 11] sum=21" in out  # user ids came from --node-config
        # a raising client handler comes back as an error reply, code 2 = CLIENT_APP_RAISED_EXCEPTION
        assert "PROBE boom has_error=True code=2 content=False" in out
        assert "PROBE round=1 replies=2 sum=2021 eval_uids=[10, 11]" in out
        assert "PROBE round=2 replies=2 sum=4021 eval_uids=[10, 11]" in out
        # a failing ServerApp: `flwr run` still exits 0, the run status says failed
        bad = d.run(app, {"fail-at-start": True}, timeout=120)
        assert bad.flwr_rc == 0 and bad.rc != 0
        assert bad.status == "finished:failed", bad.status
        seen = set(d.tracker.seen)
    assert_all_gone(seen | set(started), tag)
    assert not (Path(d.env["FLWR_HOME"]) / "runtime-envs").exists()
