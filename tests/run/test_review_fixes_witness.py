"""Independent review of the witness fix (docs/reviews/REVIEW-i36-fixes.md): open findings as strict xfails."""

from __future__ import annotations

import json
import shutil

import pytest

from fedmf.errors import CheckpointError
from fedmf.run.federated import train
from tests import _federated_task as task

ROUNDS = 6


def _train(run_dir, *, witness, rounds=None, released=None):
    def on_round(record):
        if released is not None:
            released.append(record.round)

    return train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
                 rounds=rounds, witness=witness, on_round=on_round)


def test_a_run_started_with_a_witness_is_not_resumed_with_it_off(tmp_path):
    """A run started with the witness, both stores restored from a backup taken after round 1, resumed
    with witness = "off": run.json says "witness": true, so the resume should be refused as the reverse
    case (started off, resumed on) is; today it resumes with a warning and releases rounds 2 and 3 again."""
    run_dir, witness = tmp_path / "run", tmp_path / "witness"
    assert _train(run_dir, witness=witness, rounds=2) is not None
    assert json.loads((run_dir / "run.json").read_text())["witness"] is True
    backup = tmp_path / "backup"
    shutil.copytree(run_dir, backup, symlinks=True)
    assert _train(run_dir, witness=witness, rounds=4) is not None
    shutil.rmtree(run_dir)
    shutil.copytree(backup, run_dir, symlinks=True)
    released: list[int] = []
    with pytest.raises(CheckpointError):
        _train(run_dir, witness="off", released=released)
    assert released == []
