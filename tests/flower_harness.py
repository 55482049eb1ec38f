"""Run a Flower 1.41 app on loopback from tests: simulation and deployment, no leftover processes.

Verified recipe (flwr 1.41.0, Python 3.11, this repo):

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
  (``FEDMF_FLWR_HARNESS_TAG``) that all descendants inherit; teardown finds them through
  ``/proc/<pid>/environ`` (plus the parent-pid tree of what we started), SIGTERMs them (and the process
  groups we created), SIGKILLs survivors after a grace period, and raises if any is still alive.
  Zombies are dead processes (PID 1 here does not always reap them) and are ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

__all__ = [
    "TAG_VAR",
    "Deployment",
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

TAG_VAR = "FEDMF_FLWR_HARNESS_TAG"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RUN_ID = re.compile(r"Successfully started run (\d+)")
_BIN = Path(sys.executable).parent


def _exe(name: str) -> str:
    """The Flower console script next to this interpreter (falls back to PATH)."""
    p = _BIN / name
    return str(p) if p.exists() else name


# ----------------------------------------------------------------------------------------------
# ports, env, config.toml
# ----------------------------------------------------------------------------------------------

_handed_out: set[int] = set()


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (never the same one twice in this process)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port found")


def write_config_toml(flwr_home: Path, connections: Mapping[str, str], default: str | None = None) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with insecure loopback connections ``{name: "host:port"}``.

    ``default`` (else the first name) becomes ``[superlink] default``. The ``local`` connection
    (``:local:``, the CLI-managed SuperLink) is always kept so the file matches Flower's own layout.
    """
    names = list(connections)
    lines = ["[superlink]", f'default = "{default or (names[0] if names else "local")}"', ""]
    lines += ["[superlink.local]", 'address = ":local:"', ""]
    for name, address in connections.items():
        lines += [f"[superlink.{name}]", f'address = "{address}"', "insecure = true", ""]
    path = Path(flwr_home) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def flower_env(tmp_path: Path | str, *, tag: str | None = None, base: Mapping[str, str] | None = None) -> dict:
    """Environment for every Flower process of one test: private FLWR_HOME (with a ``config.toml``),
    telemetry / update check / Ray usage stats / runtime dependency installation off, private ports
    for the CLI-managed local SuperLink (so parallel tests never share one), and the harness tag."""
    home = Path(tmp_path) / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if base is None else base)
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        RAY_USAGE_STATS_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
        NO_COLOR="1",
    )
    env[TAG_VAR] = tag or uuid.uuid4().hex
    if not (home / "config.toml").exists():
        write_config_toml(home, {})
    return env


# ----------------------------------------------------------------------------------------------
# process bookkeeping through /proc
# ----------------------------------------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return data[data.rindex(")") + 2 :].split()[0]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
        return int(data[data.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    state = _proc_state(pid)
    return state is not None and state not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def tagged_pids(tag: str) -> list[int]:
    """Live PIDs whose environment carries ``TAG_VAR=tag`` (inherited by every descendant)."""
    needle = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    out = []
    for pid in _all_pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and pid_alive(pid):
            out.append(pid)
    return out


def _descendants(roots: Iterable[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        pp = _ppid(pid)
        if pp is not None:
            children.setdefault(pp, []).append(pid)
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        p = stack.pop()
        for c in children.get(p, []):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class LeftoverProcessesError(RuntimeError):
    """Raised when teardown could not kill every process the harness started."""


class ProcessTracker:
    """Starts processes in new sessions with a shared env tag; ``cleanup()`` kills them all."""

    def __init__(self, env: Mapping[str, str], log_dir: Path | str):
        self.env = dict(env)
        self.tag = self.env[TAG_VAR]
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}
        self.seen: set[int] = set()  # every PID ever found alive under this tracker (for leak checks)

    def spawn(self, name: str, argv: list[str], *, cwd: Path | str | None = None) -> subprocess.Popen:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                argv, env=self.env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.logs[name] = log
        return proc

    def run(self, argv: list[str], *, timeout: float, cwd: Path | str | None = None):
        """Run a command to completion (own session, tagged); kill its whole tree on timeout.

        Returns ``(returncode, stdout, stderr, timed_out)``; stdout/stderr go through files so a
        chatty child can never block on a full pipe."""
        n = len(self.procs)
        out, err = self.log_dir / f"cmd{n}.out", self.log_dir / f"cmd{n}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(argv, env=self.env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                    start_new_session=True)
            self.procs.append(proc)
            timed_out = False
            end = time.monotonic() + timeout
            while True:
                try:
                    proc.wait(timeout=min(1.0, max(0.0, end - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= end:
                        timed_out = True
                        self._kill_tree([proc.pid], grace=2.0)
                        proc.wait()
                        break
                    self.live_pids()  # records PIDs (Ray, ServerApp, ClientApps) for leak checks
        return proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"), timed_out

    def live_pids(self) -> list[int]:
        """Every live process this tracker is responsible for (tagged, or below one we started)."""
        mine = {p.pid for p in self.procs if pid_alive(p.pid)}
        mine |= set(tagged_pids(self.tag))
        mine |= {d for d in _descendants([p.pid for p in self.procs]) if pid_alive(d)}
        mine.discard(os.getpid())
        self.seen |= mine
        return sorted(mine)

    def _signal(self, pids: Iterable[int], sig: int) -> None:
        own_pgrp = os.getpgrp()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                pgid = os.getpgid(pid)
                if pgid == pid and pgid != own_pgrp:  # a session/group leader we may take down whole
                    os.killpg(pgid, sig)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _kill_tree(self, roots: list[int], grace: float) -> None:
        pids = set(roots) | _descendants(roots)
        self._signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        self._signal([p for p in pids if pid_alive(p)], signal.SIGKILL)

    def cleanup(self, grace: float = 5.0, verify_timeout: float = 15.0) -> None:
        """SIGTERM everything (process groups first), SIGKILL after ``grace``; raise if anything survives."""
        deadline = time.monotonic() + grace
        pids = self.live_pids()
        if pids:
            self._signal(pids, signal.SIGTERM)
        while time.monotonic() < deadline:
            pids = self.live_pids()  # re-scan: dying parents may have spawned / orphaned children
            if not pids:
                break
            time.sleep(0.2)
        end = time.monotonic() + verify_timeout
        while True:
            pids = self.live_pids()
            if not pids:
                break
            self._signal(pids, signal.SIGKILL)
            if time.monotonic() > end:
                break
            time.sleep(0.2)
        for p in self.procs:  # reap our direct children
            with contextlib.suppress(Exception):
                p.wait(timeout=1)
        left = self.live_pids()
        if left:
            desc = "; ".join(f"{p}: {_cmdline(p)[:120]}" for p in left)
            raise LeftoverProcessesError(f"processes survived teardown: {desc}")

    def log_text(self, name: str) -> str:
        p = self.logs.get(name)
        return _ANSI.sub("", p.read_text(errors="replace")) if p and p.exists() else ""


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------


@dataclass
class FlowerResult:
    """Outcome of one ``flwr run``: ``rc`` is 0 only if ``flwr run`` exited 0 AND the run finished
    ``finished:completed``; ``flwr_rc`` is the raw CLI exit code (0 even when the ServerApp failed)."""

    args: list[str]
    rc: int
    flwr_rc: int
    stdout: str
    stderr: str
    run_id: int | None = None
    status: str | None = None
    status_details: str | None = None
    duration_s: float = 0.0
    timed_out: bool = False
    run_info: dict = field(default_factory=dict)
    logs: dict = field(default_factory=dict)  # name -> text of SuperLink / SuperNode logs
    pids_seen: set = field(default_factory=set)  # PIDs of the Flower processes seen (all gone after teardown)

    returncode = property(lambda self: self.rc)

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def check(self) -> "FlowerResult":
        if self.rc != 0:
            raise AssertionError(
                f"flower run failed: rc={self.rc} flwr_rc={self.flwr_rc} status={self.status!r} "
                f"details={self.status_details!r} timed_out={self.timed_out}\n--- output ---\n{self.output[-6000:]}"
            )
        return self

    check_returncode = check


def _write_run_config(path: Path, run_config: Mapping | None) -> list[str]:
    if not run_config:
        return []
    import tomli_w  # a flwr dependency

    path.write_text(tomli_w.dumps(dict(run_config)))
    return ["--run-config", str(path)]


def _federation_args(cfg: Mapping | None) -> list[str]:
    if not cfg:
        return []
    parts = []
    for k, v in cfg.items():
        v = ("true" if v else "false") if isinstance(v, bool) else (json.dumps(v) if isinstance(v, str) else v)
        parts.append(f"{k}={v}")
    return ["--federation-config", " ".join(parts)]


def _run_info(tracker: ProcessTracker, connection: str, run_id: int, timeout: float = 30.0) -> dict:
    """``flwr ls <connection> --run-id`` as a dict; polls until the run has finished (or timeout)."""
    info: dict = {}
    end = time.monotonic() + timeout
    while True:
        rc, out, _err, _ = tracker.run([_exe("flwr"), "ls", connection, "--run-id", str(run_id), "--format", "json"],
                                       timeout=30)
        with contextlib.suppress(ValueError, KeyError, IndexError):
            info = json.loads(out[out.index("{"):])["runs"][0]
        if str(info.get("status", "")).startswith("finished") or time.monotonic() > end:
            return info
        time.sleep(0.5)


def _flwr_run(tracker: ProcessTracker, app_dir: Path, connection: str, *, run_config, federation_config,
              timeout: float, stream: bool = True, wait_finished: float = 30.0) -> FlowerResult:
    argv = [_exe("flwr"), "run", str(Path(app_dir).resolve()), connection]
    if stream:
        argv.append("--stream")
    argv += _federation_args(federation_config)
    argv += _write_run_config(tracker.log_dir / f"run-config-{uuid.uuid4().hex[:8]}.toml", run_config)
    t0 = time.monotonic()
    flwr_rc, out, err, timed_out = tracker.run(argv, timeout=timeout)
    out, err = _ANSI.sub("", out), _ANSI.sub("", err)
    m = _RUN_ID.search(out + err)
    res = FlowerResult(args=argv, rc=flwr_rc, flwr_rc=flwr_rc, stdout=out, stderr=err, timed_out=timed_out,
                       run_id=int(m.group(1)) if m else None)
    if res.run_id is not None and not timed_out:
        res.run_info = _run_info(tracker, connection, res.run_id, timeout=wait_finished)
        res.status = res.run_info.get("status")
        res.status_details = res.run_info.get("status-details")
    res.duration_s = time.monotonic() - t0
    if timed_out:
        res.rc = 124
    elif res.rc == 0 and stream and res.status != "finished:completed":
        res.rc = 1
    return res


def _wait_http_health(port: int, proc: subprocess.Popen, timeout: float, log: str = "") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode} (log: {log})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
                if 200 <= r.status < 300:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"SuperLink on 127.0.0.1:{port} not healthy after {timeout}s (log: {log})")


def _superlink_argv(port: int, database: Path | None, *, simulation: bool, extra: Iterable[str] = ()) -> list[str]:
    argv = [_exe("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port)]
    if database is not None:
        argv += ["--database", str(database)]
    if simulation:
        argv.append("--simulation")
    return argv + list(extra)


# ----------------------------------------------------------------------------------------------
# simulation
# ----------------------------------------------------------------------------------------------


def run_simulation(app_dir: Path | str, *, num_supernodes: int, run_config: Mapping | None = None,
                   timeout: float = 300, tmp_path: Path | str | None = None, client_num_cpus: float = 1,
                   federation_config: Mapping | None = None, env: Mapping[str, str] | None = None) -> FlowerResult:
    """``flwr run <app_dir> --stream`` in simulation (Ray) against a private ``--simulation`` SuperLink
    that never installs dependencies; every process is killed before returning.

    ``client_num_cpus=1`` lets two ClientApp actors run on a 2-core box (Flower's default is 2 CPUs
    per actor -> one actor). Raises :class:`LeftoverProcessesError` if teardown fails."""
    own_tmp = None
    if tmp_path is None:
        own_tmp = tempfile.TemporaryDirectory(prefix="flwr-sim-")
        tmp_path = own_tmp.name
    tmp_path = Path(tmp_path)
    env = dict(env) if env is not None else flower_env(tmp_path)
    home = Path(env["FLWR_HOME"])
    tracker = ProcessTracker(env, tmp_path / "flwr-logs")
    fed = {"num-supernodes": int(num_supernodes), "client-resources-num-cpus": client_num_cpus}
    fed.update(federation_config or {})
    res = None
    try:
        port = free_port()
        write_config_toml(home, {"sim": f"127.0.0.1:{port}"}, default="sim")
        link = tracker.spawn("superlink", _superlink_argv(port, home / "sim-state.db", simulation=True))
        _wait_http_health(port, link, 60, str(tracker.logs["superlink"]))
        res = _flwr_run(tracker, Path(app_dir), "sim", run_config=run_config, federation_config=fed, timeout=timeout)
        res.logs["superlink"] = tracker.log_text("superlink")
        return res
    finally:
        try:
            tracker.cleanup()
            if res is not None:
                res.pids_seen = set(tracker.seen)
        finally:
            if own_tmp is not None:
                own_tmp.cleanup()


# ----------------------------------------------------------------------------------------------
# deployment
# ----------------------------------------------------------------------------------------------


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
    def __enter__(self) -> "Deployment":
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
        return rc, _ANSI.sub("", out + err)

    def kill_supernode(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.supernodes[i]
        self.tracker._kill_tree([p.pid], grace=0 if sig == signal.SIGKILL else 5.0)
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
