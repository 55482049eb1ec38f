"""Fault injection for tests/run/test_faults.py: the ServerApp code path (``server.app.run_server``
over a ``LocalGrid`` of real ClientApps) with a recorder of everything the server releases, and
test-only kill points inside operations (monkeypatched in the child process only).

Run as a script: ``python tests/_fault_script.py VALUES_JSON LOG [KILL]`` runs (or resumes) the
run described by the run configuration VALUES_JSON, appends one JSON line per release to LOG and,
if KILL is given, SIGKILLs itself at that point (``KILL_POINTS``).

What is recorded (each line written with one ``write`` before the next step, so it survives a
SIGKILL): ``train`` — the model broadcast in round t's TRAIN messages (its SHA-256, the users and
nodes, and the ledger status of round t-1 at that moment); ``evaluate`` — the model the task
evaluated after round t (and the ledger status of round t then).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: kill points inside operations (``NAME:ROUND``; ``event:EVENT:ROUND`` uses the server's FEDMF_KILL_AT)
KILL_POINTS = ("checkpoint-temp", "noise-write", "checkpoint-dirsync", "ledger-commit", "evaluate", "query",
               "after-select", "final-write")


def die() -> None:
    """SIGKILL this process (what a crash, an OOM kill or a power cut looks like to the files)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def state_sha(state: Mapping[str, Any]) -> str:
    """A SHA-256 of a state dict's names, dtypes, shapes and bytes: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def round_status(run_dir: str | os.PathLike, t: int) -> str | None:
    """Round t's status (open, aborted, committed; None: planned) in the run directory's SQLite ledger, read
    by a separate connection."""
    db = Path(run_dir) / "ledger.db"
    if not db.exists():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        row = con.execute("SELECT status FROM round_state WHERE round_index = ? ORDER BY run_id DESC LIMIT 1",
                          (t,)).fetchone()
    finally:
        con.close()
    return row[0] if row else None


def last_committed(run_dir: str | os.PathLike) -> int | None:
    """The last committed round in the run directory's SQLite ledger (None: none), read by a separate
    connection (through ``round_status``, which a test may point at another ledger)."""
    t = -1
    while round_status(run_dir, t + 1) == "committed":
        t += 1
    return None if t < 0 else t


class Recorder:
    """Collects what the server released (in memory and, if ``log`` is given, appended to it)."""

    def __init__(self, run_dir: str | os.PathLike, log: str | os.PathLike | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.log = None if log is None else Path(log)
        self.records: list[dict[str, Any]] = []
        self.round: int | None = None  # the round whose TRAIN messages went out last
        self.kill_evaluate: int | None = None

    def write(self, **record: Any) -> None:
        self.records.append(record)
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)

    def evaluate_hook(self, original: Callable) -> Callable:
        """A replacement for ``Task.evaluate`` that records the model evaluated after a round
        (and dies inside it at ``kill_evaluate``)."""
        recorder = self

        def evaluate(task, model):
            t = recorder.round
            if t is None and last_committed(recorder.run_dir) is None:  # the initial model's held-out loss
                recorder.write(kind="initial", round=None, sha=state_sha(model.state_dict()))  # (fedmf.run.learning_check)
                return original(task, model)
            if t is None:  # before any broadcast of this process: a resume evaluating the last committed round
                t = last_committed(recorder.run_dir)  # (a record a stop cut off: fedmf.run.loop.recover_records)
            recorder.write(kind="evaluate", round=t, sha=state_sha(model.state_dict()),
                           status=round_status(recorder.run_dir, t))
            result = original(task, model)
            if recorder.kill_evaluate is not None and t == recorder.kill_evaluate:
                die()
            return result

        return evaluate


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _make_local_grid():
    from flwr.app import MessageType

    from server.local_grid import LocalGrid

    class RecordingGrid(LocalGrid):
        """A LocalGrid that records every TRAIN broadcast and can inject faults:

        ``drop``: {(user, t)} whose node never answers round t (a dropout);
        ``late``: {(user, t)} whose reply is computed but not returned (a timeout);
        ``twice``: {(user, t): how} whose reply comes twice ("same", or "other": a second, different one);
        ``after_round``: {t: callable(grid)} run after round t's replies are in (reconnects);
        ``kill_query``: SIGKILL after this many nodes answered the first QUERY exchange."""

        def __init__(self, nodes, recorder: Recorder, *, drop=(), late=(), twice=None, after_round=None,
                     kill_query: int | None = None) -> None:
            super().__init__(nodes)
            self.recorder = recorder
            self.drop, self.late = set(drop), set(late)
            self.twice = dict(twice or {})
            self.after_round = dict(after_round or {})
            self.kill_query = kill_query
            self.queries = 0

        @staticmethod
        def _config(message):
            return message.content.config_records.get("config")

        def send_and_receive(self, messages: Iterable, *, timeout: float | None = None):
            messages = list(messages)
            train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
            query = [m for m in messages if m.metadata.message_type == MessageType.QUERY]
            t = None
            if train:
                rounds = {self._config(m)["round"] for m in train}
                assert len(rounds) == 1, rounds
                t = rounds.pop()
                shas = {state_sha(m.content.array_records["arrays"].to_torch_state_dict()) for m in train}
                self.recorder.write(kind="train", round=t, sha=sorted(shas)[0], distinct=len(shas),
                                    users=sorted(self._config(m)["user-id"] for m in train),
                                    nodes=sorted(int(m.metadata.dst_node_id) for m in train),
                                    previous=round_status(self.recorder.run_dir, t - 1) if t > 0 else "initial")
                self.recorder.round = t
            if query:
                self.queries += 1
                if self.kill_query is not None and self.queries == 1:
                    for message in query[: self.kill_query]:  # these nodes answer, then the server dies
                        self.nodes[int(message.metadata.dst_node_id)](message)
                    die()
            self.sent.extend(messages)
            replies = []
            for message in messages:
                node = self.nodes.get(message.metadata.dst_node_id)
                config = self._config(message)
                user = config.get("user-id") if config is not None and t is not None else None
                if node is None or (user, t) in self.drop:
                    continue
                reply = node(message)
                if reply is None or (user, t) in self.late:
                    continue
                replies.append(reply)
                how = self.twice.get((user, t))
                if how == "same":
                    replies.append(reply)
                elif how == "other":
                    from flwr.app import ArrayRecord

                    other = node(message)
                    state = other.content.array_records["arrays"].to_torch_state_dict()
                    other.content["arrays"] = ArrayRecord({k: v * 3 + 1 for k, v in state.items()})
                    replies.append(other)
            if t is not None and t in self.after_round:
                self.after_round[t](self)
            return replies

    return RecordingGrid


def nodes_for(users: int, base: int = 100) -> dict[int, Callable]:
    """``{base + i: the real ClientApp as partition i}`` for i < users."""
    from client.app import app as client_app
    from server.local_grid import client_node

    return {base + i: client_node(client_app, {"partition-id": i}, base + i) for i in range(users)}


def make_grid(values: Mapping[str, Any], recorder: Recorder, **faults):
    users = json.loads(values["task-options"])["num_users"]
    return _make_local_grid()(nodes_for(users), recorder, **faults)


# ---- kill points inside operations (this process only) -----------------------------------------
class _OsProxy:
    """``os`` for fedmf.run.checkpoint, with hooks on open/fdopen/replace."""

    def __init__(self, on_open=None, on_fdopen=None, on_replace=None) -> None:
        self._on_open, self._on_fdopen, self._on_replace = on_open, on_fdopen, on_replace

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, *args, **kwargs):
        fd = os.open(path, *args, **kwargs)
        if self._on_open:
            self._on_open(Path(path), fd)
        return fd

    def fdopen(self, fd, *args, **kwargs):
        f = os.fdopen(fd, *args, **kwargs)
        return self._on_fdopen(fd, f) if self._on_fdopen else f

    def replace(self, src, dst):
        os.replace(src, dst)
        if self._on_replace:
            self._on_replace(Path(src), Path(dst))


class _HalfWriter:
    """A file whose first write stores half the bytes, reaches the OS, and then the process dies."""

    def __init__(self, f) -> None:
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        die()


def install_kill(spec: str, recorder: Recorder) -> dict[str, Any]:
    """Arm the kill point ``spec`` in this process; returns grid options (the QUERY kill)."""
    import fedmf.run.checkpoint as checkpoint

    kind, _, arg = spec.partition(":")
    if kind == "event":  # the server's own hook: FEDMF_KILL_AT=EVENT:ROUND
        os.environ["FEDMF_KILL_AT"] = arg
        return {}
    if kind == "final-write":
        import server.app

        original = server.app.atomic_write

        def atomic_write(path, write, **kwargs):
            if Path(path).name != "final-model.pt":
                return original(path, write, **kwargs)

            def write_then_die(f):  # the temporary file holds the whole model; the rename never happens
                write(f)
                f.flush()
                die()

            return original(path, write_then_die, **kwargs)

        server.app.atomic_write = atomic_write
        return {}
    if kind == "query":
        return {"kill_query": int(arg)}
    t = int(arg)
    if kind == "checkpoint-temp":  # round t's checkpoint: temporary file written and fsynced, not renamed
        target = checkpoint.CheckpointStore(recorder.run_dir).path(t).name

        class Proxy(_OsProxy):
            def replace(self, src, dst):
                if Path(dst).name == target:
                    die()
                os.replace(src, dst)

        checkpoint.os = Proxy()
    elif kind == "noise-write":  # round t's new noise tensor file, half written
        pattern = re.compile(rf"^\.noise-[a-z_]+-r{t:06d}-[0-9a-f]{{16}}\.pt\.\d+\.tmp$")
        opened: dict[int, Path] = {}
        checkpoint.os = _OsProxy(on_open=lambda path, fd: opened.__setitem__(fd, path),
                                 on_fdopen=lambda fd, f: _HalfWriter(f) if pattern.match(opened.get(fd, Path()).name)
                                 else f)
    elif kind == "checkpoint-dirsync":  # round t's checkpoint renamed into place, the directory not fsynced
        target = checkpoint.CheckpointStore(recorder.run_dir).path(t).name
        armed = threading.Event()
        checkpoint.os = _OsProxy(on_replace=lambda src, dst: armed.set() if dst.name == target else None)
        original_fsync_dir = checkpoint.fsync_dir

        def fsync_dir(path):
            if armed.is_set():
                die()
            original_fsync_dir(path)

        checkpoint.fsync_dir = fsync_dir
    elif kind == "ledger-commit":  # round t's participation rows inserted, COMMIT not reached
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        @event.listens_for(Engine, "after_cursor_execute")
        def after(conn, cursor, statement, parameters, context, executemany):
            if not statement.lstrip().upper().startswith("INSERT INTO PARTICIPATIONS"):
                return
            columns = [c.strip() for c in statement[statement.index("(") + 1: statement.index(")")].split(",")]
            rows = parameters if executemany else [parameters]
            index = columns.index("round_index")
            if any(row[index] == t for row in rows):
                die()
    elif kind == "evaluate":
        recorder.kill_evaluate = t
    elif kind == "after-select":  # configure_train: the scheduler chose and the ledger opened the round
        from fedmf.run.private_run import PrivateRun

        original_select = PrivateRun.select

        def select(self, available):
            selection = original_select(self, available)
            if selection.round == t:
                die()
            return selection

        PrivateRun.select = select
    else:
        raise SystemExit(f"unknown kill point {spec!r}")
    return {}


def serve(values: Mapping[str, Any], recorder: Recorder, grid=None, **faults):
    """``server.app.run_server`` over the recording grid (real ClientApps)."""
    from server.app import run_server

    grid = grid if grid is not None else make_grid(values, recorder, **faults)
    return run_server(grid, dict(values))


def main(argv: list[str]) -> int:
    from fedmf.tasks.tiny import TinyTask

    values, log = json.loads(argv[0]), argv[1]
    recorder = Recorder(values["run-dir"], log)
    TinyTask.evaluate = recorder.evaluate_hook(TinyTask.evaluate)
    faults = install_kill(argv[2], recorder) if len(argv) > 2 else {}
    serve(values, recorder, **faults)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
