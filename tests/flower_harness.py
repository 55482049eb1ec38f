"""Run a Flower 1.42 app on loopback from tests: simulation and deployment, no leftover processes.

The shared parts (environment, ports, ``config.toml``, process tracking and teardown, ``flwr run`` with
the run's real status, simulation) live in ``launcher/processes.py`` (the supervisor) and
``launcher/flower_cli.py`` (Flower's executables; production: ``fedmf simulate --backend flower``); this
module re-exports them and adds :class:`Deployment` (SuperLink + SuperNodes as processes).

Verified recipe (flwr 1.42.0, Python 3.11, this repo):

* Every Flower process gets ``FLWR_HOME=<tmp>`` (never inside the app dir: the FAB is built from the app
  directory on disk), ``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``,
  ``RAY_USAGE_STATS_ENABLED=0`` and ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (read by
  ``flower-superlink``; without it the SuperLink's SuperExec gets ``--allow-runtime-dependency-installation``
  and ``uv sync``s the app's ``[project].dependencies`` -- torch==2.13.0 -- into
  ``$FLWR_HOME/runtime-envs/<run>``).
* Simulation: our own ``flower-superlink --simulation --insecure --disable-runtime-dependency-installation
  --host 127.0.0.1 --port P`` + a ``config.toml`` connection ``[superlink.sim] address="127.0.0.1:P"
  insecure=true`` + ``flwr run <app> sim --stream --federation-config "num-supernodes=N
  client-resources-num-cpus=1" --run-config <file.toml>``.
* Deployment: ``flower-superlink --insecure --disable-runtime-dependency-installation --database <db>
  --host 127.0.0.1 --port P`` + N x ``flower-supernode --insecure --superlink 127.0.0.1:P --port Q_i
  --node-config 'k=v ...'`` + ``flwr run <app> deploy --stream``.
* ``flwr run`` exits 0 even when the ServerApp raised; the run's real outcome is
  ``flwr ls <conn> --run-id ID --format json`` -> ``runs[0].status`` (``finished:completed`` /
  ``finished:failed`` / ``finished:stopped``) and ``status-details``. :class:`FlowerResult` folds that in.
* Flower starts its helpers detached (``flower-superexec`` in a new session, re-parented to PID 1 when
  its parent dies; ``flwr-serverapp`` / ``flwr-simulation`` / ``flwr-clientapp`` / Ray below it), so a
  process group is not enough. Every process started here carries a unique environment tag
  (``launcher.processes.TAG_VAR``) that all descendants inherit; teardown finds them through
  ``/proc/<pid>/environ`` (plus the parent-pid tree of what we started), SIGTERMs them (and the process
  groups we created), SIGKILLs survivors after a grace period, and raises if any is still alive.
  Zombies are dead processes (PID 1 here does not always reap them) and are ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from launcher.flower_cli import (
    FlowerResult,
    _exe,
    _run_info,
    flower_env,
    flwr_run,
    free_port,
    run_simulation,
    superlink_argv,
    wait_http_health,
    write_config_toml,
)
from launcher.processes import (
    TAG_VAR,
    LeftoverProcessesError,
    ProcessTracker,
    _cmdline,
    pid_alive,
    strip_ansi,
    tagged_pids,
)

__all__ = [
    "TAG_VAR",
    "Deployment",
    "enrolled_users",
    "FlowerResult",
    "LeftoverProcessesError",
    "ProcessTracker",
    "flower_env",
    "free_port",
    "pid_alive",
    "run_simulation",
    "tagged_pids",
    "write_config_toml",
]

_flwr_run = flwr_run
_superlink_argv = superlink_argv
_wait_http_health = wait_http_health


# ----------------------------------------------------------------------------------------------
# deployment
# ----------------------------------------------------------------------------------------------


def enrolled_users(directory: Path | str, users: Iterable[str]) -> tuple[Path, list[dict]]:
    """A key pair per user in ``directory`` and the enrollment file of their public keys (what
    ``fedmf user keygen`` / ``enroll`` make); returns the enrollment file and one SuperNode
    ``node_config`` per user (``user-id`` and ``user-key``)."""
    from fedmf.enrollment import Enrollment, generate_key_pair

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    users = [str(u) for u in users]
    keys = {u: directory / f"user-{u}.key" for u in users}
    Enrollment({u: generate_key_pair(keys[u]) for u in users}).save(directory / "enrollment.json")
    return directory / "enrollment.json", [{"user-id": u, "user-key": str(keys[u])} for u in users]


def _node_config_arg(cfg: Mapping) -> str:
    parts = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, str):
            v = json.dumps(v)
        parts.append(f"{k}={v}")
    return " ".join(parts)


class Deployment:
    """SuperLink + one SuperNode per ``node_configs`` entry on free loopback ports.

    >>> with Deployment(tmp_path, [{"user-id": 0}, {"user-id": 1}]) as d:
    ...     res = d.run(app_dir, {"num-server-rounds": 2}, timeout=300).check()

    On exit every process started (SuperLink, SuperNodes, their SuperExecs, ServerApp/ClientApp
    subprocesses, ``flwr`` CLI calls) is killed and verified gone (``LeftoverProcessesError`` otherwise).
    ``supernode_isolation="subprocess"`` (Flower's default) starts a fresh ``flwr-clientapp`` per message.
    """

    CONNECTION = "deploy"

    def __init__(self, tmp_path: Path | str, node_configs: list[Mapping], *, ready_timeout: float = 90,
                 env: Mapping[str, str] | None = None, superlink_args: Iterable[str] = (),
                 supernode_args: Iterable[str] = ()):
        self.tmp_path = Path(tmp_path)
        self.node_configs = [dict(c) for c in node_configs]
        self.ready_timeout = ready_timeout
        self.env = dict(env) if env is not None else flower_env(self.tmp_path)
        self.home = Path(self.env["FLWR_HOME"])
        self.tracker = ProcessTracker(self.env, self.tmp_path / "flwr-logs")
        self.superlink_args = list(superlink_args)
        self.supernode_args = list(supernode_args)
        self.port: int | None = None
        self.node_ports: list[int] = []
        self.superlink: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen] = []
        self.startup_s: float = 0.0

    # -- lifecycle --
    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        t0 = time.monotonic()
        self.port = free_port()
        write_config_toml(self.home, {self.CONNECTION: f"127.0.0.1:{self.port}"}, default=self.CONNECTION)
        self.superlink = self.tracker.spawn(
            "superlink", _superlink_argv(self.port, self.home / "state.db", simulation=False, extra=self.superlink_args))
        _wait_http_health(self.port, self.superlink, self.ready_timeout, str(self.tracker.logs["superlink"]))
        for i, cfg in enumerate(self.node_configs):
            self.start_supernode(cfg, name=f"supernode{i}")
        self.wait_nodes(len(self.node_configs), timeout=self.ready_timeout)
        self.startup_s = time.monotonic() - t0

    def start_supernode(self, node_config: Mapping, name: str | None = None) -> subprocess.Popen:
        port = free_port()
        self.node_ports.append(port)
        argv = [_exe("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                "--port", str(port), *self.supernode_args]
        if node_config:
            argv += ["--node-config", _node_config_arg(node_config)]
        proc = self.tracker.spawn(name or f"supernode{len(self.supernodes)}", argv)
        self.supernodes.append(proc)
        return proc

    def close(self) -> None:
        self.tracker.cleanup()

    # -- queries --
    def nodes(self) -> list[dict]:
        """``flwr supernode ls deploy --format json`` -> list of node dicts (``node-id``, ``status`` ...)."""
        rc, out, err, _ = self.tracker.run(
            [_exe("flwr"), "supernode", "ls", self.CONNECTION, "--format", "json"], timeout=30)
        try:
            return list(json.loads(out[out.index("{"):]).get("nodes", []))
        except ValueError:
            return []

    def wait_nodes(self, n: int, timeout: float = 60) -> list[dict]:
        """Wait until ``n`` SuperNodes are registered and online (about 5 s after start here)."""
        end = time.monotonic() + timeout
        while True:
            for i, p in enumerate(self.supernodes):
                if p.poll() is not None:
                    raise RuntimeError(f"supernode{i} exited with {p.returncode}: {self.tracker.log_text(f'supernode{i}')[-2000:]}")
            online = [x for x in self.nodes() if x.get("status") == "online"]
            if len(online) >= n:
                return online
            if time.monotonic() > end:
                raise TimeoutError(f"only {len(online)}/{n} SuperNodes online after {timeout}s")
            time.sleep(0.3)

    def log(self, name: str) -> str:
        """Text of a process log: ``superlink``, ``supernode0`` ... (ClientApp prints land in SuperNode logs)."""
        return self.tracker.log_text(name)

    def pids(self) -> list[int]:
        return self.tracker.live_pids()

    # -- runs --
    def run(self, app_dir: Path | str, run_config: Mapping | None = None, timeout: float = 300) -> FlowerResult:
        """``flwr run <app_dir> deploy --stream``; waits for the run to finish."""
        res = _flwr_run(self.tracker, Path(app_dir), self.CONNECTION, run_config=run_config, federation_config=None,
                        timeout=timeout)
        res.logs = {name: self.tracker.log_text(name) for name in self.tracker.logs}
        self.tracker.live_pids()
        res.pids_seen = set(self.tracker.seen)
        return res

    def start_run(self, app_dir: Path | str, run_config: Mapping | None = None) -> int:
        """Submit a run without streaming; returns its run id."""
        res = _flwr_run(self.tracker, Path(app_dir), self.CONNECTION, run_config=run_config, federation_config=None,
                        timeout=60, stream=False, wait_finished=0.0)
        if res.run_id is None:
            raise RuntimeError(f"flwr run did not start a run:\n{res.output}")
        return res.run_id

    def run_info(self, run_id: int, wait_finished: float = 0.0) -> dict:
        return _run_info(self.tracker, self.CONNECTION, run_id, timeout=wait_finished)

    def serverapp_pids(self) -> list[int]:
        """Live ``flwr-serverapp`` processes of this deployment (found through the harness tag)."""
        return [p for p in self.tracker.live_pids()
                if any(os.path.basename(a) == "flwr-serverapp" for a in _cmdline(p).split()[:2])]

    def kill_serverapp(self, timeout: float = 60, sig: int = signal.SIGKILL) -> list[int]:
        """Wait until a ServerApp process exists, then kill it (simulates a server crash mid-run)."""
        end = time.monotonic() + timeout
        while not (pids := self.serverapp_pids()):
            if time.monotonic() > end:
                raise TimeoutError("no flwr-serverapp process appeared")
            time.sleep(0.1)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        return pids

    def stop_run(self, run_id: int) -> tuple[int, str]:
        """``flwr stop <run_id> deploy``."""
        rc, out, err, _ = self.tracker.run([_exe("flwr"), "stop", str(run_id), self.CONNECTION], timeout=60)
        return rc, strip_ansi(out + err)

    def kill_supernode(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.supernodes[i]
        self.tracker._kill_tree([p.pid], grace=0 if sig == signal.SIGKILL else 5.0)
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
