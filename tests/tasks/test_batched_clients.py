"""Batched LSTM clients (fedmf/tasks/batched_lstm.py): many users' local SGD as batched matrix
products over per-user weights equals one-at-a-time training (the sequential path) within float
tolerance, on both text tasks, for users of different sizes (step counts, a last partial batch,
padding), with and without chunking."""

from __future__ import annotations

import pytest
import torch

import fedmf.tasks.text as text_module
from fedmf.errors import ConfigError
from fedmf.tasks import ClientHyper, get_task
from fedmf.tasks.batched_lstm import (
    CPU_BUDGET_BYTES,
    batched_local_updates,
    bytes_per_user,
    chunk_for_budget,
    default_budget_bytes,
    supports_batched,
)
from fedmf.tasks.models import PAPER_PARAMS
from fedmf.tasks.text import TextTask
from fedmf.tasks.vectorized import vectorized_local_updates

SMALL_SYN = dict(num_users=12, vocab_size=30, max_sentences=40, min_sentences=5, mean_sentences=20.0,
                 eval_users=4, topics=2, seed=0)


def _params(task):
    return {k: v.clone() for k, v in task.model().state_dict().items()}


def _assert_close(seq, bat, users):
    assert list(bat) == list(users)
    for user in users:
        a, b = seq[user], bat[user]
        assert a.num_examples == b.num_examples
        assert list(a.update) == list(b.update)
        for name in a.update:
            assert b.update[name].dtype == a.update[name].dtype and b.update[name].device == a.update[name].device
            torch.testing.assert_close(b.update[name], a.update[name], rtol=1e-5, atol=1e-6)
        assert b.metrics["train-loss"] == pytest.approx(a.metrics["train-loss"], rel=1e-5)


def _sizes_cover_the_cases(task, users, batch_size):
    sizes = [len(task.user_data(u)[1]) for u in users]
    assert len({-(-n // batch_size) for n in sizes}) >= 3, sizes  # different numbers of steps
    assert any(n % batch_size for n in sizes), sizes  # a last partial batch
    assert any((task.user_data(u)[1] == 0).any() for u in users)  # padded targets


@pytest.mark.parametrize("hyper, chunks", [(ClientHyper(1.0, 2, 8), (3, 1)), (ClientHyper(0.5, 1, 5), ())])
def test_so_synthetic_batched_equals_sequential(hyper, chunks):
    task = get_task("so-synthetic", **SMALL_SYN)
    assert supports_batched(task)
    users = task.users()[:8]
    _sizes_cover_the_cases(task, users, hyper.batch_size)
    params = _params(task)
    seq = task.local_updates(params, users, 1, hyper)
    bat = batched_local_updates(task, params, users, 1, hyper)
    _assert_close(seq, bat, users)
    assert all(float(r.update["output.weight"].abs().max()) > 1e-3 for r in bat.values())  # they trained
    # chunks smaller than the cohort (and not dividing it; of one user) give the same result
    for chunk in chunks:
        _assert_close(seq, batched_local_updates(task, params, users, 1, hyper, chunk_users=chunk), users)
    assert all(torch.equal(v, params[k]) for k, v in _params(task).items())  # the inputs are not touched


def _play(tmp_path):
    """A generated play: four speakers with 3 to 40 lines of 1 to 29 words (some cut at 20)."""
    words = ["thou", "art", "the", "king", "and", "i", "my", "lord", "good", "night"]
    speeches, k = [], 0
    for who, n in (("ALPHA.", 40), ("BETA.", 11), ("GAMMA.", 3), ("DELTA.", 23)):
        lines = []
        for _j in range(n):
            k += 1
            lines.append(" ".join(words[(k * 7 + m * 3) % len(words)] for m in range(1 + (k * 13) % 29)) + ".")
        speeches.append(f"{who}\n" + "\n".join(lines) + "\n")
    (tmp_path / "test_gut.txt").write_text("TITLE\n\nACT I.\n\n" + "\n".join(speeches))
    return get_task("shakespeare", texts_dir=str(tmp_path), min_lines=2, vocab_size=8, heldout_fraction=0.1)


def test_shakespeare_batched_equals_sequential_in_chunks(tmp_path):
    task = _play(tmp_path)
    users = task.users()
    assert len(users) == 4
    hyper = ClientHyper(0.8, 2, 4)
    _sizes_cover_the_cases(task, users, hyper.batch_size)
    assert any((task.user_data(u)[1] != 0).all(dim=1).any() for u in users)  # a sentence cut at 20: no pad
    params = _params(task)
    seq = task.local_updates(params, users, 2, hyper)
    for chunk in (None, 1, 3):
        _assert_close(seq, batched_local_updates(task, params, users, 2, hyper, chunk_users=chunk), users)


def test_stackoverflow_file_batched_equals_sequential(tmp_path):
    """TFF's StackOverflow file format (the ``stackoverflow`` task), users of 1 to 14 sentences."""
    from tests.tasks.test_text_tasks import _so_db

    words = ["how", "to", "the", "a", "is", "sql", "python", "zebra"]
    rows = [("train", f"u{u}", " ".join(words[(u + j * m) % len(words)] for m in range(1 + (u * 5 + j * 3) % 24)))
            for u, n in enumerate((1, 5, 9, 14)) for j in range(n)]
    db = _so_db(tmp_path / "stackoverflow.sqlite", rows + [("heldout", "h", "a is")])
    vocab = tmp_path / "stackoverflow.word_count"
    vocab.write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(words[:6])))
    task = get_task("stackoverflow", path=db, vocab_path=str(vocab), vocab_size=6, model_size="small")
    users = task.users()
    hyper = ClientHyper(0.7, 2, 4)
    _sizes_cover_the_cases(task, users, hyper.batch_size)
    params = _params(task)
    _assert_close(task.local_updates(params, users, 4, hyper),
                  task.local_updates(params, users, 4, hyper, vectorized=True, chunk_users=3), users)


def test_vectorized_selects_the_batched_path_for_text_and_keeps_vmap(monkeypatch):
    task = get_task("so-synthetic", **SMALL_SYN)
    users = task.users()[:4]
    hyper = ClientHyper(1.0, 1, 8)
    params = _params(task)
    calls = []
    real = text_module.batched_local_updates

    def spy(*args, **kwargs):
        calls.append(kwargs.get("chunk_users"))
        return real(*args, **kwargs)

    monkeypatch.setattr(text_module, "batched_local_updates", spy)
    through = task.local_updates(params, users, 0, hyper, vectorized=True, chunk_users=2)
    assert calls == [2]
    fn = task.as_local_updates(hyper, chunk_users=3)
    deltas = fn(params, users, 0)
    assert calls == [2, 3]
    # the vmap path stays callable and agrees with the batched one
    vmap = vectorized_local_updates(task, params, users, 0, hyper)
    _assert_close(vmap, through, users)
    for user in users:
        for name in deltas[user]:
            torch.testing.assert_close(deltas[user][name], through[user].update[name], rtol=1e-5, atol=1e-6)


class _SmoothedText(type(get_task("so-synthetic", **SMALL_SYN))):
    def criterion(self, logits, y):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 ignore_index=0, label_smoothing=0.1)


def test_another_loss_is_not_batched(monkeypatch):
    task = _SmoothedText(**SMALL_SYN)
    assert isinstance(task, TextTask)
    monkeypatch.setattr(text_module, "batched_local_updates", lambda *a, **k: pytest.fail("batched path taken"))
    hyper = ClientHyper(1.0, 1, 8)
    params = _params(task)
    users = task.users()[:2]
    looped = task.local_updates(params, users, 0, hyper, vectorized=True)
    seq = task.local_updates(params, users, 0, hyper)
    assert all(torch.equal(looped[u].update[k], seq[u].update[k]) for u in users for k in seq[u].update)
    with pytest.raises(ConfigError, match="no batched LSTM"):
        batched_local_updates(task, params, users, 0, hyper)


def test_inputs_are_checked_and_repeats_dropped():
    task = get_task("so-synthetic", **SMALL_SYN)
    hyper = ClientHyper(1.0, 1, 8)
    params = _params(task)
    assert batched_local_updates(task, params, [], 0, hyper) == {}
    out = batched_local_updates(task, params, ["3", "1", "3"], 0, hyper)
    assert list(out) == ["3", "1"]
    for bad, kwargs in ((["nope"], {}), (["1"], {"chunk_users": 0}), (["1"], {"budget_bytes": 0}),
                        (["1"], {"device": "tpu"})):
        with pytest.raises(ConfigError):
            batched_local_updates(task, params, bad, 0, hyper, **kwargs)
    with pytest.raises(ConfigError):
        batched_local_updates(task, params, ["1"], -1, hyper)
    with pytest.raises(ConfigError):
        batched_local_updates(task, {"x": torch.zeros(1)}, ["1"], 0, hyper)
    with pytest.raises(ConfigError, match="chunk_users is for vectorized"):
        task.as_local_updates(hyper, vectorized=False, chunk_users=2)


def test_memory_formula_and_chunk_for_the_paper_model():
    v, e, h, b, t = 10_004, 96, 670, 16, 20
    params = sum(p.numel() for p in torch.nn.LSTM(e, h).parameters()) + v * e + (h * e + e) + (e * v + v)
    assert params == PAPER_PARAMS
    n = b * t
    want = 4 * (params + n * (e + 4 * h + 2 * h) + n * (h + e + v) + n * h + n * e) + 24 * n
    assert bytes_per_user(v, e, h, b, t) == want
    assert 36e6 < want < 37e6  # about 36 MB per user: the paper's LSTM, batch 16
    assert chunk_for_budget(80 * 10**9, want) == 80 * 10**9 // want
    wide = bytes_per_user(v, e, h, 32, t)  # 640 positions: the largest weight's gradient is formed first
    n = 32 * t
    assert wide == 4 * (params + n * (e + 6 * h) + n * (h + e + v) + n * h + n * e + 4 * h * h) + 24 * n
    assert chunk_for_budget(10, want) == 1
    assert default_budget_bytes(torch.device("cpu")) == CPU_BUDGET_BYTES
    # the default chunk splits a cohort that does not fit the budget, with the same result
    task = get_task("so-synthetic", **SMALL_SYN)
    hyper = ClientHyper(1.0, 1, 8)
    params_ = _params(task)
    users = task.users()[:5]
    per_user = bytes_per_user(34, 32, 64, 8)
    whole = batched_local_updates(task, params_, users, 0, hyper)
    _assert_close(whole, batched_local_updates(task, params_, users, 0, hyper, budget_bytes=2 * per_user), users)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_batched_on_cuda_equals_sequential_on_cpu():
    task = get_task("so-synthetic", **SMALL_SYN)
    users = task.users()[:6]
    params = _params(task)
    hyper = ClientHyper(0.5, 2, 8)
    seq = task.local_updates(params, users, 3, hyper)
    bat = task.local_updates(params, users, 3, hyper, vectorized=True, device="cuda", chunk_users=4)
    assert all(v.device.type == "cpu" for r in bat.values() for v in r.update.values())  # back on params' device
    _assert_close(seq, bat, users)


@pytest.mark.heavy
def test_paper_model_batched_equals_sequential():
    """The paper's 4,053,428-parameter LSTM (vocab 10,000), three users of the so-paper geometry."""
    task = get_task("so-synthetic", num_users=50, max_sentences=40, min_sentences=10, mean_sentences=30.0,
                    model_size="paper", seed=1)
    users = task.users()[:3]
    hyper = ClientHyper(0.5, 1, 16)
    params = _params(task)
    assert sum(v.numel() for v in params.values()) == PAPER_PARAMS
    seq = task.local_updates(params, users, 0, hyper)
    bat = batched_local_updates(task, params, users, 0, hyper, chunk_users=2)
    _assert_close(seq, bat, users)


@pytest.mark.heavy
def test_simulate_so_tiny_vectorized_equals_one_at_a_time(tmp_path, capsys, monkeypatch):
    """`fedmf simulate --preset so-tiny --vectorized --chunk-users 3`: with the same secrets, the
    final model equals the one-at-a-time run's within float tolerance."""
    import json

    from fedmf.cli import main
    from fedmf.run.private_run import REPEATABLE_NOISE_ENV
    from tests._federated_task import share_secrets

    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")
    argv = ["simulate", "--preset", "so-tiny", "--rounds", "3", "--clients-per-round", "8", "--epsilon", "8",
            "--json", "--no-plot"]
    assert main([*argv, "--out", str(tmp_path / "seq"), "--workers", "1"]) == 0
    share_secrets(tmp_path / "seq", tmp_path / "vec")
    assert main([*argv, "--out", str(tmp_path / "vec"), "--vectorized", "--chunk-users", "3"]) == 0
    seq_out, vec_out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert seq_out["rounds_done"] == vec_out["rounds_done"] == 3
    a = torch.load(tmp_path / "seq" / "final-model.pt")
    b = torch.load(tmp_path / "vec" / "final-model.pt")
    assert list(a) == list(b)
    from fedmf.config import RunConfig
    from fedmf.run.simulate import preset_values

    config = RunConfig.from_mapping(preset_values("so-tiny", {"run-dir": "x"}))
    initial = get_task(config.task, **config.task_options).model().state_dict()
    assert any(float((a[k] - initial[k]).abs().max()) > 1e-3 for k in a)  # it trained
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
