"""A Linux process supervisor: start processes tagged so that none is left behind, and take them all
down (used by :mod:`launcher.flower_cli` for Flower's processes, and by the test harness).

Flower starts its helpers detached (``flower-superexec`` in a new session, re-parented to PID 1 when its
parent dies; ``flwr-serverapp`` / ``flwr-simulation`` / ``flwr-clientapp`` / Ray below it), so a process
group is not enough. Every process started here carries a unique environment tag (:data:`TAG_VAR`) that
all descendants inherit; teardown finds them through ``/proc/<pid>/environ`` (plus the parent-pid tree
of what we started), SIGTERMs them (and the process groups we created), SIGKILLs survivors after a grace
period, and raises :class:`LeftoverProcessesError` if any is still alive. Teardown runs on every exit
path, KeyboardInterrupt and SIGTERM of the caller included (SIGINT is ignored while it runs, so a second
Ctrl-C cannot cut it short; :func:`sigterm_raises` turns the caller's SIGTERM into SystemExit). Zombies
are dead and ignored. Nothing here knows Flower.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TextIO

__all__ = [
    "TAG_VAR",
    "LeftoverProcessesError",
    "ProcessTracker",
    "pid_alive",
    "sigterm_raises",
    "strip_ansi",
    "tagged_pids",
]

#: the environment variable whose unique value marks every process a launch started (inherited by all
#: descendants, however detached)
TAG_VAR = "FEDMF_FLWR_LAUNCHER_TAG"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without its terminal escape sequences (colours)."""
    return _ANSI.sub("", text)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
        return data[data.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def _ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (ValueError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def tagged_pids(tag: str, var: str = TAG_VAR) -> list[int]:
    """Live PIDs (other than this one) whose environment carries ``var=tag``."""
    needle = f"{var}={tag}".encode()
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
    """Raised when teardown could not kill every process a launch started."""


@contextlib.contextmanager
def _no_interrupts():
    """Ignore SIGINT (and SIGTERM) while cleaning up, when we are the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def sigterm_raises():
    """While launching from the main thread, SIGTERM raises SystemExit(143) so that teardown still runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    saved = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)


class _Echo:
    """Copies what a command appends to its output files to a text stream (no pipes: a chatty child
    can never block on a full one)."""

    def __init__(self, paths: list[Path], sink: TextIO | None):
        self.sink, self.offsets = sink, {p: 0 for p in paths}

    def pump(self) -> None:
        if self.sink is None:
            return
        for path, offset in self.offsets.items():
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            if data:
                cut = data.rfind(b"\n") + 1  # whole lines only (the rest comes with the next pump)
                if cut:
                    self.offsets[path] = offset + cut
                    self._write(data[:cut])

    def flush_all(self) -> None:
        self.pump()
        if self.sink is None:
            return
        for path, offset in self.offsets.items():
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(offset)
                rest = f.read()
                if rest:
                    self.offsets[path] = offset + len(rest)
                    self._write(rest + b"\n")

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(Exception):
            self.sink.write(_ANSI.sub("", data.decode(errors="replace")))
            self.sink.flush()


class ProcessTracker:
    """Starts processes in new sessions with a shared env tag; ``cleanup()`` kills them all."""

    def __init__(self, env: Mapping[str, str], log_dir: Path | str, tag_var: str = TAG_VAR):
        self.env = dict(env)
        self.tag_var = tag_var
        self.tag = self.env[tag_var]
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

    def run(self, argv: list[str], *, timeout: float, cwd: Path | str | None = None, echo: TextIO | None = None):
        """Run a command to completion (own session, tagged); kill its whole tree on timeout.

        Returns ``(returncode, stdout, stderr, timed_out)``; stdout/stderr go through files (copied
        line by line to ``echo`` while it runs, if given)."""
        n = len(self.procs)
        out, err = self.log_dir / f"cmd{n}.out", self.log_dir / f"cmd{n}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(argv, env=self.env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                    start_new_session=True)
            self.procs.append(proc)
        tee = _Echo([out, err], echo)
        timed_out = False
        end = time.monotonic() + timeout
        last_scan = 0.0
        while True:
            try:
                proc.wait(timeout=min(0.25 if echo is not None else 1.0, max(0.0, end - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                tee.pump()
                if time.monotonic() >= end:
                    timed_out = True
                    self._kill_tree([proc.pid], grace=2.0)
                    proc.wait()
                    break
                if time.monotonic() - last_scan >= 1.0:
                    last_scan = time.monotonic()
                    self.live_pids()  # records PIDs (Ray, ServerApp, ClientApps) for leak checks
        tee.flush_all()
        return proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"), timed_out

    def live_pids(self) -> list[int]:
        """Every live process this tracker is responsible for (tagged, or below one we started)."""
        mine = {p.pid for p in self.procs if pid_alive(p.pid)}
        mine |= set(tagged_pids(self.tag, self.tag_var))
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
        """SIGTERM everything (process groups first), SIGKILL after ``grace``; raise
        :class:`LeftoverProcessesError` if anything survives. SIGINT/SIGTERM are ignored meanwhile."""
        with _no_interrupts():
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
