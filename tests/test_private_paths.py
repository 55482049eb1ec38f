"""Every directory and symbolic link on the way to a secret, key or ledger file is checked (issue 34,
item 5; ``fedmf.files.check_private_path``): a link into a directory that others may write, a file in
such a directory, a group-writable ancestor or one owned by another user are refused in one line
before anything is written there; the same files reached through safe links, or in a sticky directory
like /tmp, are accepted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedmf.cli import main
from fedmf.enrollment import Enrollment, generate_key_pair, load_private_key
from fedmf.errors import CheckpointError, ConfigError, FedmfError
from fedmf.files import check_private_path
from fedmf.ledger import Ledger, LedgerError
from fedmf.ledger.budgets import load_budget_secret
from fedmf.run.federated import train
from tests import _federated_task as task

AS_ROOT = os.geteuid() == 0
OTHER_UID = 65534  # nobody


def _directory(path: Path, mode: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def _train(run: Path, **kwargs):
    return train(task.Tiny(), task.users(), task.plan(rounds=4), task.local_update, checkpoint_dir=run, rounds=2,
                 **kwargs)


def _one_line(caught: pytest.ExceptionInfo) -> str:
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, FedmfError)
    return message


# ---- the walk itself --------------------------------------------------------------------------
def test_the_walk_follows_links_like_the_kernel_and_checks_every_directory_it_traverses(tmp_path, monkeypatch):
    safe = _directory(tmp_path / "safe", 0o700)
    open_ = _directory(tmp_path / "open", 0o777)
    (safe / "file").write_bytes(b"x")
    (open_ / "inner").mkdir(mode=0o700)
    (safe / "abs").symlink_to(safe / "file")
    (safe / "rel").symlink_to("file")
    (safe / "up").symlink_to("../safe/file")
    (safe / "into-open").symlink_to(open_ / "inner")
    (safe / "chain").symlink_to("into-open")  # link → link → a directory inside the 0777 one
    (safe / "loop").symlink_to("loop")
    for ok in ("file", "abs", "rel", "up", "missing", "missing/deeper", "file/not-a-directory"):
        check_private_path(safe / ok, "secret file")
    monkeypatch.chdir(safe)
    check_private_path("rel", "secret file")  # relative: walked from / through the working directory
    check_private_path("../safe/./file", "secret file")
    for bad in ("into-open/x", "chain/x", "chain"):
        with pytest.raises(ConfigError) as caught:
            check_private_path(safe / bad, "secret file")
        message = _one_line(caught)
        assert message.startswith(f"secret file {str(safe / bad)!r} cannot be trusted: {str(open_)!r} on its path is "
                                  "a directory writable by group or others without the sticky bit (mode 0777")
    with pytest.raises(ConfigError, match="too many levels of symbolic links"):
        check_private_path(safe / "loop", "secret file")
    # the object itself is the caller's: a 0777 directory at the end of the path is not refused here
    check_private_path(open_, "run directory")
    with pytest.raises(ConfigError, match="0777"):
        check_private_path(open_ / "inner", "run directory")
    with pytest.raises(CheckpointError):  # the caller's error class
        check_private_path(open_ / "inner", "run directory", CheckpointError)


@pytest.mark.parametrize("mode", [0o770, 0o775, 0o707, 0o777])
def test_a_group_or_world_writable_ancestor_without_the_sticky_bit_is_refused(tmp_path, mode):
    parent = _directory(tmp_path / "parent", mode)
    run = _directory(parent / "run", 0o700)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}"):
        check_private_path(run / "secrets" / "noise_seed", "secret file")
    parent.chmod(mode | 0o1000)  # the same with the sticky bit: others cannot rename or remove what is ours
    check_private_path(run / "secrets" / "noise_seed", "secret file")


def test_a_sticky_world_writable_directory_like_tmp_is_accepted(tmp_path):
    sticky = _directory(tmp_path / "sticky", 0o1777)
    key = sticky / "budget.key"
    first = load_budget_secret(key, create=True)
    assert load_budget_secret(key).key_check() == first.key_check()
    assert (os.stat("/tmp").st_mode & 0o1777) == 0o1777  # tmp_path lies under it, and every test here passes there


@pytest.mark.skipif(not AS_ROOT, reason="only root can give a directory or a link to another user")
def test_an_ancestor_or_link_owned_by_another_user_is_refused(tmp_path):
    theirs = _directory(tmp_path / "theirs", 0o755)
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(ConfigError, match=f"owned by uid {OTHER_UID}, neither the user running fedmf"):
        check_private_path(theirs / "budget.key", "budget secret")
    sticky = _directory(tmp_path / "sticky", 0o1777)
    mine = _directory(tmp_path / "mine", 0o700)
    (mine / "budget.key").write_bytes(b"k" * 32)
    (mine / "budget.key").chmod(0o600)
    link = sticky / "budget.key"
    link.symlink_to(mine / "budget.key")
    load_budget_secret(link)  # our link in a sticky directory: accepted
    os.chown(link, OTHER_UID, -1, follow_symlinks=False)  # theirs: in a sticky directory its owner may swap it
    with pytest.raises(ConfigError, match=f"the symbolic link {str(link)!r} on its path is owned by uid {OTHER_UID}"):
        check_private_path(link, "budget secret")
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_budget_secret(link)


# ---- where it applies: run secrets, budget key, SQLite ledger, enrollment, user key ----------------------
def test_a_secrets_link_into_a_world_writable_directory_is_refused_before_any_secret_is_written(tmp_path):
    run = _directory(tmp_path / "run", 0o700)
    shared = _directory(tmp_path / "shared", 0o777)  # not sticky: anyone may rename what it holds
    target = _directory(shared / "secrets", 0o700)
    (run / "secrets").symlink_to(target)
    with pytest.raises(CheckpointError) as caught:
        _train(run)
    message = _one_line(caught)
    assert message.startswith(f"secrets directory {str(run / 'secrets')!r} cannot be trusted: {str(shared)!r}")
    assert list(target.iterdir()) == []  # no secret written behind the link
    shared.chmod(0o755)  # the same link into a directory only we may change: accepted
    assert _train(run).rounds_done == 2
    assert {"ledger_secret", "noise_seed", "schedule_key"} <= {p.name for p in target.iterdir()}


def test_a_run_directory_under_a_group_writable_directory_is_refused(tmp_path, capsys):
    parent = _directory(tmp_path / "team", 0o770)
    with pytest.raises(CheckpointError) as caught:
        _train(parent / "run")
    assert _one_line(caught).startswith(f"run directory {str(parent / 'run')!r} cannot be trusted: {str(parent)!r}")
    assert main(["simulate", "--preset", "tiny", "--rounds", "6", "--out", str(parent / "out"), "--no-plot",
                 "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"fedmf: error: run directory {str(parent / 'out')!r} cannot be "
                                               "trusted"), err


def test_a_budget_key_in_a_world_writable_directory_is_refused(tmp_path, capsys):
    shared = _directory(tmp_path / "shared", 0o777)
    key = shared / "budget.key"
    safe = _directory(tmp_path / "safe", 0o700)
    load_budget_secret(safe / "budget.key", create=True)
    os.replace(safe / "budget.key", key)  # a 0600 file, ours, in a 0777 directory
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CheckpointError) as caught:
        load_budget_secret(key)
    assert _one_line(caught).startswith(f"secret file {str(key)!r} cannot be trusted: {str(shared)!r} on its path")
    ledger = str(safe / "ledger.db")
    assert main(["budget", "default", "--ledger", ledger, "--key", str(key), "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "cannot be trusted" in err[0] and str(shared) in err[0], err
    link = safe / "link.key"  # a link in a private directory to the key in the open one: refused too
    link.symlink_to(key)
    with pytest.raises(CheckpointError, match="cannot be trusted"):
        load_budget_secret(link)
    with pytest.raises(CheckpointError, match="cannot be trusted"):
        _train(safe / "run", ledger=ledger, budget_key=link)
    shared.chmod(0o1777)  # sticky: accepted
    assert main(["budget", "default", "--ledger", ledger, "--key", str(link), "100"]) == 0  # room for the run: its rounds are played
    assert _train(safe / "run", ledger=ledger, budget_key=link).rounds_done == 2


def test_a_sqlite_ledger_in_a_world_writable_directory_is_refused(tmp_path):
    shared = _directory(tmp_path / "shared", 0o777)
    with pytest.raises(LedgerError) as caught:
        Ledger.open(str(shared / "ledger.db"), secret=b"k" * 32)
    assert _one_line(caught).startswith(f"SQLite ledger {str(shared / 'ledger.db')!r} cannot be trusted")
    assert list(shared.iterdir()) == []  # refused before the file is created
    with pytest.raises(LedgerError, match="cannot be trusted"):
        _train(_directory(tmp_path / "run", 0o700), ledger=shared / "ledger.db")
    shared.chmod(0o755)
    assert _train(tmp_path / "run", ledger=shared / "ledger.db").rounds_done == 2


def test_an_enrollment_file_or_user_key_below_a_writable_ancestor_is_refused(tmp_path):
    grand = _directory(tmp_path / "grand", 0o777)
    keys = _directory(grand / "keys", 0o700)
    public = generate_key_pair(keys / "user.key")
    Enrollment({"alice": public}).save(keys / "enrollment.json")
    with pytest.raises(ConfigError, match=f"{str(grand)!r} on its path is a directory writable by group or others"):
        Enrollment.load(keys / "enrollment.json")  # the grandparent: only the parent was checked before
    with pytest.raises(ConfigError, match="cannot be trusted"):
        load_private_key(keys / "user.key")
    grand.chmod(0o755)
    assert Enrollment.load(keys / "enrollment.json").users == {"alice": public}
    load_private_key(keys / "user.key")
