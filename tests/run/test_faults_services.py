"""Service faults against the real ServerApp (issue 13 item 5): the ledger's PostgreSQL server
crashes in the middle of a round, and the run directory's disk fills up.

PostgreSQL: the module runs its own throwaway PostgreSQL server (``initdb`` into a temporary
directory, a free port, run as the ``postgres`` OS user when we are root; one database per test)
— never the shared cluster other tests use — and crashes it with ``pg_ctl stop -m immediate``
while round 3 is between its noise and its ledger commit, inside the commit transaction, right
after the commit, or (a target-ε run, whose guard reads the ledger) between two rounds; a thread
starts it again 2 s later. Kept down past the retries, the server stops with one line. Without
the PostgreSQL binaries the tests skip (with CI=true they fail).

Full disk: the run directory (checkpoints, secrets, the SQLite ledger) lives on a small tmpfs
mounted for the test, filled up with a file at a chosen point of a round. Without the right to
mount (not root, no CAP_SYS_ADMIN) the tests skip.

Every case drives ``server.app.main`` over the in-process grid of real ClientApps
(tests/_fault_script.py) and checks against the uninterrupted run (``reference`` from
tests/run/test_faults.py): the model is bit-identical, every round is committed exactly once with
consistent rows, nothing of an uncommitted round was released and nothing was released twice.
Like tests/run/test_faults.py, the ServerApp runs with FEDMF_UNSAFE_REPEATABLE_NOISE=1 (a redone round
repeats its noise, so the runs can be compared bit for bit).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, pool, text
from sqlalchemy.engine import Engine

from fedmf.ledger import Ledger
from tests import _fault_script as fs
from tests.run.test_faults import (
    ROUNDS,
    _assert_same,
    _check_ledger,
    _check_releases,
    _final,
    _new_run,
    _recording_evaluate,
    _repeatable_noise,
    _resume_and_check,
    _serve,
    _statuses,
    reference,
)

# the uninterrupted run, shared with tests/run/test_faults.py, and its unsalted noise (tests only): every
# case here is compared bit for bit with it, redone rounds included
__all__ = ["reference", "_repeatable_noise"]

PASSWORD = "pw-" + uuid.uuid4().hex  # in the ledger URL (trust auth ignores it): it must never be shown
FAULT_ROUND = 3


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


# ---- a private PostgreSQL server ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivatePostgres:
    """A throwaway PostgreSQL server in ``base`` (owned by the OS user that runs it)."""

    def __init__(self, bindir: Path, base: Path, as_user: list[str]) -> None:
        self.bindir, self.base, self.as_user = bindir, base, as_user
        self.data, self.port = base / "data", _free_port()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bindir / tool), *args], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed: {(done.stderr or done.stdout).strip()[-500:]}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.base / "server.log"), "-w", "-t", "60",
                  "-o", options, "start")

    def crash(self) -> None:
        """Stop the server the way a crash does: no shutdown checkpoint, sessions cut off."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        name = f"fedmf_{uuid.uuid4().hex[:12]}"
        engine = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT", poolclass=pool.NullPool)
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return self.url(name)


def _bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("pg_ctl")
    return Path(which).parent if which and shutil.which("initdb") else None


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL server for this module's tests, stopped and removed afterwards."""
    bindir = _bindir()
    if bindir is None:
        _unavailable("PostgreSQL server binaries (initdb, pg_ctl) not found")
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root but there is no 'postgres' OS user to run PostgreSQL as")
        as_user = ["runuser", "-u", "postgres", "--"]
    base = Path(tempfile.mkdtemp(prefix="fedmf-pg-"))
    server = PrivatePostgres(bindir, base, as_user)
    try:
        if as_user:
            shutil.chown(base, user="postgres", group="postgres")
        server.init()
        server.start()
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.crash()
        pid = server.postmaster_pid()
        if pid is not None:  # pg_ctl could not stop it: end it by its id
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


# ---- driving the ServerApp -----------------------------------------------------------------------
def _main(values: dict, recorder: fs.Recorder, capsys, **faults) -> tuple[str | None, str]:
    """``server.app.main`` over the recording grid: (the ServerAppError's text or None, stderr)."""
    from flwr.app import Context, RecordDict

    import server.app

    grid = fs.make_grid(values, recorder, **faults)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(values))
    logger = logging.getLogger("fedmf.server")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers[:] = []  # main installs its own one-line stderr handler
    error = None
    try:
        with _recording_evaluate(recorder):
            server.app.main(grid, context)
    except server.app.ServerAppError as e:
        error = str(e)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    return error, capsys.readouterr().err


def _on_event(monkeypatch, hooks: dict) -> None:
    """Call ``hooks[(event, t)]()`` the first time the run reaches that point (``fedmf.run.private_run.EVENTS``)."""
    import server.app

    hooks = dict(hooks)

    def on_event(name: str, t: int) -> None:
        hook = hooks.pop((name, t), None)
        if hook is not None:
            hook()

    monkeypatch.setattr(server.app, "_fault_injection", lambda: on_event)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fedmf: error:")]


def _retry_lines(err: str, t: int) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"fedmf round {t}: the ledger failed")]


def _released_once(records: list[dict], redone: int | None) -> None:
    """Each round's model was evaluated once; round t's TRAIN broadcast (round t-1's committed
    model) went out once, twice for the redone round (the same model both times)."""
    evaluated = Counter(r["round"] for r in records if r["kind"] == "evaluate")
    assert all(n == 1 for n in evaluated.values()), evaluated
    broadcast = Counter(r["round"] for r in records if r["kind"] == "train")
    assert broadcast == Counter({t: 2 if t == redone else 1 for t in broadcast}), broadcast


# ---- ledger checks on a PostgreSQL URL ---------------------------------------------------------
def _pg_round_status(url: str):
    """A ``round_status(run_dir, t)`` reading round t's status from the PostgreSQL ledger. While
    the database is down it answers "committed" for a round it saw committed before (a terminal
    status), "unreachable" otherwise."""
    engine = create_engine(url, poolclass=pool.NullPool, connect_args={"connect_timeout": 5})
    committed: set[int] = set()

    def round_status(run_dir, t: int) -> str | None:
        try:
            with engine.connect() as conn:
                row = conn.execute(text("SELECT status FROM round_state WHERE round_index = :t "
                                        "ORDER BY run_id DESC LIMIT 1"), {"t": t}).first()
        except Exception:  # noqa: BLE001 - the server is down
            return "committed" if t in committed else "unreachable"
        if row is not None and row[0] == "committed":
            committed.add(t)
        return None if row is None else row[0]

    return round_status, engine


def _pg_statuses(url: str, run_dir: Path) -> list[str]:
    with Ledger.open(url, secret=(run_dir / "secrets" / "ledger_secret").read_bytes()) as book:
        runs = book.runs()
        assert len(runs) == 1, "a restart must resume the run, not start a second one"
        run = book.run(runs[0].id)
        return [run.round(t).status for t in range(ROUNDS)]


def _check_pg_ledger(url: str, run_dir: Path, attempts: dict[int, int]) -> None:
    """Every round committed exactly once with rows matching its counts; the audit is clean and
    prints no password."""
    realized = _check_ledger(run_dir, attempts=attempts, url=url)
    assert PASSWORD not in realized["stdout"]


@contextlib.contextmanager
def _pg_run(postgres: PrivatePostgres, tmp_path: Path, monkeypatch):
    """A new run directory whose ledger is a fresh database on the private server; the recorder
    reads round statuses from it."""
    url = postgres.create_database()
    run_dir = tmp_path / "run"
    values = {**_new_run(run_dir), "ledger-url": url}
    round_status, engine = _pg_round_status(url)
    monkeypatch.setattr(fs, "round_status", round_status)
    try:
        yield url, run_dir, values
    finally:
        engine.dispose()


def _crash_inside_the_commit(postgres: PrivatePostgres, crash):
    """Arm: the first INSERT into participations after round FAULT_ROUND's checkpoint (inside
    its ledger commit transaction) crashes the server. Returns (arm, disarm)."""
    armed = threading.Event()

    def after(conn, cursor, statement, parameters, context, executemany):
        if armed.is_set() and statement.lstrip().upper().startswith("INSERT INTO PARTICIPATIONS"):
            armed.clear()
            crash()

    event.listen(Engine, "after_cursor_execute", after)
    return armed.set, lambda: event.remove(Engine, "after_cursor_execute", after)


# ---- PostgreSQL crashes mid-round ---------------------------------------------------------------
RESTART_AFTER_S = 2.0


class Outage:
    """Called: crash the private server, and start it again RESTART_AFTER_S later from a thread."""

    def __init__(self, postgres: PrivatePostgres) -> None:
        self.postgres = postgres
        self.status: str | None = None
        self.thread: threading.Thread | None = None
        self.failure: Exception | None = None
        self.down = self.up = 0.0

    def __call__(self) -> None:
        self.status = fs.round_status(None, FAULT_ROUND)
        self.postgres.crash()
        self.down = time.monotonic()
        self.thread = threading.Thread(target=self._restart, daemon=True)
        self.thread.start()

    def _restart(self) -> None:
        time.sleep(RESTART_AFTER_S)
        try:
            self.postgres.start()
        except Exception as e:  # noqa: BLE001 - reported by join()
            self.failure = e
        self.up = time.monotonic()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(120)

    def check(self) -> None:
        """The server was crashed, and came back RESTART_AFTER_S later."""
        assert self.thread is not None, "the server was not crashed"
        assert self.failure is None, self.failure
        assert self.up - self.down >= RESTART_AFTER_S


# where round 3 is when the server crashes: (the event that crashes it, whether the crash waits for
# the next INSERT into participations, the round whose ledger access fails and is retried, whether
# round 3 is aborted and redone)
CRASHES = {
    "between-noise-and-commit": ("checkpointed", False, FAULT_ROUND, True),
    "inside-the-commit-transaction": ("checkpointed", True, FAULT_ROUND, True),
    "right-after-the-commit": ("committed", False, FAULT_ROUND + 1, False),
}


@pytest.mark.parametrize("where", list(CRASHES))
def test_postgresql_crashing_mid_round_aborts_it_and_the_round_is_redone_once_it_is_back(
        tmp_path, reference, postgres, monkeypatch, capsys, where):
    """The ledger's PostgreSQL server crashes while round 3 is between its noise and its commit
    (or inside the commit transaction, after its participation rows were sent) and comes back
    2 s later: the round is aborted, retried with backoff (logged), redone with the same noise
    once the database is back, and the run ends bit-identically with every round committed once.
    Crashed right after round 3's commit, round 3 stands (released once, never redone; only its
    ledger-read metric is left out) and round 4 waits for the database."""
    import server.strategy

    monkeypatch.setattr(server.strategy, "LEDGER_BACKOFF_S", 0.25)
    event_name, in_transaction, retried, redone = CRASHES[where]
    outage = Outage(postgres)
    with _pg_run(postgres, tmp_path, monkeypatch) as (url, run_dir, values):
        recorder = fs.Recorder(run_dir)
        arm, disarm = _crash_inside_the_commit(postgres, outage)
        _on_event(monkeypatch, {(event_name, FAULT_ROUND): arm if in_transaction else outage})
        try:
            error, err = _main(values, recorder, capsys)
        finally:
            disarm()
            outage.join()
        assert error is None, error
        outage.check()
        assert outage.status == ("open" if redone else "committed")  # round 3 when the server went down
        retries = _retry_lines(err, retried)
        assert retries and all("the round was aborted and nothing of it was released; retry" in line
                               for line in retries), err[-2000:]
        assert not [line for line in err.splitlines() if "the ledger failed" in line and line not in retries]
        # before the commit the commit's connection is refused; inside it the open transaction is cut off
        assert ("Connection refused" in retries[0]) == (not in_transaction), retries[0]
        metric_left_out = [line for line in err.splitlines()
                           if line.startswith(f"fedmf round {FAULT_ROUND}: committed; its epsilon-worst-user-run")]
        assert len(metric_left_out) == (0 if redone else 1), err[-2000:]
        assert not _error_lines(err) and PASSWORD not in err
        _assert_same(_final(run_dir), reference.final)
        _check_pg_ledger(url, run_dir, attempts={FAULT_ROUND: 2} if redone else {})
        _check_releases(recorder.records, reference, complete=True)
        _released_once(recorder.records, redone=FAULT_ROUND if redone else None)


def test_postgresql_down_between_rounds_of_a_target_epsilon_run_is_waited_for(
        tmp_path, postgres, monkeypatch, capsys):
    """A target-ε run's guard reads the ledger before each round (the worst observed user): the
    database crashes after round 2's release and comes back 2 s later; the guard waits with
    backoff, no round is opened meanwhile, and the run equals an uninterrupted one (SQLite ledger)."""
    import server.strategy
    from tests.run.test_faults import Reference

    monkeypatch.setattr(server.strategy, "LEDGER_BACKOFF_S", 0.25)
    target = {"noise-multiplier": 0.0, "target-epsilon": 8.0}
    quiet = tmp_path / "uninterrupted"
    expected = fs.Recorder(quiet)
    _serve({**_new_run(quiet), **target}, expected)
    want = Reference(_final(quiet), expected.records)
    outage = Outage(postgres)
    with _pg_run(postgres, tmp_path, monkeypatch) as (url, run_dir, values):
        recorder = fs.Recorder(run_dir)
        _on_event(monkeypatch, {("released", FAULT_ROUND - 1): outage})
        try:
            error, err = _main({**values, **target}, recorder, capsys)
        finally:
            outage.join()
        assert error is None, error
        outage.check()
        retries = _retry_lines(err, FAULT_ROUND)
        assert retries and all("the round has not started; retry" in line for line in retries), err[-2000:]
        assert not _error_lines(err) and PASSWORD not in err
        _assert_same(_final(run_dir), want.final)
        _check_pg_ledger(url, run_dir, attempts={})
        _check_releases(recorder.records, want, complete=True)
        _released_once(recorder.records, redone=None)


def test_postgresql_down_past_the_retries_stops_cleanly_and_a_restart_finishes(
        tmp_path, reference, postgres, monkeypatch, capsys):
    """The database stays down through every retry: the ServerApp stops with one `fedmf: error:`
    line (no password), round 3 stays open in the ledger and nothing of it was released; with the
    database back, the restarted server takes round 3 over and ends bit-identically."""
    import server.strategy

    monkeypatch.setattr(server.strategy, "LEDGER_RETRIES", 2)
    monkeypatch.setattr(server.strategy, "LEDGER_BACKOFF_S", 0.05)
    crashed = []
    with _pg_run(postgres, tmp_path, monkeypatch) as (url, run_dir, values):
        recorder = fs.Recorder(run_dir)
        _on_event(monkeypatch, {("checkpointed", FAULT_ROUND): lambda: (postgres.crash(), crashed.append(1))})
        try:
            error, err = _main(values, recorder, capsys)
        finally:
            if crashed:
                postgres.start()
        assert crashed and error is not None
        assert error.startswith(("fedmf: error: cannot write to ledger postgresql+psycopg://postgres:***@",
                                 "fedmf: error: ledger error on postgresql+psycopg://postgres:***@")), error
        assert "Connection refused" in error
        assert "\n" not in error and PASSWORD not in error + err
        assert set(_error_lines(err)) == {error}, err[-2000:]
        assert [line.split("; retry ")[1].split(" ")[0] for line in _retry_lines(err, FAULT_ROUND)] == ["1/2", "2/2"]
        assert not (run_dir / "final-model.pt").exists()
        assert max(r["round"] for r in recorder.records if r["kind"] == "train") == FAULT_ROUND
        assert max(r["round"] for r in recorder.records if r["kind"] == "evaluate") == FAULT_ROUND - 1
        _check_releases(recorder.records, reference)
        # the abort could not reach the database: the round stays open, to be taken over
        assert _pg_statuses(url, run_dir) == ["committed"] * FAULT_ROUND + ["open"] + ["planned"] * (ROUNDS - 4)
        again = fs.Recorder(run_dir)
        _on_event(monkeypatch, {})
        error, err = _main(values, again, capsys)
        assert error is None, error
        _assert_same(_final(run_dir), reference.final)
        _check_pg_ledger(url, run_dir, attempts={FAULT_ROUND: 2})
        _check_releases(recorder.records + again.records, reference, complete=True)
        _released_once(recorder.records + again.records, redone=FAULT_ROUND)


@pytest.mark.parametrize("database_back", [True, False], ids=["database-back", "database-down"])
def test_a_commit_whose_outcome_is_unknown_is_resolved_from_the_ledger(
        tmp_path, reference, postgres, monkeypatch, capsys, database_back):
    """Round 3's commit transaction goes through but the server hears an error (the connection
    lost during COMMIT). With the database reachable, the server asks the ledger: round 3 is
    committed, naming this checkpoint, so the round stands (not redone, not aborted) and the run
    goes on. With the database down, the server cannot tell: it treats round 3 as failed —
    nothing of it is released — and, the database staying down, stops with one line; the
    restarted server resumes after round 3 from its checkpoint (committed once, never redone)."""
    import server.strategy
    from fedmf.ledger.db import LedgerError
    from fedmf.ledger.repository import RunLedger

    monkeypatch.setattr(server.strategy, "LEDGER_RETRIES", 2)
    monkeypatch.setattr(server.strategy, "LEDGER_BACKOFF_S", 0.05)
    armed, crashed = [], []
    original = RunLedger.commit_round

    def commit_round(self, t, **kw):
        summary = original(self, t, **kw)
        if armed and t == FAULT_ROUND and not crashed:
            crashed.append(fs.round_status(None, FAULT_ROUND))
            if not database_back:
                postgres.crash()
            raise LedgerError("cannot write to ledger: server closed the connection unexpectedly (during COMMIT)")
        return summary

    monkeypatch.setattr(RunLedger, "commit_round", commit_round)
    with _pg_run(postgres, tmp_path, monkeypatch) as (url, run_dir, values):
        recorder = fs.Recorder(run_dir)
        _on_event(monkeypatch, {("checkpointed", FAULT_ROUND): lambda: armed.append(1)})
        try:
            error, err = _main(values, recorder, capsys)
        finally:
            if crashed and not database_back:
                postgres.start()
        assert crashed == ["committed"], crashed  # the commit transaction was through when the error came
        if database_back:
            assert error is None, error
            _assert_same(_final(run_dir), reference.final)
            _check_pg_ledger(url, run_dir, attempts={})
            _check_releases(recorder.records, reference, complete=True)
            _released_once(recorder.records, redone=None)
            return
        assert error is not None and error.startswith("fedmf: error: ") and "Connection refused" in error, error
        assert set(_error_lines(err)) == {error} and PASSWORD not in err
        assert max(r["round"] for r in recorder.records if r["kind"] == "train") == FAULT_ROUND
        assert max(r["round"] for r in recorder.records if r["kind"] == "evaluate") == FAULT_ROUND - 1
        _check_releases(recorder.records, reference)
        assert _pg_statuses(url, run_dir) == ["committed"] * (FAULT_ROUND + 1) + ["planned"] * (ROUNDS - 4)
        again = fs.Recorder(run_dir)
        _on_event(monkeypatch, {})
        error, err = _main(values, again, capsys)
        assert error is None, error
        _assert_same(_final(run_dir), reference.final)
        _check_pg_ledger(url, run_dir, attempts={})
        # round 3's record was cut off by the stop: the restart evaluates round 3's model (from its checkpoint)
        # before round 4; the model left the server only in round 4's TRAIN
        _check_releases(recorder.records + again.records, reference, complete=True)
        _released_once(recorder.records + again.records, redone=None)


# ---- a full disk ------------------------------------------------------------------------------
DISK_BYTES = 16 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (mode 0700) mounted for the test, unmounted afterwards."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir(mode=0o700)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0700", "tmpfs", str(mountpoint)],
                              capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no mount command: cannot make a small disk to fill")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=60)


def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte with one file; returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bavail == 0
    return filler


# where the disk fills, and the one-line error the ServerApp stops with
DISK_FAULTS = [
    pytest.param("checkpoint", "cannot write checkpoint", "No space left on device", id="full-before-the-checkpoint"),
    pytest.param("ledger", "cannot write to ledger", "database or disk is full", id="full-before-the-ledger-commit"),
    pytest.param("final", "cannot write the final model", "No space left on device", id="full-before-the-final-model"),
]


@pytest.mark.parametrize("where, error_start, reason", DISK_FAULTS)
def test_a_full_disk_stops_cleanly_releases_nothing_and_a_restart_finishes(
        small_disk, reference, monkeypatch, capsys, where, error_start, reason):
    """The run directory's disk fills up in round 3 — before its checkpoint,
    between the checkpoint and the SQLite ledger commit — or before the final model is written:
    the ServerApp stops with one `fedmf: error:` line, nothing of the failed round was released and
    no half-written checkpoint or ledger row is left; with space again, a restart finishes
    bit-identically."""
    import server.strategy

    monkeypatch.setattr(server.strategy, "LEDGER_RETRIES", 1)
    monkeypatch.setattr(server.strategy, "LEDGER_BACKOFF_S", 0.05)
    run_dir = small_disk / "run"
    values = _new_run(run_dir)
    recorder = fs.Recorder(run_dir)
    fillers: list[Path] = []

    def fill(*grid) -> None:
        fillers.append(_fill(small_disk))

    after_round = {}
    if where == "checkpoint":
        after_round = {FAULT_ROUND: fill}
    _on_event(monkeypatch, {("checkpointed", FAULT_ROUND): fill} if where == "ledger" else
              {("released", ROUNDS - 1): fill} if where == "final" else {})
    error, err = _main(values, recorder, capsys, after_round=after_round)
    assert fillers, "the fault was not injected"
    assert error is not None and error.startswith(f"fedmf: error: {error_start}"), error
    assert reason in error and "\n" not in error
    assert set(_error_lines(err)) == {error}, err[-2000:]
    assert "Traceback" not in err
    assert not (run_dir / "final-model.pt").exists()
    assert not list(run_dir.glob(".*.tmp")), sorted(p.name for p in run_dir.iterdir())  # nothing half-written
    failed = ROUNDS if where == "final" else FAULT_ROUND
    _check_releases(recorder.records, reference, complete=where == "final")
    if where != "final":
        assert max(r["round"] for r in recorder.records if r["kind"] == "train") == FAULT_ROUND
        assert max(r["round"] for r in recorder.records if r["kind"] == "evaluate") == FAULT_ROUND - 1
    for filler in fillers:  # space again
        filler.unlink()
    statuses = _statuses(run_dir)
    assert statuses[:failed] == ["committed"] * failed, statuses
    if where != "final":  # aborted, or left open when the abort itself could not be written
        assert statuses[FAULT_ROUND] in ("aborted", "open") and statuses[FAULT_ROUND + 1:] == ["planned"] * 2, statuses
        assert sorted(p.name for p in run_dir.glob("round-*.pt")) in (["round-000002.pt"],
                                                                      ["round-000002.pt", "round-000003.pt"])
    redone = None if where == "final" else FAULT_ROUND
    again = _resume_and_check(run_dir, values, recorder, reference,
                              attempts={} if redone is None else {FAULT_ROUND: 2})
    _released_once(recorder.records + again.records, redone=redone)
