"""Vectorized clients (fedmf/tasks/vectorized.py): a round's users trained together with
torch.func.vmap equal the sequential local_update within float tolerance."""

from __future__ import annotations

import pytest
import torch

from fedmf.errors import ConfigError
from fedmf.tasks import ClientHyper, get_task, stable_seed
from fedmf.tasks.tiny import TinyTask
from fedmf.tasks.vectorized import batch_schedule, supports_vectorized, vectorized_local_updates

SMALL_SYN = dict(num_users=12, vocab_size=30, max_sentences=40, min_sentences=5, mean_sentences=20.0,
                 eval_users=4, topics=2, seed=0)


def _params(task):
    return {k: v.clone() for k, v in task.model().state_dict().items()}


def _assert_close(seq, vec):
    assert list(seq) == list(vec)
    for user in seq:
        a, b = seq[user], vec[user]
        assert a.num_examples == b.num_examples
        assert list(a.update) == list(b.update)
        for name in a.update:
            assert a.update[name].dtype == b.update[name].dtype
            torch.testing.assert_close(b.update[name], a.update[name], rtol=1e-5, atol=1e-6)
        assert b.metrics["train-loss"] == pytest.approx(a.metrics["train-loss"], rel=1e-5)


@pytest.mark.parametrize("hyper", [ClientHyper(0.2, 1, 16), ClientHyper(0.1, 3, 5), ClientHyper(0.5, 2, 64)])
def test_tiny_vectorized_equals_sequential(hyper):
    task = get_task("tiny")
    users = task.users()[:8]
    counts = {len(task.user_data(u)[1]) for u in users}
    assert len(counts) >= 4  # users with different example counts (and so different step counts)
    params = _params(task)
    seq = task.local_updates(params, users, 3, hyper)
    vec = task.local_updates(params, users, 3, hyper, vectorized=True)
    _assert_close(seq, vec)
    assert any(float(v.abs().max()) > 1e-3 for r in vec.values() for v in r.update.values())


def test_so_synthetic_vectorized_equals_sequential():
    task = get_task("so-synthetic", **SMALL_SYN)
    users = task.users()[:8]
    assert len({len(task.user_data(u)[1]) for u in users}) >= 3
    hyper = ClientHyper(1.0, 2, 8)
    params = _params(task)
    _assert_close(task.local_updates(params, users, 1, hyper),
                  task.local_updates(params, users, 1, hyper, vectorized=True))


def test_sequential_default_is_local_update_bit_for_bit():
    task = get_task("tiny")
    hyper = ClientHyper(0.1, 2, 8)
    params = _params(task)
    out = task.local_updates(params, ["3", "1"], 2, hyper)
    assert list(out) == ["3", "1"]
    for user, result in out.items():
        one = task.local_update(params, user, 2, hyper)
        assert all(torch.equal(one.update[k], result.update[k]) for k in one.update)
        assert one.metrics == result.metrics


def test_schedule_matches_sequential_draws():
    task = get_task("tiny")
    hyper = ClientHyper(0.1, 2, 8)
    n = len(task.user_data("2")[1])
    g = torch.Generator().manual_seed(stable_seed(0, "train", "2", 5))
    want = []
    for _ in range(2):
        order = torch.randperm(n, generator=g)
        want += [order[s:s + 8] for s in range(0, n, 8)]
    got = batch_schedule(task, "2", n, 5, hyper)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_chunked_users_and_input_checks():
    task = get_task("tiny")
    hyper = ClientHyper(0.2, 1, 16)
    params = _params(task)
    users = task.users()[:6]
    whole = vectorized_local_updates(task, params, users, 0, hyper)
    parts = vectorized_local_updates(task, params, users, 0, hyper, max_users=4)
    _assert_close(whole, parts)
    assert vectorized_local_updates(task, params, [], 0, hyper) == {}
    with pytest.raises(ConfigError):
        vectorized_local_updates(task, params, users, -1, hyper)
    with pytest.raises(ConfigError):
        vectorized_local_updates(task, params, ["no-such-user"], 0, hyper)
    with pytest.raises(ConfigError):
        vectorized_local_updates(task, {"x": torch.zeros(1)}, users, 0, hyper)


class _OddLoss(TinyTask):
    def criterion(self, logits, y):
        return torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)


def test_unsupported_task_falls_back_to_the_loop():
    task = _OddLoss()
    assert not supports_vectorized(task)
    assert supports_vectorized(get_task("tiny"))
    hyper = ClientHyper(0.1, 1, 8)
    params = _params(task)
    vec = task.local_updates(params, ["0", "1"], 0, hyper, vectorized=True)
    seq = task.local_updates(params, ["0", "1"], 0, hyper)
    assert all(torch.equal(vec[u].update[k], seq[u].update[k]) for u in seq for k in seq[u].update)
    with pytest.raises(ConfigError):
        vectorized_local_updates(task, params, ["0"], 0, hyper)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_vectorized_on_cuda_equals_sequential_on_cpu():
    task = get_task("so-synthetic", **SMALL_SYN)
    users = task.users()[:6]
    params = _params(task)
    hyper = ClientHyper(0.5, 2, 8)
    seq = task.local_updates(params, users, 3, hyper)
    vec = task.local_updates(params, users, 3, hyper, vectorized=True, device="cuda")
    assert all(v.device.type == "cpu" for r in vec.values() for v in r.update.values())  # back on params' device
    _assert_close(seq, vec)


def test_a_cuda_device_without_cuda_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    task = get_task("tiny")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        task.local_updates(_params(task), task.users()[:2], 0, ClientHyper(0.1, 1, 8), vectorized=True, device="cuda")
    with pytest.raises(ConfigError, match="only vectorized clients"):
        task.local_updates(_params(task), task.users()[:2], 0, ClientHyper(0.1, 1, 8), device="cuda")
