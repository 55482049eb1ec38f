"""Fault injection against the ServerApp code path (issue 13 item 4; the in-process parts of item 5).

Kill points: ``server.app.run_server`` over a LocalGrid of real ClientApps runs in a subprocess
(tests/_fault_script.py) that SIGKILLs itself at one point — a round event of ``fedmf.run.private_run.EVENTS``
or a point inside an operation, armed by monkeypatching in the child only — and is then started
again with the same configuration. For every point: the final model is bit-identical to the
uninterrupted ServerApp run and to the in-process loop (same fixed secrets, and repeatable noise:
FEDMF_UNSAFE_REPEATABLE_NOISE=1, tests only, so that a redone round repeats its noise); the ledger has every
round committed exactly once with consistent participation rows and ``fedmf audit`` finds no
problem; and everything the server released (the model broadcast in each round's TRAIN messages,
the model evaluated after each round) came from a committed round and is bit-identical to what the
uninterrupted run released for that round — a redone round released nothing new.

In-process faults: dropouts, timeouts, reconnects under a new node id, double answers, a ledger
that fails or is locked during a round, a checkpoint that cannot be written.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from fedmf.ledger import Ledger
from fedmf.ledger.db import LedgerError
from fedmf.ledger.models import Participation
from fedmf.run.federated import train
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.tasks import ClientHyper, get_task
from fedmf.tasks.tiny import TinyTask
from server.config import ServerConfig
from tests import _fault_script as fs
from tests import _federated_task as task

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "_fault_script.py"
USERS, ROUNDS, PER_ROUND = 8, 6, 3


def _values(run_dir: Path) -> dict:
    return {"task": "tiny", "task-options": json.dumps({"num_users": USERS}), "mechanism": "bsr", "rounds": ROUNDS,
            "min-sep": 2, "clients-per-round": PER_ROUND, "noise-multiplier": 0.6, "server-momentum": 0.5,
            "client-lr": 0.2, "batch-size": 8, "run-dir": str(run_dir), "reply-timeout": 120.0}


def _new_run(directory: Path) -> dict:
    task.write_secrets(directory)  # the same fixed secrets in every run directory
    return _values(directory)


@contextlib.contextmanager
def _recording_evaluate(recorder: fs.Recorder):
    original = TinyTask.evaluate
    TinyTask.evaluate = recorder.evaluate_hook(original)
    try:
        yield
    finally:
        TinyTask.evaluate = original


def _serve(values: dict, recorder: fs.Recorder, **faults):
    with _recording_evaluate(recorder):
        return fs.serve(values, recorder, **faults)


def _resume_and_check(run_dir: Path, values: dict, recorder: fs.Recorder, reference, attempts: dict[int, int]):
    """Start the server again after a fault: it finishes bit-identically to the uninterrupted run, the
    ledger holds every round once (``attempts`` where redone), and the releases of both runs are right."""
    again = fs.Recorder(run_dir)
    _serve(values, again)
    _assert_same(_final(run_dir), reference.final)
    _check_ledger(run_dir, attempts=attempts)
    _check_releases(recorder.records + again.records, reference, complete=True)
    return again


def _final(run_dir: Path) -> dict:
    return torch.load(Path(run_dir) / "final-model.pt", weights_only=True)


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _loop(values: dict, directory: Path, drop=(), available=None) -> dict:
    """The in-process loop (fedmf.run.federated.train) with the same secrets; ``drop``: {(user, t)}
    whose update is missing (None)."""
    task.write_secrets(directory)
    config = ServerConfig.from_mapping({**values, "run-dir": str(directory)})
    tiny = get_task(config.task, **config.task_options)
    local = tiny.as_local_update(ClientHyper(config.client_lr, config.local_epochs, config.batch_size))
    drop = set(drop)

    def local_update(params, user, t):
        return None if (str(user), t) in drop else local(params, user, t)

    model = tiny.model()
    train(model, tiny.users(), config.build_plan(), local_update, server_lr=config.server_lr,
          checkpoint_dir=directory, available=available, repeatable_noise=True)
    return model.state_dict()


class Reference:
    def __init__(self, final: dict, records: list[dict]) -> None:
        self.final = final
        self.train = {r["round"]: r for r in records if r["kind"] == "train"}
        self.evaluate = {r["round"]: r for r in records if r["kind"] == "evaluate"}
        assert sorted(self.train) == sorted(self.evaluate) == list(range(ROUNDS))

    def users(self, t: int) -> list[str]:
        return self.train[t]["users"]


@pytest.fixture(scope="module", autouse=True)
def _repeatable_noise():
    """Every run here is compared bit for bit with an uninterrupted one, redone rounds included: the
    ServerApp (in process and in the killed children) runs with FEDMF_UNSAFE_REPEATABLE_NOISE=1."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(REPEATABLE_NOISE_ENV, "1")
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted ServerApp run, which must equal the in-process loop bit for bit."""
    base = tmp_path_factory.mktemp("faults-reference")
    values = _new_run(base / "server")
    recorder = fs.Recorder(base / "server")
    _serve(values, recorder)
    final = _final(base / "server")
    _assert_same(_loop(values, base / "loop"), final)
    return Reference(final, recorder.records)


# ---- checks ----------------------------------------------------------------------------------
def _ledger(run_dir: Path, url: str | None = None):
    """The run's ledger: its SQLite file, or ``url`` (a PostgreSQL ledger of tests/run/test_faults_services.py)."""
    secret = (Path(run_dir) / "secrets" / "ledger_secret").read_bytes()
    return Ledger.open(url or Path(run_dir) / "ledger.db", secret=secret)


def _statuses(run_dir: Path) -> list[str]:
    with _ledger(run_dir) as book:
        runs = book.runs()
        assert len(runs) == 1, "a restart must resume the run, not start a second one"
        run = book.run(runs[0].id)
        return [run.round(t).status for t in range(ROUNDS)]


def _check_ledger(run_dir: Path, attempts: dict[int, int] | None = None, dropped: dict | None = None,
                  url: str | None = None) -> dict:
    """Every round committed exactly once, rows consistent with the counts, the audit clean (and its
    output, for a ``url`` ledger: the audit's own report is returned with it under "stdout")."""
    attempts = attempts or {}
    with _ledger(run_dir, url) as book:
        runs = book.runs()
        assert len(runs) == 1, "a restart must resume the run, not start a second one"
        run = book.run(runs[0].id)
        with book.engine.connect() as conn:
            rows = conn.execute(select(Participation.round_index, Participation.client_key, Participation.status)
                                .where(Participation.run_id == run.id)).all()
        by_round = defaultdict(list)
        for t, key, status in rows:
            by_round[t].append((bytes(key), status))
        for t in range(ROUNDS):
            summary = run.round(t)
            assert summary.status == "committed", (t, summary.status)
            assert summary.attempts == attempts.get(t, 1), (t, summary.attempts)
            keys = [k for k, _ in by_round[t]]
            assert len(keys) == len(set(keys)), f"round {t}: a user written twice"
            counts = Counter(s for _, s in by_round[t])
            assert (counts["contributed"], counts["dropped"], counts["rejected"]) == \
                   (summary.contributed, summary.dropped, summary.rejected), t
            assert summary.contributed + summary.dropped <= summary.selected
            assert summary.checkpoint_sha256 is not None
        for (user, t), in_ in (dropped or {}).items():
            status = dict(by_round[t]).get(run.key(user))
            assert status == ("dropped" if in_ else None), (user, t, status)
        run_id = run.id
    from fedmf.cli import main as fedmf_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fedmf_cli(["audit", "--ledger", url or str(Path(run_dir) / "ledger.db"), "--run", str(run_id), "--json"])
    assert rc == 0, err.getvalue()
    report = json.loads(out.getvalue())
    realized = report["realized"]
    assert realized["rounds_committed"] == ROUNDS and realized["rounds_open"] == 0
    assert realized["rounds_aborted"] == 0
    assert realized["aborts"] == sum(a - 1 for a in attempts.values())
    assert realized["flagged_users"] == 0 and report["flagged_users"] == []
    assert realized["rounds_below_planned_noise"] == []
    assert realized["client_state_consistent"] is True
    assert realized["min_separation"] is None or realized["min_separation"] >= 2
    return {**realized, "stdout": out.getvalue() + err.getvalue()}


def _check_releases(records: list[dict], reference: Reference | None, complete: bool = False,
                    unevaluated: frozenset = frozenset()) -> None:
    """Only committed rounds were released, and (against the uninterrupted run) every release
    of round t's model is the one model the uninterrupted run released for round t."""
    for r in records:
        if r["kind"] == "train":
            assert r["distinct"] == 1, r
            assert r["previous"] in ("initial", "committed"), f"round {r['round'] - 1} broadcast uncommitted"
            if reference is not None:
                assert r["sha"] == reference.train[r["round"]]["sha"], f"round {r['round']}: another model broadcast"
                assert r["users"] == reference.users(r["round"]), f"round {r['round']}: another selection"
        elif r["kind"] == "evaluate":
            assert r["status"] == "committed", f"round {r['round']} evaluated before its commit"
            if reference is not None:
                assert r["sha"] == reference.evaluate[r["round"]]["sha"], f"round {r['round']}: another model"
    if complete:
        assert {r["round"] for r in records if r["kind"] == "train"} == set(range(ROUNDS))
        assert {r["round"] for r in records if r["kind"] == "evaluate"} == set(range(ROUNDS)) - unevaluated


# ---- SIGKILL at >= 10 distinct points, then restart ------------------------------------------
def _child(values: dict, log: Path, kill: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FEDMF_KILL_AT"}
    return subprocess.run([sys.executable, str(SCRIPT), json.dumps(values), str(log), kill], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


# (kill specs run one after the other, the round t, round t's ledger status after the kills)
POINTS = [
    pytest.param("checkpoint-temp:2", 2, "open", id="checkpoint-temp-written-not-renamed", marks=pytest.mark.heavy),
    pytest.param("noise-write:0", 0, "open", id="noise-tensor-half-written"),
    pytest.param("ledger-commit:4", 4, "open", id="ledger-rows-inserted-before-COMMIT"),
    pytest.param("final-write", ROUNDS - 1, "committed", id="final-model-temp-written-not-renamed",
                 marks=pytest.mark.heavy),
    pytest.param("checkpoint-dirsync:3", 3, "open", id="checkpoint-renamed-before-dir-fsync", marks=pytest.mark.heavy),
    pytest.param("after-select:1", 1, "open", id="configure_train-after-select"),
    pytest.param("evaluate:5", 5, "committed", id="inside-evaluate", marks=pytest.mark.heavy),
    pytest.param("event:committed:2+query:4", 2, "committed", id="resumed-server-during-QUERY-exchange",
                 marks=pytest.mark.heavy),
    pytest.param("event:selected:0", 0, "planned", id="event-selected", marks=pytest.mark.heavy),
    pytest.param("event:updates:2", 2, "open", id="event-updates", marks=pytest.mark.heavy),
    pytest.param("event:noised:1", 1, "open", id="event-noised", marks=pytest.mark.heavy),
    pytest.param("event:stepped:3", 3, "open", id="event-stepped", marks=pytest.mark.heavy),
    pytest.param("event:checkpointed:5", 5, "open", id="event-checkpointed", marks=pytest.mark.heavy),
    # between the ledger commit and the release witness's line, then between that line and the release
    pytest.param("event:committed:4", 4, "committed", id="event-committed"),
    pytest.param("event:witnessed:3", 3, "committed", id="event-witnessed", marks=pytest.mark.heavy),
    pytest.param("event:released:2", 2, "committed", id="event-released", marks=pytest.mark.heavy),
]


#: what each kill inside an operation leaves behind (proof that it struck there)
TRACES = {"checkpoint-temp:2": [".round-000002.pt.*.tmp"], "noise-write:0": [".noise-*-r000000-*.pt.*.tmp"],
          "checkpoint-dirsync:3": ["round-000003.pt"], "final-write": [".final-model.pt.*.tmp"]}


@pytest.mark.parametrize("kills, t, after", POINTS)
def test_a_sigkilled_server_restarts_bit_identically_releasing_nothing_twice(tmp_path, reference, kills, t, after):
    run_dir, log = tmp_path / "run", tmp_path / "releases.jsonl"
    values = _new_run(run_dir)
    for kill in kills.split("+"):
        killed = _child(values, log, kill)
        assert killed.returncode == -9, (kill, killed.stderr[-2000:])
    assert not (run_dir / "final-model.pt").exists()
    for pattern in TRACES.get(kills, ()):  # the kill happened where it was meant to
        assert list(run_dir.glob(pattern)), (pattern, sorted(p.name for p in run_dir.iterdir()))
    statuses = _statuses(run_dir)
    assert statuses[t] == after, statuses
    assert statuses[:t] == ["committed"] * t  # nothing committed after the kill point
    assert all(s == "planned" for s in statuses[t + 1:]), statuses
    _check_releases(fs.read_log(log), reference)  # the killed run released only committed rounds' models
    # restarted with the same configuration (the ServerApp code path again, in this process)
    recorder = fs.Recorder(run_dir, log)
    _serve(values, recorder)
    _assert_same(_final(run_dir), reference.final)
    redone = after == "open"  # opened in the ledger before the kill: the restart redid it as attempt 2
    _check_ledger(run_dir, attempts={t: 2} if redone else {})
    records = fs.read_log(log)
    # killed between round t's commit and its release: the restart evaluates round t from its checkpoint
    # (fedmf.run.loop.recover_records: the same model, so the same evaluation) before round t+1
    _check_releases(records, reference, complete=True)
    if kills.startswith(("event:committed", "event:witnessed")):
        from fedmf.run.private_run import RECOVERED_EVALUATED

        lines = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
        assert [(x["round"], x.get("recovered")) for x in lines] == [
            (r, RECOVERED_EVALUATED if r == t else None) for r in range(ROUNDS)]
    if kills.startswith(("event:committed", "event:witnessed", "event:released", "evaluate")):
        # round t was committed before the kill; the restart broadcast round t's model again: the same one
        assert [r["round"] for r in records if r["kind"] == "train"].count(t + 1) == (1 if t + 1 < ROUNDS else 0)


# ---- in-process faults -------------------------------------------------------------------------
def _in_process(tmp_path: Path, name: str = "run"):
    run_dir = tmp_path / name
    return run_dir, _new_run(run_dir), fs.Recorder(run_dir)


def test_dropouts_and_timeouts_are_recorded_as_dropped_and_match_the_loop(tmp_path, reference):
    """A node that never answers round 1, one whose reply to round 3 does not come back in time
    (LocalGrid returns fewer replies): both users are dropped, the round goes on, and the model is
    the in-process loop's with those updates missing."""
    gone, slow = reference.users(1)[0], reference.users(3)[-1]
    run_dir, values, recorder = _in_process(tmp_path)
    _serve(values, recorder, drop={(gone, 1)}, late={(slow, 3)})
    expected = _loop(values, tmp_path / "loop", drop={(gone, 1), (slow, 3)})
    _assert_same(_final(run_dir), expected)
    _check_ledger(run_dir, dropped={(gone, 1): True, (slow, 3): True})
    _check_releases(recorder.records, None)


def test_a_user_reconnecting_under_a_new_node_id_is_the_same_user(tmp_path, reference):
    """After round 1 a user's node goes away and the user comes back as a new node: the QUERY
    exchange recognizes the user, the schedule (the ledger's min-sep) holds, and the run is the
    uninterrupted one bit for bit."""
    from client.app import app as client_app
    from server.local_grid import client_node

    user = next(u for u in reference.users(0) + reference.users(1)
                if any(u in reference.users(t) for t in range(2, ROUNDS)))
    old, new = 100 + int(user), 200 + int(user)

    def reconnect(grid):
        del grid.nodes[old]
        grid.nodes[new] = client_node(client_app, {"partition-id": int(user)}, new)

    run_dir, values, recorder = _in_process(tmp_path)
    _serve(values, recorder, after_round={1: reconnect})
    _assert_same(_final(run_dir), reference.final)
    _check_ledger(run_dir)
    _check_releases(recorder.records, reference, complete=True)
    later = [r for r in recorder.records if r["kind"] == "train" and r["round"] >= 2 and user in r["users"]]
    assert later and all(new in r["nodes"] and old not in r["nodes"] for r in later)


def test_a_user_claimed_by_two_live_nodes_is_selected_on_the_newest_one(tmp_path, reference, caplog):
    """The new node connects while the old one is still live (round 2): the user is selected on
    the most recently identified node only, the model is the uninterrupted one, and one log line
    names the pseudonymous user and both nodes."""
    from client.app import app as client_app
    from server.local_grid import client_node

    user = reference.users(2)[0]
    old, new = 100 + int(user), 200 + int(user)
    run_dir, values, recorder = _in_process(tmp_path)
    with caplog.at_level("WARNING", logger="fedmf.server"):
        _serve(values, recorder, after_round={
            1: lambda grid: grid.nodes.__setitem__(new, client_node(client_app, {"partition-id": int(user)}, new)),
            2: lambda grid: grid.nodes.__delitem__(old)})
    _assert_same(_final(run_dir), reference.final)
    train = next(r for r in recorder.records if r["kind"] == "train" and r["round"] == 2)
    assert user in train["users"] and new in train["nodes"] and old not in train["nodes"]
    lines = [r.getMessage() for r in caplog.records if "proven on live nodes" in r.getMessage()]
    assert len(lines) == 1 and f"{old}, {new}" in lines[0] and f"only node {new}" in lines[0], lines
    assert f"user {user} " not in lines[0]  # the pseudonymous label, never the raw id
    _check_ledger(run_dir)
    _check_releases(recorder.records, None)


def test_a_client_answering_twice_counts_once(tmp_path, reference):
    """The same reply twice (round 1), and a second, different reply (round 2): the first stands,
    one ledger row per user, and the model is the uninterrupted one."""
    run_dir, values, recorder = _in_process(tmp_path)
    twice = {(reference.users(1)[0], 1): "same", (reference.users(2)[1], 2): "other"}
    _serve(values, recorder, twice=twice)
    _assert_same(_final(run_dir), reference.final)
    _check_ledger(run_dir)
    _check_releases(recorder.records, reference, complete=True)


def _ledger_fault(kind: str, t: int):
    """Arm one failure of round t's ledger commit; returns a disarm function."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from fedmf.ledger.repository import RunLedger

    fired = []
    if kind == "commit_round-raises":
        original = RunLedger.commit_round

        def commit_round(self, index, **kwargs):
            if index == t and not fired:
                fired.append(index)
                raise LedgerError("cannot write to ledger sqlite:///ledger.db: database is unavailable (test)")
            return original(self, index, **kwargs)

        RunLedger.commit_round = commit_round
        return lambda: setattr(RunLedger, "commit_round", original)

    def before(conn, cursor, statement, parameters, context, executemany):
        # a real driver error inside the commit transaction, after its first statements ran
        if statement.lstrip().upper().startswith("INSERT INTO PARTICIPATIONS") and not fired:
            rows = parameters if executemany else [parameters]
            columns = [c.strip() for c in statement[statement.index("(") + 1: statement.index(")")].split(",")]
            if any(row[columns.index("round_index")] == t for row in rows):
                fired.append(t)
                return statement.replace("participations", "participations_unavailable", 1), parameters
        return statement, parameters

    event.listen(Engine, "before_cursor_execute", before, retval=True)
    return lambda: event.remove(Engine, "before_cursor_execute", before)


@pytest.mark.parametrize("kind", ["commit_round-raises", "driver-error-inside-the-transaction"])
def test_a_ledger_failure_at_the_commit_aborts_the_round_releases_nothing_and_a_restart_finishes(
        tmp_path, reference, kind, monkeypatch):
    """The ledger fails while round 3 commits and stays down past the retries (here: none): the
    server stops with a LedgerError, round 3 is aborted with no rows, nothing of it was released;
    started again, the run redoes round 3 with the same noise and ends bit-identically."""
    import server.strategy

    monkeypatch.setattr(server.strategy, "LEDGER_RETRIES", 0)
    run_dir, values, recorder = _in_process(tmp_path)
    disarm = _ledger_fault(kind, 3)
    try:
        with pytest.raises(LedgerError) as failure:
            _serve(values, recorder)
    finally:
        disarm()
    assert "\n" not in str(failure.value)
    assert not (run_dir / "final-model.pt").exists()
    assert max(r["round"] for r in recorder.records if r["kind"] == "train") == 3  # round 3's model never left
    assert max(r["round"] for r in recorder.records if r["kind"] == "evaluate") == 2
    assert _statuses(run_dir) == ["committed"] * 3 + ["aborted"] + ["planned"] * 2
    _check_releases(recorder.records, reference)
    with _ledger(run_dir) as book, book.engine.connect() as conn:
        assert conn.execute(select(Participation.client_key).where(Participation.round_index == 3)).all() == []
    _resume_and_check(run_dir, values, recorder, reference, attempts={3: 2})


def test_a_ledger_locked_by_another_writer_is_waited_for(tmp_path, reference):
    """Another connection holds the SQLite write lock for 1.5 s while round 2 commits: the server
    waits (the 30 s busy timeout) and the run is the uninterrupted one."""
    run_dir, values, recorder = _in_process(tmp_path)
    held = []

    def lock(grid):
        con = sqlite3.connect(run_dir / "ledger.db", isolation_level=None, check_same_thread=False, timeout=30)
        con.execute("BEGIN IMMEDIATE")
        held.append(time.monotonic())
        timer = threading.Timer(1.5, lambda: (con.execute("COMMIT"), con.close()))
        timer.start()
        held.append(timer)

    _serve(values, recorder, after_round={2: lock})
    held[1].join()
    _assert_same(_final(run_dir), reference.final)
    _check_ledger(run_dir)
    _check_releases(recorder.records, reference, complete=True)


def test_an_unwritable_checkpoint_stops_cleanly_releases_nothing_and_a_resume_works(tmp_path, reference, capsys):
    """Round 3's checkpoint cannot be written (as root chmod does not stop writes: a directory
    stands where the checkpoint file goes): the ServerApp stops with exit 2 and a one-line error,
    round 3 is aborted and nothing of it was released; once writable again, a restart finishes
    bit-identically."""
    from flwr.app import Context, RecordDict

    import server.app

    run_dir, values, recorder = _in_process(tmp_path)
    blocker = run_dir / "round-000003.pt"

    def block(grid):  # after round 2's commit pruned the old checkpoints, before round 3's is written
        blocker.mkdir()
        (blocker / "occupied").write_text("")

    grid = fs.make_grid(values, recorder, after_round={3: block})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(values))
    logger = logging.getLogger("fedmf.server")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    try:
        with _recording_evaluate(recorder), pytest.raises(server.app.ServerAppError) as stop:
            server.app.main(grid, context)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    assert str(stop.value).startswith("fedmf: error: cannot write checkpoint")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedmf: error:")]
    assert len(set(errors)) == 1 and "cannot write checkpoint" in errors[0], errors
    assert not (run_dir / "final-model.pt").exists()
    assert max(r["round"] for r in recorder.records if r["kind"] == "train") == 3
    assert max(r["round"] for r in recorder.records if r["kind"] == "evaluate") == 2
    assert _statuses(run_dir) == ["committed"] * 3 + ["aborted"] + ["planned"] * 2
    shutil.rmtree(blocker)
    _resume_and_check(run_dir, values, recorder, reference, attempts={3: 2})


def test_a_stop_on_error_prints_its_one_line_error_once(tmp_path, capsys):
    from flwr.app import Context, RecordDict

    import server.app

    values = _new_run(tmp_path / "run")
    recorder = fs.Recorder(tmp_path / "run")
    grid = fs.make_grid(values, recorder, after_round={0: lambda grid: (tmp_path / "run" / "round-000000.pt").mkdir()})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(values))
    logger = logging.getLogger("fedmf.server")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    try:
        with _recording_evaluate(recorder), pytest.raises(server.app.ServerAppError):
            server.app.main(grid, context)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedmf: error:")]
    assert errors and all("cannot write checkpoint" in line for line in errors), errors
    assert len(errors) == 1, errors


def test_a_ledger_outage_is_retried_with_backoff_in_the_same_run(tmp_path, reference, caplog):
    run_dir, values, recorder = _in_process(tmp_path)
    disarm = _ledger_fault("commit_round-raises", 3)
    try:
        with caplog.at_level(logging.INFO, logger="fedmf.server"):
            _serve(values, recorder)
    finally:
        disarm()
    _assert_same(_final(run_dir), reference.final)
    _check_ledger(run_dir, attempts={3: 2})
    _check_releases(recorder.records, reference)
    assert any("retry" in r.getMessage().lower() for r in caplog.records)
