"""A run directory, its secrets/ and a SQLite ledger that another user could write are refused
(issue 23, item 4): group- or world-writable (0777, 0770) or owned by another user — one line,
before anything is written or read from them, in process and through `fedmf simulate`."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from fedmf.cli import main
from fedmf.errors import FedmfError
from fedmf.run.federated import train
from tests import _federated_task as task

TARGETS = {"run directory": ".", "secrets directory": "secrets", "SQLite ledger": "ledger.db"}


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _resume(directory: Path):
    return train(task.Tiny(), task.users(), task.plan(rounds=4), task.local_update, checkpoint_dir=directory)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run directory after 2 of 4 rounds (secrets, checkpoints, the SQLite ledger inside)."""
    directory = tmp_path_factory.mktemp("private") / "run"
    train(task.Tiny(), task.users(), task.plan(rounds=4), task.local_update, checkpoint_dir=directory, rounds=2)
    return directory


@pytest.mark.parametrize("mode", [0o777, 0o770])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_group_or_world_writable_path_is_refused_in_one_line(tmp_path, finished, target, mode):
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    path = run / TARGETS[target]
    path.chmod(mode)
    before = _snapshot(run)
    with pytest.raises(FedmfError) as caught:
        _resume(run)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{target} '") and f"{path.name}' has" in message
    assert f"has mode {mode:o}" in message and "by group or others" in message
    assert _snapshot(run) == before  # nothing written, nothing resumed
    path.chmod(0o600 if path.is_file() else 0o700)
    assert _resume(run).rounds_done == 4  # and with the mode fixed it resumes


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_path_owned_by_another_user_is_refused_in_one_line(tmp_path, finished, target, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    owner = (run / TARGETS[target]).stat().st_uid
    real = os.geteuid
    # everything else is owned by the running user: only the target looks foreign
    paths = {os.path.abspath(run / TARGETS[target])}
    original_stat = Path.stat

    def stat_as_other(self, *args, **kwargs):
        info = original_stat(self, *args, **kwargs)
        if os.path.abspath(self) in paths:
            values = list(info)
            values[stat.ST_UID] = owner + 1
            return os.stat_result(values)
        return info

    monkeypatch.setattr(Path, "stat", stat_as_other)
    with pytest.raises(FedmfError) as caught:
        _resume(run)
    message = str(caught.value)
    assert "\n" not in message and target in message and f"is owned by uid {owner + 1}" in message
    assert f"(uid {real()})" in message


def test_fedmf_simulate_refuses_a_world_writable_output_directory(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    assert main(["simulate", "--preset", "tiny", "--rounds", "6", "--out", str(out), "--no-plot", "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"fedmf: error: run directory {str(out)!r} has mode 777"), err
    assert list(out.iterdir()) == []


def test_a_sqlite_ledger_that_is_a_dangling_symlink_is_refused_in_one_line(tmp_path, capsys):
    from fedmf.ledger import Ledger
    from fedmf.ledger.db import LedgerError

    link = tmp_path / "ledger.db"
    link.symlink_to(tmp_path / "gone" / "ledger.db")
    expected = f"SQLite ledger {str(link)!r} cannot be used: No such file or directory (a symbolic link to nothing)"
    with pytest.raises(LedgerError) as caught:
        Ledger.open(str(link), secret=b"k" * 32)
    assert str(caught.value) == expected
    run_dir = tmp_path / "run"
    with pytest.raises(LedgerError, match="a symbolic link to nothing"):
        train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, checkpoint_dir=run_dir, ledger=link)
    assert main(["audit", "--ledger", str(link)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedmf: error:"), err
    assert link.is_symlink() and not (tmp_path / "gone").exists()  # nothing created behind the link
