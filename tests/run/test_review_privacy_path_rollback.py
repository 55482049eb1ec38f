"""Independent privacy review (docs/reviews/REVIEW-i36-privacy-path.md), part B: the release-once
fixes of today. Open findings are strict xfails that fail today."""

from __future__ import annotations

import shutil

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from fedmf.errors import CheckpointError
from fedmf.ledger.chain import genesis_sha256
from fedmf.ledger.models import Run
from tests.run.test_store_rollback_attacks import _sqlite_backup, _sqlite_restore, _train


@pytest.mark.xfail(strict=True, reason="REVIEW-i36-privacy-path LOW-3: a run row edited with its genesis hash "
                                       "recomputed names an empty witness file; at committed round 0 it is one "
                                       "round behind, accepted, and rounds 1-2 are released again")
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
    with pytest.raises(CheckpointError):
        again, _ = _train(run_dir, ledger=ledger, witness=witness, rounds=3)
        assert again == [], f"rounds {again} released a second time"
