"""Independent privacy review (docs/reviews/REVIEW-i36-privacy-path.md), part B: the release-once
fixes of today. Open findings are strict xfails that fail today."""

from __future__ import annotations

import json
import shutil

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from fedmf.errors import CheckpointError
from fedmf.ledger.chain import genesis_sha256
from fedmf.ledger.models import Run
from tests.run.test_store_rollback_attacks import _sqlite_backup, _sqlite_restore, _train


def test_both_stores_rolled_back_to_round_0_with_a_recomputed_genesis_are_refused(tmp_path):
    run_dir, ledger, backup, saved = tmp_path / "run", tmp_path / "ledger.db", tmp_path / "backup.db", tmp_path / "bk"
    witness = tmp_path / "witness"

    def snapshot():  # after round 0's commit and witness line, before round 1
        _sqlite_backup(ledger, backup)()
        shutil.copytree(run_dir, saved, ignore=shutil.ignore_patterns("run.lock"))

    released, _ = _train(run_dir, ledger=ledger, witness=witness, rounds=3, backup_at=("guarded", 1, snapshot))
    assert released == [0, 1, 2]
    shutil.rmtree(run_dir)
    shutil.copytree(saved, run_dir)
    _sqlite_restore(backup, ledger)
    engine = create_engine(f"sqlite:///{ledger}")
    with Session(engine) as session:  # any genesis field edited, the genesis recomputed: run_row_intact holds
        row = session.get(Run, 1)
        row.name = f"{row.name or ''} "
        row.genesis_sha256 = genesis_sha256({c.key: getattr(row, c.key) for c in Run.__table__.columns})
        session.commit()
    engine.dispose()
    with pytest.raises(CheckpointError, match="of run 1 is missing or empty, but it is written when a run is created"):
        again, _ = _train(run_dir, ledger=ledger, witness=witness, rounds=3)
        assert again == [], f"rounds {again} released a second time"
    assert len(list(witness.iterdir())) == 1  # the run's own file, the renamed one never created


def test_a_stop_between_round_0s_commit_and_its_witness_line_resumes(tmp_path):
    """Round 0 committed, the witness holding only the genesis line written at the run's creation: one
    round behind, accepted, recorded first."""
    from tests.run.test_release_witness import _train as train_or_stop
    from tests.run.test_release_witness import _witness_entries

    run_dir, witness, released = tmp_path / "run", tmp_path / "witness", []
    assert train_or_stop(run_dir, witness=witness, stop=("committed", 0), released=released) is None
    assert released == [] and _witness_entries(witness) == []  # the genesis line only (checked there)
    assert train_or_stop(run_dir, witness=witness, released=released) is not None
    assert released[0] == 0 and [e["round"] for e in _witness_entries(witness)] == sorted(set(released))


def test_a_run_with_the_witness_off_then_on_is_refused_after_round_0(tmp_path):
    """witness = "off" (tests only) for rounds 0-1, then on: no witness file, refused in one line that
    says the run was started without one (run.json records it; INFO-5), whatever the rounds committed;
    and with that record gone (a run of an older fedmf), a line that names both causes."""
    from tests.run.test_release_witness import _train as train_or_stop

    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    assert train_or_stop(run_dir, witness="off", rounds=2) is not None
    with pytest.raises(CheckpointError) as info:
        train_or_stop(run_dir, witness=witness)
    assert str(info.value) == ('run 1 was started with witness = "off" (tests only), so it has no release witness and '
                               'cannot be resumed with one: resume it with the witness off, or start a new run in a '
                               'new directory')
    assert not any(witness.iterdir())
    recorded = json.loads((run_dir / "run.json").read_text())
    assert recorded.pop("witness") is False
    (run_dir / "run.json").write_text(json.dumps(recorded))
    with pytest.raises(CheckpointError, match=r'is missing or empty, .*\(or the run was started with witness = "off"\)'):
        train_or_stop(run_dir, witness=witness)
    assert train_or_stop(run_dir, witness="off", rounds=3) is not None  # off again: goes on (tests only)
