"""`fedmf simulate --backend flower --ray-address HOST:PORT`: the virtual clients run on an existing
Ray cluster (launcher/ray_cluster.py). The options are checked at the edge (one line, exit 2, nothing
launched); what reaches Flower is what Flower 1.42's own parsers turn into the Ray backend's client
resources; the SuperLink (whose environment flwr-simulation inherits) carries RAY_ADDRESS. The heavy
case starts a two-node Ray cluster on loopback with the README's `ray start` lines, runs so-tiny on
it, sees a ClientApp actor train on each node, and gets the in-process model bit for bit."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import launcher.flower_cli as launcher
import launcher.processes as supervisor
from fedmf.checks import host_port
from fedmf.cli import main
from fedmf.errors import ConfigError
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from launcher.ray_cluster import check_reachable, client_resources, ray_environment
from tests import _federated_task as fixed
from tests.flower.test_simulate_backends import SO_TINY_2, TINY_2, _assert_nothing_left, launches  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]
_BLOCKS = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.M | re.S)


def _readme_ray_lines() -> dict[str, list[str]]:
    """The README's Ray cluster block: its `ray start` lines (head, other nodes; each `--block &`, its
    PID kept and killed, never `ray stop`) and `fedmf simulate` line, without `--block &`."""
    found = [b for b in _BLOCKS if "--ray-address" in b]
    assert len(found) == 1, f"README.md has {len(found)} bash blocks with --ray-address"
    lines = [ln.strip() for ln in found[0].splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "ray stop" not in found[0] and "pkill" not in found[0], "stop Ray by PID, never by name"
    out = {"head": [ln for ln in lines if ln.startswith("ray start --head")],
           "node": [ln for ln in lines if ln.startswith("ray start --address")],
           "fedmf": [ln for ln in lines if ln.startswith("fedmf simulate")],
           "stop": [ln for ln in lines if ln == "kill $ray_pid"]}
    assert all(len(v) == 1 for v in out.values()) and len(lines) == 7, lines
    for key in ("head", "node"):
        assert out[key][0].endswith(" --block &"), out[key]
        assert lines[lines.index(out[key][0]) + 1] == "ray_pid=$!", lines
        out[key] = [out[key][0].removesuffix(" --block &")]
    assert lines[0].startswith("port=$(python3 -c ") and "--port $port" in out["head"][0], lines
    return {k: shlex.split(v[0]) for k, v in out.items()}


def test_the_readme_port_line_prints_a_free_port():
    """The block's first line, run by bash: a port nobody listens on (Ray's 6379 may be taken)."""
    import subprocess

    block = next(b for b in _BLOCKS if "--ray-address" in b)
    line = next(ln for ln in block.splitlines() if ln.startswith("port=$("))
    done = subprocess.run(["bash", "-c", f"{line}\necho $port"], capture_output=True, text=True, timeout=60)
    port = int(done.stdout.strip())
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


# ---- no process needed ---------------------------------------------------------------------------


def test_an_address_is_host_colon_port():
    assert host_port("a", "127.0.0.1:6379") == "127.0.0.1:6379"
    assert host_port("a", "head-0.cluster.local:06379") == "head-0.cluster.local:6379"
    assert host_port("a", "[fe80::1]:1") == "[fe80::1]:1"
    for bad in ("6379", "head:", ":6379", "head:0", "head:65536", "head:+1", "head: 1", "he ad:1", "ray://head:10001",
                "head:1/x", "::1:6379", "-head:1", "[]:1", "head:٣"):
        with pytest.raises(ConfigError, match=r"^a must be an address HOST:PORT"):
            host_port("a", bad)
    with pytest.raises(ConfigError):
        host_port("a", 6379)


@pytest.mark.parametrize("argv, says", [
    (["--ray-address", "127.0.0.1:6379"], "--ray-address is for --backend flower"),
    (["--client-cpus", "2", "--client-gpus", "0.5"], "--client-cpus, --client-gpus are for --backend flower"),
    (["--backend", "flower", "--ray-address", "ray://head:10001"], "not a URL"),
    (["--backend", "flower", "--ray-address", "head"], "--ray-address must be an address HOST:PORT"),
    (["--backend", "flower", "--ray-address", "head:70000"], "with a port in [1, 65535]"),
    (["--backend", "flower", "--client-cpus", "0.5"], "--client-cpus must be a whole number of CPUs >= 1"),
    (["--backend", "flower", "--client-cpus", "0"], "--client-cpus must be a whole number of CPUs >= 1"),
    (["--backend", "flower", "--client-gpus", "-0.25"], "--client-gpus must be >= 0"),
    (["--backend", "flower", "--client-gpus", "nan"], "--client-gpus must be finite"),
])
def test_ray_options_are_checked_in_one_line_before_anything_starts(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.setattr(launcher, "run_simulation", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr("fedmf.tasks.get_task", lambda *a, **k: pytest.fail("the task was loaded"))
    assert main([*TINY_2, *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedmf: error: ") and says in err[0], err


def test_an_address_nobody_answers_is_one_line_before_any_flower_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "run_simulation", lambda *a, **k: pytest.fail("launched"))
    port = launcher.free_port()  # bound and closed again: nothing listens there
    assert main([*TINY_2, "--backend", "flower", "--ray-address", f"127.0.0.1:{port}", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedmf: error: no Ray cluster answers at 127.0.0.1:{port} "), err


def test_the_options_reach_the_launch(tmp_path, capsys, monkeypatch):
    """A listening address passes the reachability check; the launch gets the address and resources."""
    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(launcher, "run_simulation", fake)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert main([*TINY_2, "--backend", "flower", "--ray-address", address, "--client-cpus", "2",
                     "--client-gpus", "0.25", "--out", str(tmp_path)]) == 2
    assert "stopped by the test" in capsys.readouterr().err
    assert (seen["ray_address"], seen["client_num_cpus"], seen["client_num_gpus"]) == (address, 2, 0.25)
    assert type(seen["client_num_cpus"]) is int


def test_without_ray_options_the_launch_gets_a_local_ray_with_one_cpu_per_client(tmp_path, monkeypatch):
    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(launcher, "run_simulation", fake)
    assert main([*TINY_2, "--backend", "flower", "--out", str(tmp_path)]) == 2
    assert (seen["ray_address"], seen["client_num_cpus"], seen["client_num_gpus"]) == (None, 1, None)


def test_the_readme_command_parses_to_the_documented_options(tmp_path, monkeypatch):
    seen = {}

    def backend(config, values, task, **kwargs):
        seen.update(kwargs)
        raise ConfigError("stopped by the test")

    monkeypatch.setattr("fedmf.cli.simulate._backend", lambda name: backend)
    monkeypatch.setattr("fedmf.tasks.get_task", lambda *a, **k: _NoTask())
    argv = [a.replace("$port", "6379") for a in _readme_ray_lines()["fedmf"]]  # the head's port, as bash gives it
    assert argv[:2] == ["fedmf", "simulate"]
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 2
    assert (seen["ray_address"], seen["client_cpus"]) == ("HEAD_IP:6379", 1)


class _NoTask:
    task_options: dict = {}


def test_the_federation_config_becomes_the_ray_backends_client_resources():
    """What run_simulation passes to `flwr run --federation-config`, through Flower 1.42's own parsing
    (flwr/cli/run/run.py: parse_config_args, '-' -> '_', simulation_config_from_json) and the
    simulation engine's (flwr/simulation/app.py), is the Ray backend's client_resources; init_args
    stay empty (ray.init refuses num_cpus/num_gpus when it joins a cluster). A fractional CPU is
    refused by Flower 1.42 itself (an unsigned integer field): hence --client-cpus is whole."""
    from flwr.common.config import parse_config_args
    from flwr.simulation.app import _run_simulation_settings
    from flwr.supercore.utils import simulation_config_from_json

    def backend_config(fed: dict) -> tuple[int, dict]:
        flag, text = launcher._federation_args(fed)
        assert flag == "--federation-config"
        parsed = {k.replace("-", "_"): v for k, v in parse_config_args([text]).items()}
        n, name, config, _verbose, _ = _run_simulation_settings(simulation_config_from_json(parsed))
        assert name == "ray"
        return n, config

    assert backend_config({"num-supernodes": 800, **client_resources(2, 0.25)}) == \
        (800, {"client_resources": {"num_cpus": 2, "num_gpus": 0.25}, "init_args": {}})
    assert backend_config({"num-supernodes": 3, **client_resources(1, None)}) == \
        (3, {"client_resources": {"num_cpus": 1}, "init_args": {}})
    with pytest.raises(TypeError):
        simulation_config_from_json({"client_resources_num_cpus": 0.5})


def test_the_superlink_carries_ray_address(tmp_path, monkeypatch):
    """The environment of the process run_simulation starts as the SuperLink (here a stand-in) holds
    RAY_ADDRESS: the cluster's address, or "local" (never a cluster found by chance); the federation
    config holds the client resources; the stand-in is gone afterwards."""
    from launcher import ray_cluster

    got = []

    def health(port, proc, timeout, log=""):
        end = time.monotonic() + 10
        while supervisor._cmdline(proc.pid) != "sleep 60" and time.monotonic() < end:  # until it has exec'd
            time.sleep(0.01)
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        got.append({"pid": proc.pid, "ray": env.get(ray_cluster.RAY_ADDRESS_VAR.encode())})

    def flwr_run(tracker, app, connection, *, federation_config, **kwargs):
        got[-1]["fed"] = dict(federation_config)
        return launcher.FlowerResult(args=[], rc=0, flwr_rc=0, stdout="", stderr="")

    monkeypatch.setattr(launcher, "superlink_argv", lambda *a, **k: ["sleep", "60"])
    monkeypatch.setattr(launcher, "wait_http_health", health)
    monkeypatch.setattr(launcher, "flwr_run", flwr_run)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # the caller's: never what a launch uses
    launcher.run_simulation(ROOT, num_supernodes=4, tmp_path=tmp_path / "a")
    launcher.run_simulation(ROOT, num_supernodes=4, tmp_path=tmp_path / "b", ray_address="127.0.0.1:7",
                            client_num_cpus=3, client_num_gpus=0.5)
    assert [g["ray"] for g in got] == [b"local", b"127.0.0.1:7"]
    assert [g["fed"] for g in got] == [
        {"num-supernodes": 4, "client-resources-num-cpus": 1},
        {"num-supernodes": 4, "client-resources-num-cpus": 3, "client-resources-num-gpus": 0.5}]
    assert not any(supervisor.pid_alive(g["pid"]) for g in got)
    assert ray_environment(None) == {"RAY_ADDRESS": "local"}


def test_check_reachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        check_reachable(f"127.0.0.1:{listener.getsockname()[1]}")
    port = launcher.free_port()
    with pytest.raises(ConfigError, match=rf"^no Ray cluster answers at 127\.0\.0\.1:{port} \(.*\): start one with"):
        check_reachable(f"127.0.0.1:{port}")


# ---- a two-node Ray cluster on loopback -------------------------------------------------------------


def _ray_exe() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else "ray"


def _node_flags(root: Path, name: str) -> list[str]:
    """What one machine needs to hold two Ray nodes: loopback, 1 CPU, its own temp dir and ports."""
    ports = {flag: launcher.free_port() for flag in (
        "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")}
    workers = ",".join(str(launcher.free_port()) for _ in range(12))
    return ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "0", "--temp-dir", str(root / name),
            "--disable-usage-stats", "--worker-port-list", workers,
            *[x for flag, port in ports.items() for x in (flag, str(port))], "--block"]


def _wait_started(tracker, name: str, proc, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while "Ray runtime started" not in tracker.log_text(name):
        assert proc.poll() is None, f"ray start ({name}) exited {proc.returncode}: {tracker.log_text(name)[-3000:]}"
        assert time.monotonic() < end, f"ray start ({name}) not ready in {timeout_s} s"
        time.sleep(0.2)


def _ancestor_in(pid: int, roots: dict[int, str]) -> str | None:
    for _ in range(64):
        if pid in roots:
            return roots[pid]
        pid = supervisor._ppid(pid)
        if not pid or pid == 1:
            return None
    return None


class _Watch(threading.Thread):
    """Polls /proc while the run goes on: which node's ClientApp actor is seen executing
    ``ClientAppActor.run`` (Ray's process title while an actor runs that method), and any Ray
    (gcs_server, raylet) started by the Flower launch itself."""

    def __init__(self, nodes: dict[int, str], launches):  # noqa: F811 (the imported fixture's value, passed in by the test)
        super().__init__(daemon=True)
        self.nodes, self.launches = nodes, launches
        self.ran: dict[str, set[int]] = {}
        self.own_ray: set[str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            tag = self.launches[-1][0] if self.launches else None
            for pid in supervisor._all_pids():
                title = supervisor._cmdline(pid)
                if title.startswith("ray::ClientAppActor.run"):
                    node = _ancestor_in(pid, self.nodes)
                    self.ran.setdefault(str(node), set()).add(pid)
                elif tag and ("gcs_server" in title or "raylet/raylet" in title) and _tagged(pid, tag):
                    self.own_ray.add(title[:100])


def _tagged(pid: int, tag: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{supervisor.TAG_VAR}={tag}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _stop_nodes(tracker, timeout_s: float = 30.0) -> None:
    """SIGTERM each `ray start --block` by its PID (it stops its node's processes, as `ray stop` would,
    in about 2 s; a SIGTERM to every process at once instead leaves some waiting on the others), wait
    for every process of the cluster (its environment tag) to exit, then the tracker's teardown: it
    SIGKILLs whatever is left and raises if anything survives."""
    for proc in tracker.procs:
        if proc.poll() is None and proc.args[1:2] == ["start"]:
            os.kill(proc.pid, signal.SIGTERM)
    end = time.monotonic() + timeout_s
    while tracker.live_pids() and time.monotonic() < end:
        time.sleep(0.2)
    tracker.cleanup()


@pytest.mark.heavy  # 70-100 s on 2 loaded cores: two Ray nodes, a Flower run on them, the in-process run
def test_so_tiny_on_a_two_node_ray_cluster_trains_on_both_nodes_and_matches_in_process(tmp_path, capsys, launches,  # noqa: F811 (the imported fixture)
                                                                                      monkeypatch):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: the same noise in both backends' runs
    readme = _readme_ray_lines()
    root = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))  # Ray's AF_UNIX socket paths stay under 108 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", FEDMF_TEST_RAY_CLUSTER=uuid.uuid4().hex)
    tracker = supervisor.ProcessTracker(env, tmp_path / "ray-logs", tag_var="FEDMF_TEST_RAY_CLUSTER")
    started = time.perf_counter()
    try:
        port = launcher.free_port()
        address = f"127.0.0.1:{port}"

        def as_run(argv: list[str]) -> list[str]:  # the README's line, on loopback
            assert argv[:2] == ["ray", "start"]
            return [_ray_exe(), "start", *[a.replace("HEAD_IP", "127.0.0.1").replace("$port", str(port))
                                           .replace("PORT", str(port)) for a in argv[2:]]]

        head = tracker.spawn("head", [*as_run(readme["head"]), "--include-dashboard=false", "--dashboard-port",
                                      str(launcher.free_port()), "--ray-client-server-port", str(launcher.free_port()),
                                      *_node_flags(root, "h")])
        _wait_started(tracker, "head", head)
        node = tracker.spawn("node", [*as_run(readme["node"]), *_node_flags(root, "n")])
        _wait_started(tracker, "node", node)
        probe = (f"import ray, time; ray.init(address={address!r}, include_dashboard=False); end = time.time() + 60\n"
                 "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.time() < end: time.sleep(0.5)\n"
                 "print('NODES', sum(n['Alive'] for n in ray.nodes()), ray.cluster_resources().get('CPU'))")
        rc, out, err, _ = tracker.run([sys.executable, "-c", probe], timeout=120)
        assert rc == 0 and "NODES 2 2.0" in out, (out + err)[-3000:]
        cluster_s = time.perf_counter() - started

        flower_dir, local_dir = tmp_path / "flower", tmp_path / "inprocess"
        fixed.write_secrets(flower_dir)
        fixed.write_secrets(local_dir)
        watch = _Watch({head.pid: "head", node.pid: "node"}, launches)
        watch.start()
        t0 = time.perf_counter()
        try:
            assert main([*SO_TINY_2, "--backend", "flower", "--ray-address", address, "--client-cpus", "1",
                         "--out", str(flower_dir)]) == 0, capsys.readouterr().err[-3000:]
        finally:
            watch.stop.set()
            watch.join()
        flower = json.loads(capsys.readouterr().out)
        flower_s = time.perf_counter() - t0
        _assert_nothing_left(launches)

        # the clients ran on the cluster: an actor on each node (its worker log in that node's temp
        # dir), each seen executing ClientAppActor.run; the launch started no Ray of its own
        for name in ("h", "n"):
            logs = list((root / name).glob("session_*/logs/worker-*.out"))
            assert any(":actor_name:ClientAppActor" in p.read_text(errors="replace") for p in logs), name
        assert set(watch.ran) == {"head", "node"}, watch.ran
        assert watch.own_ray == set()

        assert main([*SO_TINY_2, "--backend", "inprocess", "--out", str(local_dir)]) == 0
        local = json.loads(capsys.readouterr().out)
        a = torch.load(flower_dir / "final-model.pt", weights_only=True)
        b = torch.load(local_dir / "final-model.pt", weights_only=True)
        assert a.keys() == b.keys() and a
        for name in a:
            assert torch.equal(a[name], b[name]), name
        for key in ("rounds_done", "stopped", "epsilon", "accuracy", "run_id"):
            assert flower[key] == local[key], key
        assert [h["contributed"] for h in flower["history"]] == [h["contributed"] for h in local["history"]] == [8, 8]
        print(f"cluster up {cluster_s:.1f} s, flower on it {flower_s:.1f} s, "
              f"with the in-process run {time.perf_counter() - started:.1f} s")
    finally:
        t_stop = time.perf_counter()
        try:
            _stop_nodes(tracker)
            print(f"cluster stopped in {time.perf_counter() - t_stop:.1f} s")
        finally:
            left = [p for p in supervisor._all_pids() if str(root) in supervisor._cmdline(p)]
            shutil.rmtree(root, ignore_errors=True)
        assert left == [], [supervisor._cmdline(p)[:120] for p in left]
