"""The streaming correlated-noise engine: exactness, determinism, checkpoints, shards."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from fedmf.errors import CheckpointError, ConfigError, HorizonReached, PlanMismatch
from fedmf.mechanisms import build, plan
from fedmf.mechanisms.banded import optimize_banded
from fedmf.mechanisms.blt_optimize import optimize_blt
from fedmf.mechanisms.toeplitz import BandedInverseToeplitz
from fedmf.participation import MinSep
from fedmf.round.draws import Draws
from fedmf.round.noise import NoiseGenerator

N = 16
SCHEMA = MinSep(4, 4)
SEED = b"\x07" * 32


def _mechanisms():
    out = {kind: build(kind, N, SCHEMA, num_bands=3 if kind in ("bsr", "bisr", "bifr") else None)
           for kind in ("dp-sgd", "tree", "bsr", "bisr", "bifr")}
    out["banded-toeplitz"] = plan("banded-toeplitz", N, SCHEMA, num_bands=4)[0]
    out["robust"] = plan("robust", N, MinSep(4, 4), min_sep_range=(3, 4), num_bands=4)[0]
    out["banded"] = optimize_banded(N, 3, SCHEMA)[0]
    out["blt"] = optimize_blt(N, SCHEMA)[0]
    try:
        from fedmf.mechanisms.dense_optimize import optimize_dense
        from fedmf.participation import FixedEpoch

        out["dense"] = optimize_dense(N, FixedEpoch(4, 4))[0]
    except ImportError:
        pass
    return out


MECHANISMS = _mechanisms()
KINDS = sorted(MECHANISMS)


def _draws(mech, d, dtype=torch.float64, chunk=5):
    draws = Draws(SEED, d, 0, d, dtype, torch.device("cpu"), chunk)
    return np.array([draws.new(r).numpy() for r in range(mech.noise_rows)])


def _run(gen, rounds):
    return np.array([np.asarray(gen.next()) for _ in range(rounds)])


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_noise_equals_explicit_inverse_times_draws(kind):
    mech, d, std = MECHANISMS[kind], 11, 0.7
    gen = NoiseGenerator(mech, d, std, dtype=torch.float64, device="cpu", seed=SEED, chunk_size=5)
    streamed = _run(gen, N)
    np.testing.assert_allclose(streamed, std * mech.inverse_matrix() @ _draws(mech, d), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_regenerating_past_draws_equals_buffering(kind):
    mech = MECHANISMS[kind]
    a = _run(NoiseGenerator(mech, 9, 1.0, dtype=torch.float64, device="cpu", seed=SEED), N)
    b = _run(NoiseGenerator(mech, 9, 1.0, dtype=torch.float64, device="cpu", seed=SEED, regenerate=True), N)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["bifr", "banded-toeplitz", "blt", "tree"])
def test_same_seed_same_noise_bit_for_bit(kind, dtype):
    mech = MECHANISMS[kind]
    layout = {"w": (3, 4), "b": (5,)}
    g1 = NoiseGenerator(mech, layout, 2.0, dtype=dtype, device="cpu", seed=SEED)
    g2 = NoiseGenerator(mech, layout, 2.0, dtype=dtype, device="cpu", seed=SEED)
    for _ in range(N):
        x, y = g1.next(), g2.next()
        assert set(x) == {"w", "b"} and x["w"].shape == (3, 4) and x["b"].shape == (5,)
        assert x["w"].dtype == dtype
        assert torch.equal(x["w"], y["w"]) and torch.equal(x["b"], y["b"])
    other = NoiseGenerator(mech, layout, 2.0, dtype=dtype, device="cpu", seed=b"\x08" * 32).next()
    assert not torch.equal(other["w"], NoiseGenerator(mech, layout, 2.0, dtype=dtype, device="cpu", seed=SEED).next()["w"])


def test_default_seed_is_fresh_and_secret():
    mech = MECHANISMS["bisr"]
    a = NoiseGenerator(mech, 8, 1.0, device="cpu")
    b = NoiseGenerator(mech, 8, 1.0, device="cpu")
    assert not torch.equal(a.next(), b.next())
    key = a.state_dict()["seed"]
    assert len(key) == 32
    assert key.hex() not in repr(a) and str(list(key)) not in repr(a)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stop", [0, 1, 5, 8, 15])
def test_checkpoint_restore_continues_exactly(kind, stop):
    mech = MECHANISMS[kind]
    full = _run(NoiseGenerator(mech, 10, 1.5, device="cpu", seed=SEED), N)
    gen = NoiseGenerator(mech, 10, 1.5, device="cpu", seed=SEED)
    _run(gen, stop)
    state = pickle.loads(pickle.dumps(gen.state_dict()))
    resumed = NoiseGenerator(mech, 10, 1.5, device="cpu")  # another (random) seed until loaded
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(_run(resumed, N - stop), full[stop:])


def test_checkpoint_survives_a_process_restart(tmp_path):
    mech = MECHANISMS["banded-toeplitz"]
    from fedmf.mechanisms.io import save

    save(mech, tmp_path / "m.json", SCHEMA)
    gen = NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED)
    _run(gen, 5)
    torch.save(gen.state_dict(), tmp_path / "state.pt")
    expected = _run(gen, N - 5)
    script = textwrap.dedent(f"""
        import numpy as np, torch
        from fedmf.mechanisms.io import load
        from fedmf.round.noise import NoiseGenerator
        gen = NoiseGenerator(load({str(tmp_path / 'm.json')!r}), 6, 1.0, device="cpu")
        gen.load_state_dict(torch.load({str(tmp_path / 'state.pt')!r}))
        np.save({str(tmp_path / 'rest.npy')!r}, np.array([gen.next().numpy() for _ in range({N - 5})]))
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    np.testing.assert_array_equal(np.load(tmp_path / "rest.npy"), expected)


def test_load_refuses_a_mismatched_state():
    gen = NoiseGenerator(MECHANISMS["bisr"], 6, 1.0, device="cpu", seed=SEED)
    state = gen.state_dict()
    other = NoiseGenerator(MECHANISMS["bisr"], 7, 1.0, device="cpu")
    with pytest.raises(ValueError, match="total") as info:
        other.load_state_dict(state)
    assert SEED.hex() not in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_horizon_guard(kind):
    gen = NoiseGenerator(MECHANISMS[kind], 3, 1.0, device="cpu")
    _run(gen, N)
    with pytest.raises(HorizonReached, match="never repeated"):
        gen.next()
    assert gen.round == N


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_concatenate_to_the_unsharded_noise(kind, count):
    mech, d = MECHANISMS[kind], 23
    full = _run(NoiseGenerator(mech, d, 1.0, device="cpu", seed=SEED, chunk_size=4), N)
    shards = [NoiseGenerator(mech, d, 1.0, device="cpu", seed=SEED, chunk_size=4, shard=(i, count)) for i in range(count)]
    pieces = [_run(s, N) for s in shards]
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), full)


def test_shard_of_a_running_generator_continues_it():
    mech = MECHANISMS["blt"]
    gen = NoiseGenerator(mech, 17, 1.0, device="cpu", seed=SEED, chunk_size=4)
    head = _run(gen, 6)
    full = np.concatenate([head, _run(NoiseGenerator(mech, 17, 1.0, device="cpu", seed=SEED, chunk_size=4), N)[6:]])
    gen2 = NoiseGenerator(mech, 17, 1.0, device="cpu", seed=SEED, chunk_size=4)
    _run(gen2, 6)
    shards = [gen2.shard(i, 3) for i in range(3)]
    tail = np.concatenate([_run(s, N - 6) for s in shards], axis=1)
    np.testing.assert_array_equal(tail, full[6:])


@pytest.mark.parametrize("kind", ["bifr", "blt", "tree", "banded"])
def test_empirical_covariance_matches_sigma2_l_lt(kind):
    """Coordinates are independent draws of the n-vector of noise: their covariance
    must be sigma^2 L L^T within sampling error."""
    mech, d, std = MECHANISMS[kind], 40_000, 1.3
    noise = _run(NoiseGenerator(mech, d, std, dtype=torch.float64, device="cpu", seed=SEED), N)
    empirical = noise @ noise.T / d
    inv = mech.inverse_matrix()
    expected = std**2 * inv @ inv.T
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))
    assert np.max(np.abs(empirical - expected) / scale) < 6 / np.sqrt(d)


def test_identity_mechanisms_give_iid_gaussian_noise():
    d, std = 50_000, 0.5
    for mech in (MECHANISMS["dp-sgd"], BandedInverseToeplitz(N, np.ones(1))):
        noise = _run(NoiseGenerator(mech, d, std, dtype=torch.float64, device="cpu", seed=SEED), N)
        np.testing.assert_array_equal(noise, std * _draws(mech, d, chunk=1 << 20))
        assert abs(noise.mean()) < 4 * std / np.sqrt(noise.size)
        assert abs(noise.var() / std**2 - 1) < 4 * np.sqrt(2 / noise.size)
        corr = np.corrcoef(noise)
        assert np.max(np.abs(corr - np.eye(N))) < 6 / np.sqrt(d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_close_to_float64(dtype):
    mech = MECHANISMS["banded-toeplitz"]
    a = _run(NoiseGenerator(mech, 1000, 1.0, dtype=dtype, device="cpu", seed=SEED), N)
    assert a.dtype == (np.float32 if dtype == torch.float32 else np.float64)
    assert np.all(np.isfinite(a))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["bifr", "blt", "banded-toeplitz"])
def test_cuda_matches_the_explicit_inverse(kind):
    mech, d = MECHANISMS[kind], 1000
    gen = NoiseGenerator(mech, d, 1.0, dtype=torch.float64, device="cuda", seed=SEED)
    out = np.array([gen.next().cpu().numpy() for _ in range(N)])
    draws = Draws(SEED, d, 0, d, torch.float64, torch.device("cuda"), 1 << 20)
    z = np.array([draws.new(r).cpu().numpy() for r in range(mech.noise_rows)])
    np.testing.assert_allclose(out, mech.inverse_matrix() @ z, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_next_into_a_buffer_on_the_generators_device():
    mech = MECHANISMS["bifr"]
    gen = NoiseGenerator(mech, 1000, 1.0, dtype=torch.float32, device="cuda", seed=SEED)
    buffer = torch.empty(1000, dtype=gen.dtype, device=gen.device)
    fresh = NoiseGenerator(mech, 1000, 1.0, dtype=torch.float32, device="cuda", seed=SEED)
    for _ in range(N):
        assert torch.equal(gen.next(out=buffer), fresh.next())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"std": -1.0}, "std"),
        ({"std": float("nan")}, "std"),
        ({"layout": 0}, "layout"),
        ({"layout": {}}, "layout"),
        ({"shard": (3, 3)}, "shard"),
        ({"dtype": torch.int32}, "dtype"),
        ({"seed": -5}, "seed"),
        ({"seed": b""}, "seed"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"layout": 5, "std": 1.0, **kwargs}
    layout, std = args.pop("layout"), args.pop("std")
    with pytest.raises(ValueError, match=match):
        NoiseGenerator(MECHANISMS["bisr"], layout, std, device="cpu", **args)


@pytest.mark.parametrize("block", [37, 1 << 17])
@pytest.mark.parametrize("kind", KINDS)
def test_chunks_threads_blocks_and_shards_do_not_change_the_noise(kind, block, monkeypatch):
    """Per element the arithmetic is the same whichever thread draws a chunk, how many threads
    there are, how the round is cut into cache blocks and where a shard starts: the noise is
    bit-identical, and equals the explicit L·Z."""
    import fedmf.round.draws as noise_module

    monkeypatch.setattr(noise_module, "BLOCK_SIZE", block)
    mech, d = MECHANISMS[kind], 1001
    reference = _run(NoiseGenerator(mech, d, 0.9, device="cpu", seed=SEED, chunk_size=64), N)
    monkeypatch.setattr(noise_module, "BLOCK_SIZE", 1 << 17)
    np.testing.assert_array_equal(_run(NoiseGenerator(mech, d, 0.9, device="cpu", seed=SEED, chunk_size=64), N),
                                  reference)
    monkeypatch.setattr(noise_module, "BLOCK_SIZE", block)
    shards = [NoiseGenerator(mech, d, 0.9, device="cpu", seed=SEED, chunk_size=64, shard=(i, 3)) for i in range(3)]
    np.testing.assert_array_equal(np.concatenate([_run(s, N) for s in shards], axis=1), reference)
    serial = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _run(NoiseGenerator(mech, d, 0.9, device="cpu", seed=SEED, chunk_size=64), N)
    finally:
        torch.set_num_threads(serial)
    np.testing.assert_array_equal(one_thread, reference)
    gen = NoiseGenerator(mech, 37, 0.9, dtype=torch.float64, device="cpu", seed=SEED, chunk_size=8)
    np.testing.assert_allclose(_run(gen, N), 0.9 * mech.inverse_matrix() @ _draws(mech, 37, chunk=8),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["dp-sgd", "bifr", "banded", "blt", "tree", "dense"])
def test_next_into_a_reused_buffer_equals_fresh_tensors(kind):
    if kind not in MECHANISMS:
        pytest.skip("dense needs torch")
    mech = MECHANISMS[kind]
    fresh = _run(NoiseGenerator(mech, 50, 1.2, device="cpu", seed=SEED, chunk_size=16), N)
    gen = NoiseGenerator(mech, 50, 1.2, device="cpu", seed=SEED, chunk_size=16)
    buffer = torch.full((50,), float("nan"))
    for t in range(N):
        result = gen.next(out=buffer)
        assert result.data_ptr() == buffer.data_ptr()
        np.testing.assert_array_equal(buffer.numpy(), fresh[t])


def test_next_into_a_wrong_buffer_is_refused():
    gen = NoiseGenerator(MECHANISMS["bisr"], 8, 1.0, device="cpu")
    for bad in (torch.empty(7), torch.empty(8, dtype=torch.float64), torch.empty(16)[::2], torch.empty(2, 4)):
        with pytest.raises(ValueError, match="out must be"):
            gen.next(out=bad)
    assert gen.round == 0


def test_a_forked_child_can_still_draw():
    """The draw threads do not survive fork(); a child process (e.g. a simulation worker)
    must make its own and produce the same noise."""
    import multiprocessing

    mech = MECHANISMS["bifr"]
    expected = _run(NoiseGenerator(mech, 300, 1.0, device="cpu", seed=SEED, chunk_size=64), 3)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_noise_in_child, (300,)).get(timeout=60)
    np.testing.assert_array_equal(got, expected)


def _noise_in_child(d):
    return _run(NoiseGenerator(MECHANISMS["bifr"], d, 1.0, device="cpu", seed=SEED, chunk_size=64), 3)


def test_load_refuses_another_std_and_an_older_format():
    """The state is std-scaled (std is folded into the draws): loading it into a generator
    with another std, or loading a format-1 state, would release wrong noise."""
    gen = NoiseGenerator(MECHANISMS["banded-toeplitz"], 6, 1.0, device="cpu", seed=SEED)
    _run(gen, 4)
    state = gen.state_dict()
    with pytest.raises(ValueError, match="std"):
        NoiseGenerator(MECHANISMS["banded-toeplitz"], 6, 5.0, device="cpu").load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        NoiseGenerator(MECHANISMS["banded-toeplitz"], 6, 1.0, device="cpu").load_state_dict({**state, "format": 1})


# ---- state format 3: bound to the mechanism, secret-free, round labels -------------------------
def test_a_state_of_another_mechanism_of_the_same_kind_and_horizon_is_refused():
    """Before format 3 a bisr state with 3 bands loaded into a 4-band bisr generator and went on
    with the wrong noise."""
    three, four = build("bisr", N, SCHEMA, num_bands=3), build("bisr", N, SCHEMA, num_bands=4)
    gen = NoiseGenerator(three, 6, 1.0, device="cpu", seed=SEED)
    _run(gen, 3)
    other = NoiseGenerator(four, 6, 1.0, device="cpu", seed=SEED)
    with pytest.raises(PlanMismatch, match="another mechanism") as info:
        other.load_state_dict(gen.state_dict())
    assert SEED.hex() not in str(info.value) and "\n" not in str(info.value)
    assert other.round == 0
    assert gen.state_dict()["fingerprint"] == three.fingerprint


@pytest.mark.parametrize("fmt", [1, 2, None, "3"])
def test_older_or_unknown_state_formats_are_refused(fmt):
    gen = NoiseGenerator(MECHANISMS["blt"], 6, 1.0, device="cpu", seed=SEED)
    state = {**gen.state_dict(), "format": fmt}
    with pytest.raises(CheckpointError, match="format") as info:
        NoiseGenerator(MECHANISMS["blt"], 6, 1.0, device="cpu").load_state_dict(state)
    assert "\n" not in str(info.value)


def _reference_seed_check(seed: bytes) -> str:
    import hashlib

    return hashlib.blake2b(b"fedmf noise state seed check", key=seed, digest_size=16,
                           person=b"fedmf-seedcheck").hexdigest()


@pytest.mark.parametrize("kind", ["bisr", "banded-toeplitz", "blt", "tree", "dense"])
def test_secret_free_state_continues_only_with_the_same_seed(kind):
    mech = MECHANISMS[kind]
    full = _run(NoiseGenerator(mech, 10, 1.5, device="cpu", seed=SEED), N)
    gen = NoiseGenerator(mech, 10, 1.5, device="cpu", seed=SEED)
    _run(gen, 5)
    state = pickle.loads(pickle.dumps(gen.state_dict(include_seed=False)))
    assert "seed" not in state and state["seed_check"] == _reference_seed_check(SEED)
    assert SEED.hex() not in repr(state) and SEED not in pickle.dumps(state)
    resumed = NoiseGenerator(mech, 10, 1.5, device="cpu", seed=SEED)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(_run(resumed, N - 5), full[5:])
    stranger = NoiseGenerator(mech, 10, 1.5, device="cpu", seed=b"\x08" * 32)
    with pytest.raises(PlanMismatch, match="another seed") as info:
        stranger.load_state_dict(state)
    assert SEED.hex() not in str(info.value) and stranger.round == 0


def test_a_state_without_seed_or_seed_check_is_refused():
    gen = NoiseGenerator(MECHANISMS["bisr"], 6, 1.0, device="cpu", seed=SEED)
    state = gen.state_dict(include_seed=False)
    del state["seed_check"]
    with pytest.raises(CheckpointError, match="neither a seed nor a seed_check"):
        NoiseGenerator(MECHANISMS["bisr"], 6, 1.0, device="cpu", seed=SEED).load_state_dict(state)
    with pytest.raises(ConfigError, match="include_seed"):
        gen.state_dict(include_seed="no")


@pytest.mark.parametrize("kind", KINDS)
def test_structure_round_labels_name_tensors_that_never_change_while_kept(kind):
    """A tensor labeled r first appears in the state written after round r and is bit-identical
    in every later state while it stays; for banded C it is round r's noise itself. Unlabeled
    (None) tensors are the ones that change every round."""
    mech = MECHANISMS[kind]
    gen = NoiseGenerator(mech, 13, 1.1, dtype=torch.float64, device="cpu", seed=SEED, chunk_size=4)
    seen: dict[tuple[str, int], tuple[int, torch.Tensor]] = {}
    outputs, unlabeled = [], 0
    for t in range(N + 1):
        state = gen.state_dict()
        labels = state["structure_rounds"]
        assert set(labels) == set(state["structure"])
        for name, tensors in state["structure"].items():
            assert len(labels[name]) == len(tensors)
            for label, tensor in zip(labels[name], tensors):
                if label is None:
                    unlabeled += 1
                    continue
                assert 0 <= label < t
                first_round, first = seen.setdefault((name, label), (t, tensor))
                assert first_round == label + 1  # produced by round label's next()
                assert torch.equal(tensor, first)
                if name == "outputs":
                    np.testing.assert_array_equal(tensor.numpy(), outputs[label])
            assert len({x for x in labels[name] if x is not None}) == len([x for x in labels[name] if x is not None])
        if t < N:
            outputs.append(gen.next().numpy().copy())
    if kind == "blt":
        assert unlabeled > 0 and not seen
    elif kind in ("tree", "bsr", "banded-toeplitz", "robust", "banded"):
        assert seen and unlabeled == 0


def test_tree_labels_follow_the_binary_decomposition():
    gen = NoiseGenerator(MECHANISMS["tree"], 3, 1.0, device="cpu", seed=SEED)
    _run(gen, 11)  # 11 = 8 + 2 + 1: blocks [0, 8), [8, 10), [10, 11)
    assert gen.state_dict()["structure_rounds"] == {"stack": [7, 9, 10]}
    _run(gen, 1)  # 12 = 8 + 4
    assert gen.state_dict()["structure_rounds"] == {"stack": [7, 11]}


def test_a_corrupted_state_is_refused_before_anything_changes():
    mech = MECHANISMS["banded-toeplitz"]
    gen = NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED)
    _run(gen, 5)
    state = gen.state_dict()
    target = NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED)
    bad_states = [
        {**state, "structure": {"outputs": state["structure"]["outputs"][:-1]}},
        {**state, "structure": {"outputs": [torch.zeros(5)] * len(state["structure"]["outputs"])}},
        {**state, "structure": {}},
        {**state, "round": N + 1},
        {**state, "row": 2},
        {**state, "seed": "not bytes"},
    ]
    for bad in bad_states:
        with pytest.raises(CheckpointError):
            target.load_state_dict(bad)
        assert target.round == 0
    with pytest.raises(CheckpointError):
        target.load_state_dict([1, 2])


_ONE_LINE_CONFIG_ERRORS = [
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": -4}, "chunk_size"),
    ({"chunk_size": 2.5}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"),
    ({"chunk_size": "64"}, "chunk_size"),
    ({"layout": {"w": (2.5, 3)}}, "layout"),
    ({"layout": {"w": True}}, "layout"),
    ({"layout": {"w": "3"}}, "layout"),
    ({"layout": {"w": (True, 3)}}, "layout"),
    ({"layout": {"w": (-1, 3)}}, "layout"),
    ({"layout": {"w": (0,)}}, "layout"),
    ({"layout": {3: (3,)}}, "layout"),
    ({"layout": True}, "layout"),
    ({"layout": 2.0}, "layout"),
    ({"layout": "5"}, "layout"),
    ({"std": float("inf")}, "std"),
    ({"std": "1.0"}, "std"),
    ({"std": True}, "std"),
    ({"dtype": torch.int64}, "dtype"),
    ({"dtype": "float32"}, "dtype"),
    ({"device": "no-such-device"}, "device"),
    ({"device": "meta"}, "device"),
    ({"device": 3.5}, "device"),
    ({"shard": (0,)}, "shard"),
    ({"shard": (1.0, 2)}, "shard"),
    ({"shard": (True, 2)}, "shard"),
    ({"shard": (0, 0)}, "shard"),
    ({"shard": "ab"}, "shard"),
    ({"seed": 1 << 600}, "seed"),
    ({"seed": "secret"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": b"x" * 65}, "seed"),
    ({"regenerate": "yes"}, "regenerate"),
    ({"mechanism": "bisr"}, "mechanism"),
]
if not torch.cuda.is_available():
    _ONE_LINE_CONFIG_ERRORS.append(({"device": "cuda"}, "CUDA"))


@pytest.mark.parametrize("kwargs, match", _ONE_LINE_CONFIG_ERRORS, ids=lambda v: repr(v)[:40])
def test_every_argument_is_validated_at_construction(kwargs, match):
    args = {"mechanism": MECHANISMS["bisr"], "layout": 5, "std": 1.0, "device": "cpu", **kwargs}
    mech, layout, std = args.pop("mechanism"), args.pop("layout"), args.pop("std")
    with pytest.raises(ConfigError, match=match) as info:
        NoiseGenerator(mech, layout, std, **args)
    assert "\n" not in str(info.value)


def test_layout_shapes_may_be_lists_numpy_ints_or_scalars():
    gen = NoiseGenerator(MECHANISMS["bisr"], {"w": [np.int64(2), 3], "s": (), "b": torch.Size([4])}, 1.0,
                         device="cpu", seed=SEED, chunk_size=np.int64(3))
    out = gen.next()
    assert out["w"].shape == (2, 3) and out["s"].shape == () and out["b"].shape == (4,)
    assert gen.total == 11 and gen.chunk_size == 3


def test_shard_of_a_sharded_generator_is_refused():
    gen = NoiseGenerator(MECHANISMS["bisr"], 8, 1.0, device="cpu", shard=(0, 2))
    with pytest.raises(ConfigError, match="unsharded"):
        gen.shard(0, 2)
    with pytest.raises(ConfigError, match="shard"):
        NoiseGenerator(MECHANISMS["bisr"], 8, 1.0, device="cpu").shard(2, 2)


# ---- salts (issue 23 item 2): every attempt of a round draws new noise, past rounds come back exactly ----
def _salted_draws(mech, d, salts, chunk=5):
    """Fresh rows keyed by each round's salt (every row of round t by salts[t])."""
    draws = Draws(SEED, d, 0, d, torch.float64, torch.device("cpu"), chunk)
    draws.salts = [s for t in range(mech.rounds) for s in [salts[t]] * mech.fresh_rows(t)]
    return np.array([draws.new(r).numpy() for r in range(mech.noise_rows)])


@pytest.mark.parametrize("kind", KINDS)
def test_salted_noise_equals_explicit_inverse_times_draws_keyed_by_the_state_salts(kind):
    """A salted generator's noise is σ·L·Z for the Z keyed by (seed, row, salt of its round, chunk),
    the salts being those its state records; each round's salt is new (16 bytes, all distinct)."""
    mech, d, std = MECHANISMS[kind], 11, 0.7
    gen = NoiseGenerator(mech, d, std, dtype=torch.float64, device="cpu", seed=SEED, chunk_size=5, salted=True)
    streamed = _run(gen, N)
    salts = [bytes.fromhex(s) for s in gen.state_dict()["salts"]]
    assert len(salts) == N and len(set(salts)) == N and all(len(s) == 16 for s in salts)
    expected = std * mech.inverse_matrix() @ _salted_draws(mech, d, salts)
    np.testing.assert_allclose(streamed, expected, rtol=1e-12, atol=1e-12)
    unsalted = _run(NoiseGenerator(mech, d, std, dtype=torch.float64, device="cpu", seed=SEED, chunk_size=5), N)
    assert np.abs(streamed - unsalted).min(axis=1).max() > 0  # every round differs from the unsalted noise


@pytest.mark.parametrize("kind", ["bisr", "tree", "dense", "blt"])
def test_a_restored_salted_generator_reproduces_past_rounds_and_redraws_the_next(kind):
    """Restored from round 6's state (with or without the seed in it): the next round is new noise,
    not the one the original drew; given the original's salts it continues bit for bit (past
    draws, regenerated from seed and salts, are exact)."""
    if kind not in MECHANISMS:
        pytest.skip("dense needs the optional optimizer")
    mech = MECHANISMS[kind]
    first = NoiseGenerator(mech, 9, 1.0, dtype=torch.float64, device="cpu", seed=SEED, salted=True)
    _run(first, 6)
    state = first.state_dict(include_seed=False)
    rest = _run(first, N - 6)
    salts = [bytes.fromhex(s) for s in first.state_dict()["salts"]]
    redo = NoiseGenerator(mech, 9, 1.0, dtype=torch.float64, device="cpu", seed=SEED, salted=True)
    redo.load_state_dict(state)
    assert np.abs(np.asarray(redo.next()) - rest[0]).max() > 1e-3
    again = NoiseGenerator(mech, 9, 1.0, dtype=torch.float64, device="cpu", seed=SEED, salted=True)
    again.load_state_dict(state)
    np.testing.assert_array_equal(np.array([np.asarray(again.next(salt=s)) for s in salts[6:]]), rest)


def test_salted_shards_given_one_salt_concatenate_to_the_full_noise():
    mech = MECHANISMS["bifr"]
    full = NoiseGenerator(mech, 23, 1.0, dtype=torch.float64, device="cpu", seed=SEED, chunk_size=4, salted=True)
    shards = [full.shard(i, 3) for i in range(3)]
    for t in range(N):
        salt = bytes(range(16)) if t % 2 else bytes(reversed(range(16)))
        pieces = [np.asarray(s.next(salt=salt)) for s in shards]
        np.testing.assert_array_equal(np.concatenate(pieces), np.asarray(full.next(salt=salt)))


def test_format_3_states_load_as_unsalted_and_bad_salts_are_refused():
    mech = MECHANISMS["bisr"]
    plain = NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED)
    _run(plain, 4)
    state = plain.state_dict()
    assert state["format"] == 4 and state["salts"] == [""] * 4
    old = {k: v for k, v in state.items() if k != "salts"} | {"format": 3}
    expected = _run(plain, 3)
    for loaded in (state, old):
        gen = NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED, salted=True)
        gen.load_state_dict(loaded)
        assert gen.state_dict()["salts"] == [""] * 4
        regen = NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED)
        regen.load_state_dict(loaded)
        np.testing.assert_array_equal(_run(regen, 3), expected)
    for salts in (["00" * 16] * 3, ["00" * 15] * 4, ["zz" * 16] * 4, [b"\x00" * 16] * 4, None):
        with pytest.raises(CheckpointError, match="salt") as info:
            NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED).load_state_dict({**state, "salts": salts})
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="salt"):
        plain.next(salt=bytes(16))  # an unsalted generator takes no salt
    with pytest.raises(ConfigError, match="salt"):
        NoiseGenerator(mech, 6, 1.0, device="cpu", seed=SEED, salted=True).next(salt=b"short")
