"""Checkpoint store and secrets: atomic files, hashes, write-once noise tensors, 0600 secrets."""

from __future__ import annotations

import os
import re
import stat

import pytest
import torch

from fedmf import MinSep
from fedmf.errors import CheckpointError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.checkpoint import CheckpointStore, RunSecrets, load_or_create_secret

N, B, K = 16, 4, 4
LAYOUT = {"w": (64, 32), "b": (32,)}
SEED = b"checkpoint-test-seed-0123456789"
TENSOR_BYTES = (64 * 32 + 32) * 4


def _privatizer(kind="bsr", bands=4):
    mech = build(kind, N, MinSep(B, K), num_bands=bands)
    plan = RunPlan.create(mech, MinSep(B, K), clip_norm=1.0, delta=1e-5, expected_users=3, noise_multiplier=1.0)
    return RoundPrivatizer(plan, LAYOUT, device="cpu", seed=SEED, repeatable_noise=True)


def _run(privatizer, t):
    g = torch.Generator().manual_seed(t)
    return privatizer.privatize(t, {"u": {k: torch.randn(s, generator=g) for k, s in LAYOUT.items()}})[0]


def test_secret_files_are_0600_stable_and_refused_when_readable_by_others(tmp_path):
    path = tmp_path / "secrets" / "noise_seed"
    first = load_or_create_secret(path)
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == first
    os.chmod(path, 0o644)
    with pytest.raises(CheckpointError, match="mode 644"):
        load_or_create_secret(path)
    secrets = RunSecrets(tmp_path / "other")
    assert len({secrets.noise_seed, secrets.schedule_key, secrets.ledger_secret}) == 3
    assert "secret" in repr(secrets) and secrets.noise_seed.hex() not in repr(secrets)


def test_banded_noise_state_is_written_once_per_round_and_restores_exactly(tmp_path):
    store = CheckpointStore(tmp_path)
    privatizer = _privatizer("bsr", 4)  # banded C: the state keeps p - 1 = 3 past outputs
    for t in range(6):
        _run(privatizer, t)
        digest = store.save(t, {"privatizer": privatizer.state_dict(), "model": {"w": torch.zeros(2)}})
        if t >= 1:
            # one new noise tensor per round, not the p - 1 the state holds
            assert TENSOR_BYTES <= store.last_bytes < 2 * TENSOR_BYTES
        store.prune(keep=t)
    files = sorted(re.sub(r"-[0-9a-f]{16}\.pt$", ".pt", p.name) for p in tmp_path.iterdir())
    assert files == ["noise-outputs-r000003.pt", "noise-outputs-r000004.pt", "noise-outputs-r000005.pt",
                     "round-000005.pt"]
    restored = _privatizer("bsr", 4)
    restored.load_state_dict(store.load(5, digest)["privatizer"])
    for t in range(6, N):
        expected, got = _run(privatizer, t), _run(restored, t)
        for k in LAYOUT:
            assert torch.equal(expected[k], got[k])


def test_a_noise_file_of_another_attempt_is_never_referenced(tmp_path):
    # two attempts at round 2 (two server processes on one directory, or a refused commit): the
    # refused one writes its round-2 noise file after the committed one; the committed attempt's
    # round-3 checkpoint must restore its own round-2 noise, not the other's
    committed, refused = CheckpointStore(tmp_path), CheckpointStore(tmp_path)
    run, digest = RoundPrivatizer(_privatizer().plan, LAYOUT, device="cpu", seed=SEED), None
    for t in range(2):
        _run(run, t)
        digest = committed.save(t, {"privatizer": run.state_dict()})
    other = RoundPrivatizer(run.plan, LAYOUT, device="cpu", seed=SEED)
    other.load_state_dict(committed.load(1, digest)["privatizer"])
    _run(run, 2)
    committed.save(2, {"privatizer": run.state_dict()})
    (path,) = tmp_path.glob("noise-outputs-r000002*.pt")
    _run(other, 2)  # a fresh salt: other noise
    refused.save(2, {"privatizer": other.state_dict()})
    _run(run, 3)
    digest = committed.save(3, {"privatizer": run.state_dict()})
    mine = run.state_dict()["noise"]["structure"]["outputs"]
    theirs = other.state_dict()["noise"]["structure"]["outputs"]
    assert not torch.equal(mine[-1], theirs[0])  # the two attempts' round-2 noise differ
    restored = committed.load(3, digest)["privatizer"]["noise"]["structure"]["outputs"]
    assert len(restored) == len(mine) == 3
    assert all(torch.equal(a, b) for a, b in zip(restored, mine))
    # a referenced file that no longer holds the tensor in memory is refused, not referenced
    (elsewhere,) = set(tmp_path.glob("noise-outputs-r000002*.pt")) - {path}
    path.write_bytes(elsewhere.read_bytes())
    _run(run, 4)
    with pytest.raises(CheckpointError, match="r000002.*refusing"):
        committed.save(4, {"privatizer": run.state_dict()})


def test_fir_noise_state_writes_no_noise_tensor(tmp_path):
    store = CheckpointStore(tmp_path)
    privatizer = _privatizer("bisr", 4)  # banded C^-1: past draws are regenerated from the seed
    _run(privatizer, 0)
    store.save(0, {"privatizer": privatizer.state_dict()})
    assert [p.name for p in tmp_path.iterdir()] == ["round-000000.pt"]


def test_tampering_and_wrong_hash_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    privatizer = _privatizer("bsr", 4)
    for t in range(3):
        _run(privatizer, t)
        digest = store.save(t, {"privatizer": privatizer.state_dict()})
    with pytest.raises(CheckpointError, match="does not match"):
        store.load(2, "0" * 64)
    (noise_file,) = tmp_path.glob("noise-outputs-r000001-*.pt")
    data = bytearray(noise_file.read_bytes())
    data[-10] ^= 1
    noise_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="noise file"):
        store.load(2, digest)
    (tmp_path / "round-000002.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        store.load(2, None)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        store.load(7, None)


def test_unwritable_directory_is_a_clean_error(tmp_path):
    if os.geteuid() == 0:
        target = tmp_path / "file"
        target.write_text("x")
        with pytest.raises(CheckpointError):
            CheckpointStore(target / "sub")
    else:
        os.chmod(tmp_path, 0o500)
        with pytest.raises(CheckpointError):
            CheckpointStore(tmp_path).save(0, {"a": torch.zeros(1)})


def test_checkpoints_are_private_files_in_a_private_directory(tmp_path):
    store = CheckpointStore(tmp_path / "run")
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    privatizer = _privatizer("bsr", 4)
    _run(privatizer, 0)
    store.save(0, {"privatizer": privatizer.state_dict()})
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "run").iterdir()}
    assert modes and set(modes.values()) == {0o600}, modes
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(CheckpointError, match="chmod 700"):
        CheckpointStore(shared)
