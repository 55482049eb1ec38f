"""Each round is released at most once with its noise (issue 23, item 2).

Every attempt of a round keys its fresh Gaussian draws by a new random salt (fedmf.round.draws), and
the salts of committed rounds live in the checkpoint: a resumed run reproduces the committed
rounds' noise exactly, while a redone round, a round released again from a restored backup (the
SQLite ledger inside the run directory), or a copy of the seed in a new run all draw new noise.
Where something outside the run directory knows better (an external ledger), a run directory
older than the ledger's last committed round is refused in one line. Each unsafe behaviour is
shown to come back with ``repeatable_noise=True`` (the test-only mode), so the checks can fail.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmf import MinSep, Workload
from fedmf.errors import CheckpointError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.noise import NoiseGenerator
from fedmf.run.checkpoint import CheckpointStore
from fedmf.run.federated import train
from tests import _federated_task as task

ROUNDS, LR, USERS_PER_ROUND = 8, 0.3, 10


class Stop(Exception):
    """Raised from an event hook: the process stops at that point (as a crash would)."""


def _plan(kind: str = "bisr") -> RunPlan:
    # bisr: a banded C^-1 whose past fresh draws are regenerated from the seed (and salts) on resume
    schema = MinSep(task.MIN_SEP, 2)
    mech = build(kind, ROUNDS, schema, Workload(momentum=0.5), num_bands=3)
    return RunPlan.create(mech, schema, clip_norm=1.0, delta=1e-5, expected_users=USERS_PER_ROUND,
                          noise_multiplier=0.8)


def _zeros(params, user, t):
    return {k: torch.zeros_like(v) for k, v in params.items()}


def _constant(value: float):
    def update(params, user, t):  # norm 0.1·sqrt(10) < ζ = 1: never clipped
        return {k: torch.full_like(v, value) for k, v in params.items()}
    return update


def _flat(params) -> np.ndarray:
    return torch.cat([v.detach().reshape(-1) for v in params.values()]).double().cpu().numpy()


def _train(directory, update, *, stop=None, rounds=None, ledger=None, repeatable=False, released=None, witness=None):
    """Train a float64 Tiny model (resuming from ``directory``); ``stop=(event, t)`` raises Stop
    there; ``released[t]`` collects the model released after round t; ``witness``: the release
    witness's directory (None: the session's temporary XDG_STATE_HOME, tests/conftest.py)."""
    model = task.Tiny(torch.float64)

    def on_event(name, t):
        if (name, t) == stop:
            raise Stop(f"{name} {t}")

    def on_round(record):
        if released is not None:
            released[record.round] = _flat(dict(model.named_parameters()))

    try:
        train(model, task.users(), _plan(), update, server_lr=LR, checkpoint_dir=directory, rounds=rounds,
              ledger=ledger, on_event=on_event, on_round=on_round, repeatable_noise=repeatable, witness=witness)
    except Stop:
        return None
    return model


def _expected_models(directory: Path, salts: list[bytes], theta0: np.ndarray) -> np.ndarray:
    """θ_{t+1} = θ_0 + η·(A·σC⁻¹Z/m)_t for all-zero updates, Z keyed by the given salts."""
    plan = _plan()
    seed = (directory / "secrets" / "noise_seed").read_bytes()[:32]  # after it: the binding to its run
    layout = {k: tuple(v.shape) for k, v in task.Tiny(torch.float64).named_parameters()}
    gen = NoiseGenerator(plan.mechanism, layout, plan.noise_std, dtype=torch.float64, device="cpu", seed=seed,
                         salted=True)
    noise = np.stack([_flat(gen.next(salt=s)) for s in salts])
    a = plan.mechanism.workload.matrix(len(salts))
    return theta0 + LR * (a @ noise) / USERS_PER_ROUND


def test_a_redone_round_gets_new_noise_and_committed_rounds_resume_exactly(tmp_path):
    """A stop after round 2's commit, then one inside round 5 (checkpoint written, not committed),
    then the rest: every released model is θ_0 + η·A·σC⁻¹Z/m for the Z keyed by the salts the
    last checkpoint holds (past draws regenerated from seed and salts after each resume: exact);
    round 5's first attempt had another salt and another model, and was never released."""
    theta0 = _flat(dict(task.Tiny(torch.float64).named_parameters()))
    released: dict[int, np.ndarray] = {}
    assert _train(tmp_path, _zeros, stop=("committed", 2), released=released) is None
    assert _train(tmp_path, _zeros, stop=("checkpointed", 5), released=released) is None
    first_attempt = CheckpointStore(tmp_path).load(5, None)  # the uncommitted round's own checkpoint
    first_salt = bytes.fromhex(first_attempt["privatizer"]["noise"]["salts"][5])
    assert _train(tmp_path, _zeros, released=released) is not None
    # round 2 committed but its release was cut: the resume releases its record with its committed model
    # (fedmf.run.loop.recover_records), before round 3; round 5 once
    assert sorted(released) == list(range(ROUNDS))

    salts = task.checkpoint_salts(tmp_path)
    assert len(salts) == ROUNDS and len(set(salts)) == ROUNDS and all(len(s) == 16 for s in salts)
    assert first_salt != salts[5] and first_attempt["privatizer"]["noise"]["salts"][:5] == [s.hex() for s in
                                                                                          salts[:5]]
    expected = _expected_models(tmp_path, salts, theta0)
    for t, got in released.items():
        np.testing.assert_allclose(got, expected[t], rtol=1e-12, atol=1e-14, err_msg=f"round {t}")
    abandoned = _flat(first_attempt["model"])
    assert np.linalg.norm(abandoned - released[5]) > 1e-3  # fresh noise, not the first attempt's


def test_the_same_stops_in_repeatable_mode_redo_a_round_with_the_same_noise(tmp_path):
    """The control: without salts the redo of round 5 repeats the first attempt's model exactly."""
    released: dict[int, np.ndarray] = {}
    _train(tmp_path, _zeros, stop=("checkpointed", 5), released=released, repeatable=True)
    abandoned = _flat(CheckpointStore(tmp_path).load(5, None)["model"])
    _train(tmp_path, _zeros, released=released, repeatable=True)
    np.testing.assert_array_equal(abandoned, released[5])


def _release_twice(tmp_path: Path, repeatable: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """Train rounds 0-3, back up the run directory (SQLite ledger inside), release round 4 with
    all-zero updates, restore the backup and release round 4 again with every user sending a
    constant update. Returns both releases and the number of users summed. The release witness
    refuses the second release (test_release_witness.py); it is off here (witness="off", tests only)
    to show the layer below it: per-attempt salts."""
    run, backup = tmp_path / "run", tmp_path / "backup"
    task.write_secrets(run)
    _train(run, _zeros, rounds=4, repeatable=repeatable, witness="off")
    shutil.copytree(run, backup, symlinks=True)
    first: dict[int, np.ndarray] = {}
    _train(run, _zeros, rounds=5, repeatable=repeatable, released=first, witness="off")
    shutil.rmtree(run)
    shutil.copytree(backup, run, symlinks=True)
    second: dict[int, np.ndarray] = {}
    _train(run, _constant(0.1), rounds=5, repeatable=repeatable, released=second, witness="off")
    with sqlite3.connect(run / "ledger.db") as db:
        (contributed,) = db.execute("SELECT COUNT(*) FROM participations WHERE round_index = 4 AND "
                                    "status = 'contributed'").fetchone()
    return first[4], second[4], contributed


def test_a_restored_run_directory_releases_a_round_again_only_with_new_noise(tmp_path):
    """The attack: the difference of two releases of round 4 is η·A[4,4]·(Δsum + Δnoise)/m. With
    repeatable noise it is the noiseless difference of the clipped sums (control); with salts it
    carries the difference of two independent draws, σ·(z − z')/C[4,4] in every coordinate."""
    plan = _plan()
    scale = LR * plan.mechanism.workload.matrix(ROUNDS)[4, 4] / USERS_PER_ROUND
    for repeatable in (True, False):
        first, second, users = _release_twice(tmp_path / str(repeatable), repeatable)
        assert users > 0
        delta_sum = users * 0.1 * np.ones_like(first)
        residual = (second - first) / scale - delta_sum  # the noise difference the attacker is left with
        if repeatable:
            np.testing.assert_allclose(residual, 0.0, atol=1e-9)  # the unsafe mode leaks the sum
        else:
            c44 = plan.mechanism.strategy_matrix()[4, 4]
            # entries N(0, 2σ²/C44²): 10 of them all below σ/(10·C44) has probability < 1e-10
            assert np.abs(residual).max() > plan.noise_std / (10 * c44)


def test_copied_secrets_in_a_new_run_directory_draw_new_noise(tmp_path):
    """Only the three secret files copied into a new directory with a new ledger: the seed is
    the same, the released noise is not (it is with repeatable noise: the control)."""
    for repeatable in (True, False):
        a, b = tmp_path / f"a{repeatable}", tmp_path / f"b{repeatable}"
        task.write_secrets(a)
        task.share_secrets(a, b)
        models = [_flat(dict(_train(d, _zeros, rounds=2, repeatable=repeatable).named_parameters()))
                  for d in (a, b)]
        if repeatable:
            np.testing.assert_array_equal(models[0], models[1])
        else:
            assert np.abs(models[0] - models[1]).max() > 1e-3


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_run_directory_older_than_an_external_ledger_is_refused_in_one_line(tmp_path, backend, request):
    """The ledger (outside the run directory) says round 4 was committed; the run directory,
    restored from a backup, holds round 2's checkpoint: resuming is refused, naming both rounds."""
    ledger = str(tmp_path / "ledger.db") if backend == "sqlite" else request.getfixturevalue("pg_url")
    run, backup = tmp_path / "run", tmp_path / "backup"
    _train(run, _zeros, rounds=3, ledger=ledger)
    shutil.copytree(run, backup, symlinks=True)
    _train(run, _zeros, rounds=5, ledger=ledger)
    shutil.rmtree(run)
    shutil.copytree(backup, run, symlinks=True)
    with pytest.raises(CheckpointError) as info:
        _train(run, _zeros, ledger=ledger)
    message = str(info.value)
    assert "\n" not in message and "round 4 was committed" in message and "up to round 2" in message
    assert CheckpointStore(run).rounds() == [2]  # nothing written: the directory is as restored


def test_the_server_app_reports_a_rolled_back_run_directory_in_one_line(tmp_path, caplog):
    """Through the ServerApp's main: the refusal is its usual one-line error."""
    from flwr.app import Context, RecordDict

    from fedmf.tasks import ClientHyper, get_task
    from server.app import ServerAppError, main
    from server.config import ServerConfig
    from server.local_grid import LocalGrid

    values = {"task": "tiny", "task-options": '{"num_users": 12}', "mechanism": "bsr", "rounds": 6, "min-sep": 2,
              "clients-per-round": 4, "noise-multiplier": 0.7, "run-dir": str(tmp_path / "run"),
              "ledger-url": str(tmp_path / "ledger.db"), "reply-timeout": 5.0}
    config = ServerConfig.from_mapping(values)
    tiny = get_task("tiny", num_users=12)
    update = tiny.as_local_update(ClientHyper(config.client_lr, config.local_epochs, config.batch_size))

    def run_to(rounds):
        train(tiny.model(), tiny.users(), config.build_plan(), update, server_lr=config.server_lr,
              checkpoint_dir=config.run_dir, ledger=config.ledger_url, rounds=rounds)

    run_to(1)
    shutil.copytree(tmp_path / "run", tmp_path / "backup", symlinks=True)
    run_to(3)
    shutil.rmtree(tmp_path / "run")
    shutil.copytree(tmp_path / "backup", tmp_path / "run", symlinks=True)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=values)
    logger = logging.getLogger("fedmf.server")
    saved = (logger.handlers[:], logger.level, logger.propagate)  # main() installs its stderr handler
    try:
        with caplog.at_level(logging.ERROR, logger="fedmf.server"), pytest.raises(ServerAppError) as info:
            main(LocalGrid({}), context)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    line = str(info.value)
    assert line.startswith("fedmf: error: the ledger says round 2 was committed") and "up to round 0" in line
    assert "\n" not in line


def test_no_salt_appears_in_logs_metrics_or_the_ledger(tmp_path, capfd, caplog):
    """Salts live in the checkpoints only (not secret alone, but nothing else needs them)."""
    records = []
    with caplog.at_level(logging.DEBUG):
        model = task.Tiny(torch.float64)
        train(model, task.users(), _plan(), task.local_update, checkpoint_dir=tmp_path, rounds=4,
              on_round=records.append, progress=True)
    salts = task.checkpoint_salts(tmp_path)
    forms = [f for s in salts for f in (s, s.hex().encode(), s.hex().upper().encode())]
    out, err = capfd.readouterr()
    hay = {"stdout": out.encode(), "stderr": err.encode(), "logs": caplog.text.encode(),
           "metrics": repr(records).encode(), "run.json": (tmp_path / "run.json").read_bytes()}
    for path in tmp_path.iterdir():
        if path.name.startswith("ledger.db"):
            hay[path.name] = path.read_bytes()
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        hay["ledger dump"] = "\n".join(db.iterdump()).encode()
    assert "ledger.db" in hay and len(salts) == 4
    for where, blob in hay.items():
        assert not any(f in blob for f in forms), where
    assert salts[-1].hex().encode() in (tmp_path / "round-000003.pt").read_bytes()  # the search can find them


def test_a_noise_seed_copied_from_a_used_run_is_refused_in_one_line(tmp_path):
    """The seed file carries its binding to the run that used it (run.json records it): copying
    only the three secret files into a new directory, or swapping a run's seed file for a copy
    bound elsewhere, is refused in one line."""
    run = tmp_path / "run"
    _train(run, _zeros, rounds=1)
    seed_file = run / "secrets" / "noise_seed"
    binding = json.loads((run / "run.json").read_text())["noise_seed_binding"]
    assert seed_file.read_bytes()[32:].hex() == binding and len(binding) == 32
    assert oct(seed_file.stat().st_mode & 0o777) == "0o600"

    copy = tmp_path / "copy"
    (copy / "secrets").mkdir(mode=0o700, parents=True)
    copy.chmod(0o700)
    for name in ("noise_seed", "schedule_key", "ledger_secret"):  # the secrets only, not noise_seed.used
        shutil.copy2(run / "secrets" / name, copy / "secrets" / name)
    with pytest.raises(CheckpointError) as info:
        _train(copy, _zeros, rounds=1)
    message = str(info.value)
    assert "\n" not in message and "is bound to another run" in message and "noise is never reused" in message
    assert not (copy / "run.json").exists() and not list(copy.glob("*.pt"))

    other = bytes(16)  # the same seed bound to another run: the run in run.json is not its run
    seed_file.write_bytes(seed_file.read_bytes()[:32] + other)
    with pytest.raises(CheckpointError, match="is not bound to the run run.json names") as info:
        _train(run, _zeros, rounds=2)
    assert "\n" not in str(info.value)
    seed_file.write_bytes(seed_file.read_bytes()[:32] + bytes.fromhex(binding))
    assert _train(run, _zeros, rounds=2) is not None  # its own binding back: it resumes


def _round(run, users):
    selection = run.select(users)
    run.aggregate({u: task.local_update(dict(run.model.named_parameters()), u, selection.round)
                   for u in selection.selected})
    return run.commit()


def test_a_run_directory_is_used_by_one_server_at_a_time(tmp_path):
    """A second server on a run directory could take an open round over while the first one
    still writes that round's files (their noise never released): the second opener is refused
    in one line while the first holds the directory, in this process or another; a SIGKILLed
    holder frees it (the OS drops the lock), so a crashed server still resumes."""
    import subprocess
    import sys

    from fedmf.run.private_run import PrivateRun

    run_dir, users, plan = tmp_path / "run", task.users(), task.plan(rounds=ROUNDS)
    first = PrivateRun.open(task.Tiny(), plan, run_dir, population=users)
    _round(first, users)
    first.select(users)  # round 1 open
    writing = run_dir / ".round-000001.pt.999.tmp"  # the holder's checkpoint being written
    writing.write_bytes(b"half")
    with pytest.raises(CheckpointError) as info:
        PrivateRun.open(task.Tiny(), plan, run_dir, population=users)
    assert writing.exists()  # the refused opener touched nothing of the holder's
    assert str(info.value) == f"run directory {str(run_dir)!r} is in use by another process (a server running on " \
                              "it): stop that one first; one directory, one server"
    first.close()  # aborts round 1 and frees the directory
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom fedmf.run.private_run import PrivateRun\nfrom tests import _federated_task as t\n"
         "r = PrivateRun.open(t.Tiny(), t.plan(rounds=int(sys.argv[2])), sys.argv[1], population=t.users())\n"
         "print(r.next_round, flush=True)\nsys.stdin.read()", str(run_dir), str(ROUNDS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert child.stdout.readline().strip() == "1"
        with pytest.raises(CheckpointError, match="is in use by another process"):
            PrivateRun.open(task.Tiny(), plan, run_dir, population=users)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -9
    with PrivateRun.open(task.Tiny(), plan, run_dir, population=users) as resumed:
        assert resumed.next_round == 1 and _round(resumed, users).round == 1
    assert not writing.exists()  # the holders that got the lock removed what a killed process left


def test_repeatable_noise_is_logged_and_recorded_in_run_json(tmp_path, caplog):
    """repeatable_noise=True warns on the "fedmf" logger however it is turned on, and run.json
    says how the run's noise is keyed; a run ever resumed unsalted stays marked unsafe."""
    from fedmf.run.private_run import PrivateRun

    def open_and_close(directory, repeatable):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedmf"):
            PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), directory, population=task.users(),
                            repeatable_noise=repeatable).close()
        warnings = [r for r in caplog.records if r.name == "fedmf" and r.levelno == logging.WARNING]
        assert len(warnings) == repeatable and all("UNSAFE" in r.getMessage() for r in warnings)
        return json.loads((directory / "run.json").read_text())["noise_salts"]

    assert open_and_close(tmp_path / "unsafe", True) == "repeatable-unsafe"
    assert open_and_close(tmp_path / "safe", False) == "per-attempt"
    assert open_and_close(tmp_path / "safe", False) == "per-attempt"
    assert open_and_close(tmp_path / "safe", True) == "repeatable-unsafe"
    assert open_and_close(tmp_path / "safe", False) == "repeatable-unsafe"


def test_a_start_interrupted_after_binding_the_seed_says_what_to_do(tmp_path, monkeypatch):
    """A crash between binding the noise seed and writing run.json leaves a bound seed and no
    run.json: the next start names that case (not only a copied seed) and what to remove; done
    so, the run starts."""
    from fedmf.ledger import Ledger
    from fedmf.run.private_run import PrivateRun

    def crash(*args, **kwargs):
        raise Stop("killed")

    run_dir, plan = tmp_path / "run", task.plan(rounds=ROUNDS)
    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "create_run", crash)
        with pytest.raises(Stop):
            PrivateRun.open(task.Tiny(), plan, run_dir, population=task.users())
    assert not (run_dir / "run.json").exists() and (run_dir / "initial.pt").exists()
    with pytest.raises(CheckpointError) as info:
        PrivateRun.open(task.Tiny(), plan, run_dir, population=task.users())
    message = str(info.value)
    assert "\n" not in message and "stopped before writing run.json" in message
    assert "remove its secrets/ and initial.pt" in message and "noise is never reused" in message
    shutil.rmtree(run_dir / "secrets")
    (run_dir / "initial.pt").unlink()
    with PrivateRun.open(task.Tiny(), plan, run_dir, population=task.users()) as run:
        assert run.next_round == 0 and _round(run, task.users()).round == 0
