"""Run this Flower app on the Flower simulation engine (Ray) from Python, with no process left behind.

    from launcher.flower_cli import app_dir, run_simulation
    result = run_simulation(app_dir(), num_supernodes=40, run_config={...}, echo=sys.stderr)
    result.rc          # 0 only if `flwr run` exited 0 AND the run finished "finished:completed"

This module runs Flower's executables (``flower-superlink``, ``flwr``) and never imports ``flwr``, so
that ``fedmf simulate --backend flower`` (:mod:`launcher.flower_backend`) loads no Flower (the engine
package ``fedmf`` never imports Flower, nor this package). It is also the shared core of the test
harness (tests/flower_harness.py).

Recipe (flwr 1.42.0, verified):

* Every Flower process gets a private ``FLWR_HOME`` (never inside the app dir: the FAB is built from the
  app directory on disk), ``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``,
  ``RAY_USAGE_STATS_ENABLED=0`` and ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (without it the
  SuperLink's SuperExec ``uv sync``s the app's ``[project].dependencies`` -- another torch -- into
  ``$FLWR_HOME/runtime-envs/<run>``).
* Simulation: our own ``flower-superlink --simulation --insecure --disable-runtime-dependency-installation
  --host 127.0.0.1 --port P`` on a free loopback port, a ``config.toml`` connection ``[superlink.sim]
  address="127.0.0.1:P" insecure=true``, then ``flwr run <app> sim --stream --federation-config
  "num-supernodes=N client-resources-num-cpus=1" --run-config <file.toml>``.
* Ray: the SuperLink's environment carries ``RAY_ADDRESS`` (``local``: a fresh local Ray; or an existing
  cluster's ``HOST:PORT``), which the simulation engine's ``ray.init()`` reads (:mod:`launcher.ray_cluster`).
* ``flwr run`` exits 0 even when the ServerApp raised; the run's real outcome is
  ``flwr ls <conn> --run-id ID --format json`` -> ``runs[0].status`` (``finished:completed`` /
  ``finished:failed`` / ``finished:stopped``) and ``status-details``; :class:`FlowerResult` folds it in.
* Every process started here runs under :class:`launcher.processes.ProcessTracker` (tagged, all
  killed and verified gone on every exit path: :mod:`launcher.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from .processes import TAG_VAR, ProcessTracker, sigterm_raises, strip_ansi
from .ray_cluster import client_resources, ray_environment

__all__ = [
    "AppDirError",
    "FlowerResult",
    "app_dir",
    "flower_env",
    "flwr_run",
    "free_port",
    "run_simulation",
    "superlink_argv",
    "write_config_toml",
]

_RUN_ID = re.compile(r"Successfully started run (\d+)")
_BIN = Path(sys.executable).parent


def _exe(name: str) -> str:
    """The Flower console script next to this interpreter (falls back to PATH)."""
    p = _BIN / name
    return str(p) if p.exists() else name


# ----------------------------------------------------------------------------------------------
# the app directory
# ----------------------------------------------------------------------------------------------


class AppDirError(RuntimeError):
    """The Flower app's source tree is not where the installed ``launcher`` package says."""


def app_dir() -> Path:
    """The Flower app: the directory holding a ``pyproject.toml`` with ``[tool.flwr.app]`` just above the
    installed ``launcher`` package (the source tree of an editable install). :class:`AppDirError` (one
    line) when fedmf was installed without its source tree."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    try:
        with open(pyproject, "rb") as f:
            flwr_app = tomllib.load(f).get("tool", {}).get("flwr", {}).get("app")
    except (OSError, tomllib.TOMLDecodeError):
        flwr_app = None
    if not isinstance(flwr_app, dict):
        raise AppDirError(f"the Flower app's source tree is not installed: no pyproject.toml with [tool.flwr.app] "
                          f"in {str(root)!r} above the launcher package (install fedmf from its source tree, "
                          f"pip install -e <checkout>)")
    return root


# ----------------------------------------------------------------------------------------------
# ports, env, config.toml
# ----------------------------------------------------------------------------------------------

_handed_out: set[int] = set()
_port_lock = threading.Lock()


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (never the same one twice in this process)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _port_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("no free port found")


def write_config_toml(flwr_home: Path | str, connections: Mapping[str, str], default: str | None = None) -> Path:
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


def flower_env(work_dir: Path | str, *, tag: str | None = None, base: Mapping[str, str] | None = None) -> dict:
    """Environment for every Flower process of one launch: private ``FLWR_HOME=<work_dir>/flwr-home``
    (with a ``config.toml``), telemetry / update check / Ray usage stats / runtime dependency installation
    off, private ports for the CLI-managed local SuperLink (so parallel launches never share one), and a
    unique :data:`TAG_VAR`."""
    home = Path(work_dir) / "flwr-home"
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
# results
# ----------------------------------------------------------------------------------------------


@dataclass
class FlowerResult:
    """Outcome of one ``flwr run``: ``rc`` is 0 only if ``flwr run`` exited 0 AND the run finished
    ``finished:completed`` (124 on timeout); ``flwr_rc`` is the raw CLI exit code (0 even when the
    ServerApp failed)."""

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

    def failure(self) -> str:
        """One line saying why the run failed ("" when it did not)."""
        if self.rc == 0:
            return ""
        if self.timed_out:
            return f"the Flower run did not finish within {self.duration_s:.0f} s"
        if self.run_id is None:
            tail = [ln.strip() for ln in self.output.splitlines() if ln.strip()]
            return f"flwr run started no run (exit {self.flwr_rc})" + (f": {tail[-1][:300]}" if tail else "")
        details = " ".join(str(self.status_details or "").split())
        return (f"Flower run {self.run_id} ended {self.status or 'with an unknown status'}"
                + (f": {details}" if details else "") + (f" (flwr run exit {self.flwr_rc})" if self.flwr_rc else ""))

    def check(self) -> FlowerResult:
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
    import tomli_w  # a dependency of flwr (not flwr itself)

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
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            info = json.loads(out[out.index("{"):])["runs"][0]
        if str(info.get("status", "")).startswith("finished") or time.monotonic() > end:
            return info
        time.sleep(0.5)


def flwr_run(tracker: ProcessTracker, app: Path | str, connection: str, *, run_config: Mapping | None,
             federation_config: Mapping | None, timeout: float, stream: bool = True, wait_finished: float = 30.0,
             echo: TextIO | None = None) -> FlowerResult:
    """``flwr run <app> <connection> [--stream]`` under ``tracker``, then the run's real status."""
    argv = [_exe("flwr"), "run", str(Path(app).resolve()), connection]
    if stream:
        argv.append("--stream")
    argv += _federation_args(federation_config)
    argv += _write_run_config(tracker.log_dir / f"run-config-{uuid.uuid4().hex[:8]}.toml", run_config)
    t0 = time.monotonic()
    flwr_rc, out, err, timed_out = tracker.run(argv, timeout=timeout, echo=echo)
    out, err = strip_ansi(out), strip_ansi(err)
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


def wait_http_health(port: int, proc: subprocess.Popen, timeout: float, log: str = "") -> None:
    """Wait until the SuperLink on ``127.0.0.1:port`` answers ``/health`` (RuntimeError if it exits)."""
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


def superlink_argv(port: int, database: Path | None, *, simulation: bool, extra: Iterable[str] = ()) -> list[str]:
    """``flower-superlink --insecure --disable-runtime-dependency-installation`` on ``127.0.0.1:port``."""
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


def run_simulation(app: Path | str, *, num_supernodes: int, run_config: Mapping | None = None,
                   timeout: float = 300, tmp_path: Path | str | None = None, client_num_cpus: int = 1,
                   client_num_gpus: float | None = None, ray_address: str | None = None,
                   federation_config: Mapping | None = None, env: Mapping[str, str] | None = None,
                   echo: TextIO | None = None, ready_timeout: float = 60) -> FlowerResult:
    """``flwr run <app> sim --stream`` on the simulation engine (Ray) against a private ``--simulation``
    SuperLink on a free loopback port that never installs dependencies; every process started is killed
    (and verified gone) before returning -- on success, failure, timeout, KeyboardInterrupt or SIGTERM.

    ``run_config``: the run's configuration (written to a TOML file, ``--run-config <file>``).
    ``client_num_cpus=1`` lets two ClientApp actors run on a 2-core box (Flower's default is 2 CPUs per
    actor -> one actor); ``client_num_gpus`` is each actor's fraction of a GPU (None: none).
    ``ray_address``: the GCS ``HOST:PORT`` of an existing Ray cluster to run the ClientApp actors on
    (None: a fresh local Ray; :mod:`launcher.ray_cluster`). ``tmp_path``: where ``FLWR_HOME`` and the
    logs go (default: a temporary directory, removed afterwards). ``env``: a :func:`flower_env`
    environment (default: a new one).
    ``echo``: a text stream that gets the run's output (ServerApp logs) line by line as it comes.
    Raises :class:`LeftoverProcessesError` if teardown fails."""
    own_tmp = None
    if tmp_path is None:
        own_tmp = tempfile.mkdtemp(prefix="fedmf-flwr-")
        tmp_path = own_tmp
    tmp_path = Path(tmp_path)
    res = None
    tracker = None
    try:
        env = dict(env) if env is not None else flower_env(tmp_path)
        env.update(ray_environment(ray_address))  # inherited by the SuperExec's flwr-simulation
        home = Path(env["FLWR_HOME"])
        tracker = ProcessTracker(env, tmp_path / "flwr-logs")
        fed = {"num-supernodes": int(num_supernodes), **client_resources(client_num_cpus, client_num_gpus)}
        fed.update(federation_config or {})
        with sigterm_raises():
            port = free_port()
            write_config_toml(home, {"sim": f"127.0.0.1:{port}"}, default="sim")
            link = tracker.spawn("superlink", superlink_argv(port, home / "sim-state.db", simulation=True))
            wait_http_health(port, link, ready_timeout, str(tracker.logs["superlink"]))
            res = flwr_run(tracker, Path(app), "sim", run_config=run_config, federation_config=fed,
                           timeout=timeout, echo=echo)
            res.logs["superlink"] = tracker.log_text("superlink")
        return res
    finally:
        try:
            if tracker is not None:
                tracker.cleanup()
                if res is not None:
                    res.pids_seen = set(tracker.seen)
        finally:
            if own_tmp is not None:
                shutil.rmtree(own_tmp, ignore_errors=True)
