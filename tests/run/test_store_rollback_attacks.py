"""Independent review of issue 34 items 1, 3 and 5 (docs/reviews/REVIEW-i34-release-once.md): one
regression test per finding. Fixed findings are plain tests; the open ones are xfail(strict=True)
with the reason, so that a fix turns them into failures to be unmarked.

The attacks run the tiny task (tests/_federated_task.py) in process, with a SQLite ledger outside the
run directory (what a PostgreSQL ledger is to the run directory: a store restored on its own).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from fedmf.errors import CheckpointError
from fedmf.run.federated import train
from fedmf.run.witness import Witness
from tests import _federated_task as task

ROUNDS = 6


class Stop(Exception):
    """Raised from a hook: the server stops there, as a crash would."""


def _train(run_dir, *, ledger, witness=None, rounds, stop_at_evaluation=None, backup_at=None):
    """Train or resume the tiny task. ``stop_at_evaluation=t``: stop inside round t's evaluation (the
    evaluation has left the process, the round log line is not written). ``backup_at=(event, t, fn)``:
    call fn at that event. Returns (rounds released by on_round, evaluations made)."""
    released, evaluated = [], []

    def on_event(name, t):
        if backup_at is not None and (name, t) == backup_at[:2]:
            backup_at[2]()

    def evaluate(model):
        evaluated.append(float(model.linear.bias.detach().sum()))
        # a new run evaluates its initial model first: the (t + 2)-th evaluation is round t's
        if stop_at_evaluation is not None and len(evaluated) == stop_at_evaluation + 2:
            raise Stop(f"evaluation of round {stop_at_evaluation}")
        return {"bias-sum": evaluated[-1]}

    try:
        train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
              ledger=ledger, rounds=rounds, witness=witness, on_event=on_event,
              on_round=lambda r: released.append(r.round), evaluate=evaluate)
    except Stop:
        pass
    return released, evaluated


def _sqlite_backup(ledger: Path, to: Path):
    def take():
        source, target = sqlite3.connect(ledger), sqlite3.connect(to)
        source.backup(target)
        source.close()
        target.close()
    return take


def _sqlite_restore(backup: Path, ledger: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(str(ledger) + suffix).unlink(missing_ok=True)
    shutil.copy2(backup, ledger)


def test_a_witness_directory_under_a_directory_others_may_write_is_refused(tmp_path):
    """Finding 1 (fixed): the witness directory's parents were not checked. Under a 0777 non-sticky
    parent (or reached through a link into one) another user could rename the witness directory away;
    the next start made a fresh, empty one and accepted any rollback. Now refused in one line, before
    anything is created."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(CheckpointError) as info:
        Witness.directory(shared / "witness")
    message = str(info.value)
    assert "writable by group or others without the sticky bit" in message and "\n" not in message
    assert not (shared / "witness").exists()
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(CheckpointError, match="without the sticky bit"):
        Witness.directory(link / "witness")
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot rename what they do not own
    assert Witness.directory(shared / "witness") == shared / "witness"
    assert (shared / "witness").stat().st_mode & 0o777 == 0o700


def test_a_ledger_one_round_behind_a_round_whose_evaluation_left_names_both_sides(tmp_path):
    """Finding 2 (fixed): the server stops inside round 2's evaluation (released; its round log line
    not yet written); the ledger alone (outside the run directory) is restored to a backup taken while
    round 2 was open. The resume was refused only because round 1's checkpoint had been pruned, with
    "no checkpoint for round 1"; now the one line names both sides."""
    run_dir, ledger, backup = tmp_path / "run", tmp_path / "ledger.db", tmp_path / "backup.db"
    released, evaluated = _train(run_dir, ledger=ledger, rounds=4, stop_at_evaluation=2,
                                 backup_at=("noised", 2, _sqlite_backup(ledger, backup)))
    assert released == [0, 1] and len(evaluated) == 4  # initial, rounds 0-2: round 2's evaluation left
    _sqlite_restore(backup, ledger)
    with pytest.raises(CheckpointError) as info:
        _train(run_dir, ledger=ledger, rounds=4)
    message = str(info.value)
    assert "shows round 2 committed" in message and "the ledger's last committed round is 1 of run 1" in message
    assert "round-000002.pt" in message and "\n" not in message


def test_a_ledger_restored_to_round_0_open_after_round_0_was_evaluated_is_refused_without_the_witness(tmp_path):
    """Finding 3 (fixed by the witness's genesis line, REVIEW-i36-privacy-path LOW-3): round 0's checkpoint
    beside initial.pt cannot be told from an uncommitted attempt, so a ledger restored to round 0 open
    is caught only by the witness; with the witness lost, the missing witness file is refused."""
    run_dir, ledger, backup = tmp_path / "run", tmp_path / "ledger.db", tmp_path / "backup.db"
    witness = tmp_path / "witness"
    released, evaluated = _train(run_dir, ledger=ledger, witness=witness, rounds=3, stop_at_evaluation=0,
                                 backup_at=("noised", 0, _sqlite_backup(ledger, backup)))
    assert released == [] and len(evaluated) == 2  # round 0's evaluation left the process
    _sqlite_restore(backup, ledger)
    shutil.rmtree(witness)  # lost with its storage, or a start with another witness setting
    with pytest.raises(CheckpointError, match="is missing or empty, .* both stores may have been rolled back"):
        _train(run_dir, ledger=ledger, witness=witness, rounds=3)


def test_both_stores_rolled_back_with_the_witness_directory_changed_are_refused(tmp_path, monkeypatch):
    run_dir, ledger, backup, saved = tmp_path / "run", tmp_path / "ledger.db", tmp_path / "backup.db", tmp_path / "bk"

    def snapshot():
        _sqlite_backup(ledger, backup)()
        shutil.copytree(run_dir, saved, ignore=shutil.ignore_patterns("run.lock"))

    released, _ = _train(run_dir, ledger=ledger, rounds=4, backup_at=("guarded", 2, snapshot))
    assert released == [0, 1, 2, 3]
    shutil.rmtree(run_dir)
    shutil.copytree(saved, run_dir)
    _sqlite_restore(backup, ledger)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "another-state"))
    with pytest.raises(CheckpointError, match="release witness"):
        _train(run_dir, ledger=ledger, rounds=4)


def test_the_witness_holds_no_secret_and_only_public_fields(tmp_path):
    """What the witness file holds: per line v, run_id, genesis_sha256, round, chain_sha256 (the genesis
    line first, at round -1); none of the run's secret bytes (hex or raw) anywhere in it."""
    import json

    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    _train(run_dir, ledger=None, witness=witness, rounds=2)
    (path,) = witness.iterdir()
    data = path.read_bytes()
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert [sorted(e) for e in lines] == [["chain_sha256", "genesis_sha256", "round", "run_id", "v"]] * 3
    assert [e["round"] for e in lines] == [-1, 0, 1]
    for name in ("noise_seed", "schedule_key", "ledger_secret"):
        secret = (run_dir / "secrets" / name).read_bytes()[:32]
        assert len(secret) == 32
        assert secret.hex().encode() not in data and secret not in data


def test_both_stores_rolled_back_with_the_genesis_column_edited_are_refused(tmp_path):
    run_dir, ledger, backup, saved = tmp_path / "run", tmp_path / "ledger.db", tmp_path / "backup.db", tmp_path / "bk"

    def snapshot():
        _sqlite_backup(ledger, backup)()
        shutil.copytree(run_dir, saved, ignore=shutil.ignore_patterns("run.lock"))

    released, _ = _train(run_dir, ledger=ledger, rounds=3, backup_at=("guarded", 1, snapshot))
    assert released == [0, 1, 2]
    shutil.rmtree(run_dir)
    shutil.copytree(saved, run_dir)
    _sqlite_restore(backup, ledger)
    connection = sqlite3.connect(ledger)
    connection.execute("UPDATE runs SET genesis_sha256 = ?", ("ab" * 32,))
    connection.commit()
    connection.close()
    with pytest.raises(CheckpointError, match="does not match its stored genesis hash"):
        _train(run_dir, ledger=ledger, rounds=3)
