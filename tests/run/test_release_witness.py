"""Each round is released once against a rollback of either store (issue 34, item 1).

A resume is refused, in one line naming both sides, when the run directory shows more rounds than the
ledger (a ledger restored from a backup, or with rounds deleted), as it is when the ledger shows more
(tests/run/test_release_once.py); a rollback of both together is refused by the release witness
(fedmf/run/witness.py), which the server appends to after each ledger commit and before the round's
release. ``fedmf audit --verify --head`` checks a ledger against a head recorded outside it. Every
witness lives under tmp_path (or the session's temporary XDG_STATE_HOME, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedmf.cli import main
from fedmf.errors import CheckpointError
from fedmf.ledger import Ledger
from fedmf.run.federated import train
from fedmf.run.private_run import PrivateRun
from fedmf.run.round_log import ROUND_LOG
from fedmf.run.witness import Witness
from tests import _federated_task as task

ROUNDS = 6
ROOT = Path(__file__).resolve().parents[2]


class Stop(Exception):
    """Raised from an event hook: the server stops at that point (as a crash would)."""


def _train(run_dir, *, ledger=None, witness, rounds=None, stop=None, released=None, events=None):
    """Train (or resume) the Tiny task; ``stop=(event, t)`` raises Stop there; ``released`` collects the
    rounds released (on_round); ``events(name, t)`` sees every event. Returns the TrainResult or None."""

    def on_event(name, t):
        if events is not None:
            events(name, t)
        if (name, t) == stop:
            raise Stop(f"{name} {t}")

    def on_round(record):
        if released is not None:
            released.append(record.round)

    try:
        return train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
                     ledger=ledger, rounds=rounds, witness=witness, on_event=on_event, on_round=on_round)
    except Stop:
        return None


def _ledger_rounds(ledger: str, run_dir: Path) -> list[tuple[int, str]]:
    """(round, chain head) of every committed round of run 1."""
    secret = (run_dir / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(ledger, secret=secret) as book:
        run = book.run(1)
        return [(t, run.round(t).chain_sha256) for t in range(run.next_round)]


def _witness_entries(directory: Path) -> list[dict]:
    """The round lines of the one witness file in ``directory``, after its genesis line (checked)."""
    files = list(directory.iterdir())
    assert len(files) == 1
    genesis, *rounds = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert genesis["round"] == -1 and genesis["chain_sha256"] == genesis["genesis_sha256"]
    return rounds


class _Backup:
    """Back up a ledger (a SQLite file, or a PostgreSQL schema copied table by table) and restore it."""

    def __init__(self, ledger: str, tmp_path: Path, request) -> None:
        self.ledger, self.tmp, self.request = ledger, tmp_path, request
        self.postgres = ledger.startswith("postgresql")

    def _pg(self):
        from sqlalchemy.engine import make_url

        admin = self.request.getfixturevalue("pg_admin")
        schema = make_url(self.ledger).query["options"].split("search_path=")[1]
        return admin, schema

    def take(self) -> None:
        if not self.postgres:
            shutil.copy2(self.ledger, self.tmp / "ledger-backup.db")
            return
        from sqlalchemy import text

        admin, schema = self._pg()
        with admin.connect() as conn:
            tables = [r[0] for r in conn.execute(text(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = :s AND table_type = 'BASE "
                "TABLE'"), {"s": schema})]
            conn.execute(text(f'CREATE SCHEMA "{schema}_bk"'))
            for t in tables:
                conn.execute(text(f'CREATE TABLE "{schema}_bk"."{t}" AS TABLE "{schema}"."{t}"'))
        self.tables = tables

    def restore(self) -> None:
        """What restoring the backup does: the ledger as it was when it was taken."""
        if not self.postgres:
            for suffix in ("-wal", "-shm"):
                Path(self.ledger + suffix).unlink(missing_ok=True)
            shutil.copy2(self.tmp / "ledger-backup.db", self.ledger)
            return
        from sqlalchemy import text

        admin, schema = self._pg()
        with admin.connect() as conn:
            # the owner's restore: no triggers, so no foreign-key cascade either. A session setting: the
            # admin engine autocommits each statement, so SET LOCAL would end with its own statement and
            # deleting a parent table would cascade into children restored before it (the order of
            # information_schema's tables varies)
            conn.execute(text("SET session_replication_role = replica"))
            try:
                for t in self.tables:
                    conn.execute(text(f'DELETE FROM "{schema}"."{t}"'))
                    conn.execute(text(f'INSERT INTO "{schema}"."{t}" SELECT * FROM "{schema}_bk"."{t}"'))
            finally:
                conn.execute(text("RESET session_replication_role"))
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}_bk" CASCADE'))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_ledger_older_than_the_run_directory_is_refused_in_one_line(tmp_path, backend, request):
    """The issue's attack: the ledger (outside the run directory) restored from a backup taken before
    the run's first commit. Resuming would load initial.pt and release rounds 0-2 again with fresh
    noise; it is refused, naming both sides, before anything is written. A backup taken after round 1
    is refused the same way; the witness alone would refuse too, but the run directory speaks first."""
    ledger = str(tmp_path / "ledger.db") if backend == "sqlite" else request.getfixturevalue("pg_url")
    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), run_dir, ledger=ledger, population=task.users(),
                    witness=witness).close()  # the run row, no round
    backup = _Backup(ledger, tmp_path, request)
    backup.take()
    assert _train(run_dir, ledger=ledger, witness=witness, rounds=3) is not None
    backup.restore()
    assert _ledger_rounds(ledger, run_dir) == []
    files = sorted(p.name for p in run_dir.iterdir())
    log = (run_dir / ROUND_LOG).read_bytes()
    released: list[int] = []
    with pytest.raises(CheckpointError) as info:
        _train(run_dir, ledger=ledger, witness=witness, released=released)
    assert str(info.value) == (f"run directory {str(run_dir)!r} shows round 2 committed (its round log rounds.jsonl) "
                               "but the ledger has no committed round of run 1: the ledger was rolled back; refusing "
                               "to release rounds again")
    assert released == [] and sorted(p.name for p in run_dir.iterdir()) == files
    assert (run_dir / ROUND_LOG).read_bytes() == log and _ledger_rounds(ledger, run_dir) == []


def test_each_trace_of_a_later_round_in_the_run_directory_refuses_a_rolled_back_ledger(tmp_path):
    """Without the round log (and without the witness, so that only the run directory speaks): a
    checkpoint two rounds past the ledger's last commit, then one round past it that the ledger never
    opened, are each refused; a checkpoint of the one round past it that the ledger did open (a stop
    between the checkpoint and the commit) resumes, as before."""
    ledger, run_dir, backup = str(tmp_path / "ledger.db"), tmp_path / "run", tmp_path / "ledger-1.db"
    assert _train(run_dir, ledger=ledger, witness="off", rounds=2) is not None
    shutil.copy2(ledger, backup)  # rounds 0, 1 committed
    assert _train(run_dir, ledger=ledger, witness="off", rounds=4) is not None  # round-000003.pt, noise files
    (run_dir / ROUND_LOG).unlink()
    shutil.copy2(backup, ledger)
    with pytest.raises(CheckpointError) as info:
        _train(run_dir, ledger=ledger, witness="off")
    assert str(info.value) == (f"run directory {str(run_dir)!r} shows round 2 committed (its checkpoint "
                               "round-000003.pt of round 3) but the ledger's last committed round is 1 of run 1: the "
                               "ledger was rolled back; refusing to release rounds again")
    for p in run_dir.glob("round-*.pt"):  # only round 2's checkpoint and noise: a run one round ahead
        p.unlink()
    for p in run_dir.glob("noise-*-r000003-*.pt"):
        p.unlink()
    shutil.copy2(run_dir / "initial.pt", run_dir / "round-000002.pt")  # any bytes: never loaded
    with pytest.raises(CheckpointError) as info:
        _train(run_dir, ledger=ledger, witness="off")
    assert "shows round 2 begun (its checkpoint round-000002.pt)" in str(info.value)
    assert "it never opened round 2: the ledger was rolled back; refusing to release rounds again" in str(info.value)

    fresh, released = tmp_path / "fresh", []  # the legitimate case: stopped after the checkpoint, before the commit
    assert _train(fresh, witness=tmp_path / "w", stop=("checkpointed", 2)) is None
    assert (fresh / "round-000002.pt").exists() and _ledger_rounds(str(fresh / "ledger.db"), fresh)[-1][0] == 1
    assert _train(fresh, witness=tmp_path / "w", released=released) is not None and released == [2, 3, 4, 5]


@pytest.mark.parametrize("backend", ["sqlite-inside", "postgresql"])
def test_a_rollback_of_both_stores_is_refused_by_the_witness(tmp_path, backend, request):
    """The run directory and the ledger restored together (a SQLite ledger inside the run directory,
    or a consistent restore of both): they agree, and only the witness knows rounds 2-3 were
    released. Refused in one line; with the witness off (tests only) the same restore releases round 2
    again, which is what the witness prevents."""
    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    ledger = None if backend == "sqlite-inside" else request.getfixturevalue("pg_url")
    for guarded in (True, False):
        where = witness if guarded else "off"
        if not guarded:
            shutil.rmtree(run_dir)
            ledger = None
        assert _train(run_dir, ledger=ledger, witness=where, rounds=2) is not None
        copy = tmp_path / f"run-backup-{guarded}"
        shutil.copytree(run_dir, copy, symlinks=True)
        backup = None
        if ledger is not None:
            backup = _Backup(ledger, tmp_path, request)
            backup.take()
        assert _train(run_dir, ledger=ledger, witness=where, rounds=4) is not None
        shutil.rmtree(run_dir)
        shutil.copytree(copy, run_dir, symlinks=True)
        if backup is not None:
            backup.restore()
        released: list[int] = []
        if guarded:
            (path,) = witness.iterdir()
            with pytest.raises(CheckpointError) as info:
                _train(run_dir, ledger=ledger, witness=where, released=released)
            assert str(info.value) == (
                f"the release witness {str(path)!r} shows round 3 committed but the ledger's last committed round is 1 "
                "of run 1 (and the run directory agrees with the ledger): both were rolled back (restored from a "
                "backup?); refusing to release rounds again")
            assert released == [] and [e["round"] for e in _witness_entries(witness)] == [0, 1, 2, 3]
        else:
            assert _train(run_dir, ledger=ledger, witness=where, released=released) is not None
            assert released[:2] == [2, 3]  # released a second time: the unsafe control


def test_the_witness_is_written_after_the_commit_and_before_the_release(tmp_path):
    """At each round's "committed" event the ledger holds the round and the witness does not yet; at
    "witnessed" the witness holds it with the ledger's chain head; every release finds it there. The
    file is 0600 in a 0700 directory, one line per round, heads equal to the ledger's."""
    run_dir, witness, seen = tmp_path / "run", tmp_path / "state" / "witness", []

    def events(name, t):
        if name in ("committed", "witnessed"):
            entries = [e["round"] for e in _witness_entries(witness)] if witness.exists() and any(
                witness.iterdir()) else []
            seen.append((name, t, t in entries))

    released_with: list[tuple[int, bool]] = []
    result = train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
                   witness=witness, on_event=events,
                   on_round=lambda r: released_with.append((r.round, r.round in [
                       e["round"] for e in _witness_entries(witness)])))
    assert seen == [(name, t, name == "witnessed") for t in range(ROUNDS) for name in ("committed", "witnessed")]
    assert released_with == [(t, True) for t in range(ROUNDS)]
    entries = _witness_entries(witness)
    heads = _ledger_rounds(str(run_dir / "ledger.db"), run_dir)
    assert [(e["round"], e["chain_sha256"]) for e in entries] == heads
    assert result.head == f"{ROUNDS - 1}:{heads[-1][1]}" and result.witness == str(next(witness.iterdir()))
    (path,) = witness.iterdir()
    assert path.stat().st_mode & 0o777 == 0o600 and witness.stat().st_mode & 0o777 == 0o700


def test_a_stop_between_the_commit_and_the_witness_does_not_block_the_resume(tmp_path):
    """Killed after round 2's ledger commit, before its witness entry: the witness is one behind and
    round 2 was never released. The resume records round 2 in the witness before anything else, then
    releases round 2's record (evaluated on resume) and goes on."""
    run_dir, witness, released = tmp_path / "run", tmp_path / "witness", []
    assert _train(run_dir, witness=witness, stop=("committed", 2), released=released) is None
    assert released == [0, 1] and [e["round"] for e in _witness_entries(witness)] == [0, 1]
    assert [t for t, _ in _ledger_rounds(str(run_dir / "ledger.db"), run_dir)] == [0, 1, 2]
    order = []
    result = train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
                   witness=witness, on_round=lambda r: order.append(
                       (r.round, max(e["round"] for e in _witness_entries(witness)))))
    assert result.rounds_done == ROUNDS and [t for t, _ in order] == [2, 3, 4, 5]
    assert order[0] == (2, 2)  # round 2's record released after the witness caught up
    assert [e["round"] for e in _witness_entries(witness)] == list(range(ROUNDS))


def test_a_witness_that_cannot_be_written_stops_the_run_before_the_release(tmp_path, monkeypatch):
    """The append fails at round 2 (a full disk): round 2 is committed, nothing of it is released,
    the run stops; the next start records it and goes on."""
    run_dir, witness, released = tmp_path / "run", tmp_path / "witness", []
    real = Witness.append

    def failing(self, t, head):
        if t == 2:
            raise CheckpointError("cannot record round 2 in the release witness: No space left on device")
        real(self, t, head)

    with monkeypatch.context() as patch:
        patch.setattr(Witness, "append", failing)
        with pytest.raises(CheckpointError, match="No space left"):
            _train(run_dir, witness=witness, released=released)
    assert released == [0, 1]
    assert _train(run_dir, witness=witness, released=released) is not None
    assert released == [0, 1, 2, 3, 4, 5] and len(_witness_entries(witness)) == ROUNDS


def test_the_witness_file_and_its_directory_are_checked(tmp_path):
    """Refused in one line: a group-writable directory, a witness file readable by others, a symbolic
    link, a line of another run; and a witness whose head at its last round is not the ledger's (a
    ledger replaced by another history of the same length)."""
    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    assert _train(run_dir, witness=witness, rounds=2) is not None
    (path,) = witness.iterdir()
    witness.chmod(0o770)
    with pytest.raises(CheckpointError, match="release witness directory .* has mode 770"):
        _train(run_dir, witness=witness, rounds=3)
    witness.chmod(0o700)
    path.chmod(0o644)
    with pytest.raises(CheckpointError, match="must be a regular file of mode 600"):
        _train(run_dir, witness=witness, rounds=3)
    path.chmod(0o600)
    original = path.read_bytes()
    target = tmp_path / "elsewhere"
    target.write_bytes(original)
    target.chmod(0o600)
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(CheckpointError, match="a symbolic link is refused"):
        _train(run_dir, witness=witness, rounds=3)
    path.unlink()
    entry = json.loads(original.splitlines()[-1])
    path.write_bytes(original + json.dumps({**entry, "run_id": 2}).encode() + b"\n")
    path.chmod(0o600)
    with pytest.raises(CheckpointError, match="holds entries of another run"):
        _train(run_dir, witness=witness, rounds=3)
    path.write_bytes(original.replace(entry["chain_sha256"].encode(), b"0" * 64))
    with pytest.raises(CheckpointError) as info:
        _train(run_dir, witness=witness, rounds=3)
    assert "records chain head 0000000000000000… at round 1, but the ledger's round 1 of run 1 has" in str(info.value)
    assert "\n" not in str(info.value)
    path.write_bytes(original)
    assert _train(run_dir, witness=witness, rounds=3) is not None


def test_a_ledger_without_the_run_is_refused_in_one_line(tmp_path):
    """A ledger restored from before the run began (here: a fresh, empty one) does not hold the run
    run.json names: refused, not a new run over the old directory."""
    ledger, run_dir = tmp_path / "ledger.db", tmp_path / "run"
    assert _train(run_dir, ledger=str(ledger), witness="off", rounds=2) is not None
    ledger.unlink()
    with pytest.raises(CheckpointError) as info:
        _train(run_dir, ledger=str(ledger), witness="off")
    assert str(info.value) == (f"the run directory {str(run_dir)!r} belongs to ledger run 1, which the ledger does not "
                               "hold: the ledger was rolled back to before the run began (or is another ledger); "
                               "refusing to release rounds again")


def test_audit_checks_a_recorded_head(tmp_path, capsys):
    """``fedmf audit --verify --head ROUND:HASH``: the run's own heads match (exit 0); the same ledger
    restored from before round 2 is truncated before the recorded round (exit 1), and the head alone
    is found in no round; a ledger with another, self-consistent history (another run of the same
    plan: --verify alone passes) was rewritten (exit 1); a malformed head is bad input (exit 2)."""
    ledger, run_dir = tmp_path / "ledger.db", tmp_path / "run"
    assert _train(run_dir, ledger=str(ledger), witness="off", rounds=1) is not None
    shutil.copy2(ledger, tmp_path / "after-round-0.db")
    result = _train(run_dir, ledger=str(ledger), witness="off", rounds=3)
    heads = dict(_ledger_rounds(str(ledger), run_dir))
    assert result.head == f"2:{heads[2]}"

    assert main(["audit", "--ledger", str(ledger), "--head", result.head]) == 0
    out = capsys.readouterr().out
    assert f"recorded head       matches (2:{heads[2]}): the recorded head is round 2's and the chain verifies " \
           "through it; 0 later rounds not covered by it" in out
    assert f"head to record      2:{heads[2]}" in out and "hash chain          verified: 3 rounds" in out
    assert main(["audit", "--ledger", str(ledger), "--head", heads[1], "--json"]) == 0
    check = json.loads(capsys.readouterr().out)["head_check"]
    assert check == {"ok": True, "recorded": heads[1], "round": 1, "last_round": 2, "truncated": False,
                     "reason": "the recorded head is round 1's and the chain verifies through it; 1 later round not "
                               "covered by it"}

    shutil.copy2(tmp_path / "after-round-0.db", ledger)  # truncated: rolled back to round 0
    assert main(["audit", "--ledger", str(ledger), "--head", result.head]) == 1
    err = capsys.readouterr().err
    assert err == ("fedmf: recorded head mismatch: the ledger is truncated: its last committed round is 0, before the "
                   "recorded round 2\n")
    assert main(["audit", "--ledger", str(ledger), "--head", heads[2]]) == 1
    assert "no committed round of the ledger (last 0) has the recorded head" in capsys.readouterr().err
    assert main(["audit", "--ledger", str(ledger), "--head", f"0:{heads[0]}"]) == 0  # what it still holds is intact
    capsys.readouterr()

    other_ledger = tmp_path / "other.db"
    assert _train(tmp_path / "other", ledger=str(other_ledger), witness="off", rounds=3) is not None
    assert main(["audit", "--ledger", str(other_ledger), "--verify"]) == 0  # consistent: --verify alone passes
    capsys.readouterr()
    assert main(["audit", "--ledger", str(other_ledger), "--head", result.head]) == 1
    assert capsys.readouterr().err.startswith("fedmf: recorded head mismatch: the ledger was rewritten: round 2 has "
                                              "head ")
    assert main(["audit", "--ledger", str(ledger), "--head", "2:abc"]) == 2
    assert capsys.readouterr().err == ("fedmf: error: argument --head: a recorded head is ROUND:HASH or HASH with 64 "
                                       "hex digits, got '2:abc'\n")

    # round 0's record edited in place (its stored hashes kept): round 1's head is still stored, but the
    # chain recomputed from the rows no longer reaches it
    from sqlalchemy import text

    with Ledger.open(str(other_ledger)) as book, book.engine.begin() as conn:
        conn.execute(text("UPDATE rounds SET noise_std = 40.0 WHERE round_index = 0"))
    other_heads = dict(_ledger_rounds(str(other_ledger), tmp_path / "other"))
    assert main(["audit", "--ledger", str(other_ledger), "--head", f"1:{other_heads[1]}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedmf: recorded head mismatch: the chain does not verify through round 1: round 0 does "
                          "not match its hash") and "fedmf: verification failed: round 0" in err


_BACK_UP_AFTER_ROUND_1 = """
import shutil, sqlite3, sys
from fedmf.cli import main
from fedmf.run.private_run import PrivateRun
real = PrivateRun.released
def released(self, t):
    real(self, t)
    if t == 1:  # the operator's backup, taken while the run goes on: the ledger, and the run directory
        with sqlite3.connect(sys.argv[-2]) as src, sqlite3.connect(sys.argv[-2] + ".backup") as dst:
            src.backup(dst)  # SQLite's online backup (the WAL's commits included)
        shutil.copytree(self.directory, str(self.directory) + ".backup", symlinks=True)
PrivateRun.released = released
sys.exit(main(sys.argv[1:-2]))
"""


def test_fedmf_simulate_refuses_a_restored_ledger_and_a_restored_pair_as_real_processes(tmp_path):
    """``fedmf simulate`` as processes, a SQLite ledger kept outside the run directory: a run whose
    ledger and run directory were backed up after round 1; then the ledger alone restored: refused in
    one line, exit 2; then both restored: refused by the witness, exit 2; nothing released either time
    (the round log is the restored one)."""
    out, ledger, witness = tmp_path / "out", tmp_path / "ledger.db", tmp_path / "witness"
    args = ["simulate", "--preset", "tiny", "--rounds", "4", "--noise-multiplier", "0.7", "--no-plot", "--quiet",
            "--out", str(out), "--ledger", str(ledger), "--witness", str(witness)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def fedmf(script=None):
        command = [sys.executable, "-c", script, *args, str(ledger), "-"] if script else \
            [sys.executable, "-m", "fedmf.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

    first = fedmf(_BACK_UP_AFTER_ROUND_1)
    assert first.returncode == 0, first.stderr
    assert "ledger head     3:" in first.stdout
    for suffix in ("-wal", "-shm"):
        Path(str(ledger) + suffix).unlink(missing_ok=True)
    shutil.copy2(str(ledger) + ".backup", ledger)
    second = fedmf()
    assert second.returncode == 2 and second.stdout == ""
    assert second.stderr == (f"fedmf: error: run directory {str(out)!r} shows round 3 committed (its round log "
                             "rounds.jsonl) but the ledger's last committed round is 1 of run 1: the ledger was rolled "
                             "back; refusing to release rounds again\n")
    shutil.rmtree(out)
    shutil.copytree(str(out) + ".backup", out, symlinks=True)
    third = fedmf()
    assert third.returncode == 2 and third.stdout == ""
    assert third.stderr.startswith("fedmf: error: the release witness ") and third.stderr.count("\n") == 1
    assert "shows round 3 committed but the ledger's last committed round is 1 of run 1" in third.stderr
    assert [json.loads(line)["round"] for line in (out / ROUND_LOG).read_text().splitlines()] == [0, 1]


def test_a_resumed_run_says_the_round_it_resumed_from(tmp_path, capsys):
    """In process with progress (fedmf simulate's path): one line naming the round it goes on with."""
    run_dir = tmp_path / "run"
    train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir, rounds=2,
          witness=tmp_path / "w", progress=True)
    assert "resumed" not in capsys.readouterr().err
    train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
          witness=tmp_path / "w", progress=True)
    err = capsys.readouterr().err
    assert err.startswith(f"fedmf: resumed run 1 at round 2: rounds 0-1 of {ROUNDS} were committed before\n")
    train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
          witness=tmp_path / "w", progress=True)
    assert capsys.readouterr().err.startswith(f"fedmf: resumed run 1 after its last round {ROUNDS - 1}: rounds "
                                              f"0-{ROUNDS - 1} of {ROUNDS} were committed before")


def test_the_witness_directory_and_the_parents_it_creates_are_0700_even_with_a_permissive_umask(tmp_path):
    """``Witness.directory`` makes every missing directory on the way 0700 (``mkdir(parents=True)``
    would make the parents 0777 under umask 0, and the path check would then refuse them)."""
    import stat

    where = tmp_path / "state" / "fedmf" / "witness"
    old = os.umask(0)
    try:
        assert Witness.directory(where) == where
    finally:
        os.umask(old)
    for made in (where, where.parent, where.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert Witness.directory(where) == where  # and again: nothing to create, still accepted


def _ledger_genesis(run_dir: Path) -> str:
    secret = (run_dir / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(str(run_dir / "ledger.db"), secret=secret) as book:
        return book.run(1).info.genesis_sha256


def test_a_new_run_writes_its_genesis_line_before_round_0_and_a_lost_witness_is_refused_from_then_on(tmp_path):
    """REVIEW-i36-privacy-path LOW-3: the witness file's first line, the run's ledger genesis at round
    -1, is written when the run is created; at round 0's first event and at its commit it is the only
    line. A stop before round 0 commits resumes; the same stop with the witness file lost (or in another
    directory) is refused, though no round was committed."""
    run_dir, witness, seen = tmp_path / "run", tmp_path / "witness", []

    def events(name, t):
        if (name, t) in (("guarded", 0), ("committed", 0)):
            (path,) = witness.iterdir()
            seen.append((name, [json.loads(line) for line in path.read_text().splitlines()]))

    assert _train(run_dir, witness=witness, stop=("stepped", 0), events=events) is None
    assert _train(run_dir, witness=witness, rounds=1, events=events) is not None
    genesis = _ledger_genesis(run_dir)
    line = {"v": 1, "run_id": 1, "genesis_sha256": genesis, "round": -1, "chain_sha256": genesis}
    assert seen == [("guarded", [line]), ("guarded", [line]), ("committed", [line])]
    (path,) = witness.iterdir()
    assert path.read_text().splitlines()[0] == json.dumps(line, sort_keys=True)
    assert [e["round"] for e in _witness_entries(witness)] == [0]

    other_run = tmp_path / "other"
    assert _train(other_run, witness=witness, stop=("stepped", 0)) is None
    (_, other_path) = sorted(witness.iterdir(), key=lambda p: p != path)
    other_path.unlink()
    with pytest.raises(CheckpointError, match=r"of run 1 is missing or empty, but it is written when a run is created"):
        _train(other_run, witness=witness)
    assert not other_path.exists()


def test_a_witness_file_of_an_earlier_fedmf_without_a_genesis_line_resumes(tmp_path):
    """A witness written before the genesis line existed (rounds >= 0 only, run.json without its
    "witness" key), the server stopped between round 2's commit and its witness line: the resume
    accepts it, records round 2 first, goes on, and adds no genesis line to it."""
    run_dir, witness, released = tmp_path / "run", tmp_path / "witness", []
    assert _train(run_dir, witness=witness, stop=("committed", 2), released=released) is None
    (path,) = witness.iterdir()
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))  # the legacy format
    recorded = json.loads((run_dir / "run.json").read_text())
    del recorded["witness"]
    (run_dir / "run.json").write_text(json.dumps(recorded))
    assert _train(run_dir, witness=witness, released=released) is not None
    assert released == list(range(ROUNDS))
    heads = _ledger_rounds(str(run_dir / "ledger.db"), run_dir)
    assert [(e["round"], e["chain_sha256"]) for e in map(json.loads, path.read_text().splitlines())] == heads


def test_a_genesis_line_that_is_not_the_ledgers_is_refused(tmp_path):
    """The genesis line's head must be the ledger's genesis (the file is named by it); another head,
    or a genesis line of another run's genesis, is refused in one line."""
    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    assert _train(run_dir, witness=witness, rounds=1) is not None
    (path,) = witness.iterdir()
    original = path.read_text()
    first, rest = original.split("\n", 1)
    line = json.loads(first)
    path.write_text(json.dumps({**line, "chain_sha256": "0" * 64}) + "\n" + rest)
    with pytest.raises(CheckpointError, match="holds a genesis line whose hash is not the run's ledger genesis"):
        _train(run_dir, witness=witness, rounds=2)
    path.write_text(json.dumps({**line, "genesis_sha256": "0" * 64, "chain_sha256": "0" * 64}) + "\n" + rest)
    with pytest.raises(CheckpointError, match="holds entries of another run"):
        _train(run_dir, witness=witness, rounds=2)
    path.write_text(original)
    assert _train(run_dir, witness=witness, rounds=2) is not None
