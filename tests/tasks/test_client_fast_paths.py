"""The client's fast paths give what the plain ones give: the fused softmax cross-entropy, the
text tasks' pad-skipping loss and evaluation, and parallel clients (``workers``)."""

from __future__ import annotations

import threading

import pytest
import torch

from fedmf.tasks import ClientHyper, get_task
from fedmf.tasks.losses import softmax_cross_entropy
from fedmf.tasks.supervised import SupervisedTask
from fedmf.tasks.text import LRU, PAD, TextTask


def _so_tiny(**options):
    return get_task("so-synthetic", num_users=30, vocab_size=200, max_sentences=24, model_size="small",
                    eval_users=4, **options)


def test_softmax_cross_entropy_matches_torch_and_its_gradient_is_exact():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 11, generator=g, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.tensor([0, 3, 10, 3, 5, 1, 7])
    ours = softmax_cross_entropy(logits, targets)
    theirs = torch.nn.functional.cross_entropy(logits, targets)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-14)
    (mine,) = torch.autograd.grad(ours * 2.5, logits)  # an upstream gradient other than 1
    (ref,) = torch.autograd.grad(theirs * 2.5, logits)
    torch.testing.assert_close(mine, ref, rtol=1e-13, atol=1e-15)
    assert torch.autograd.gradcheck(softmax_cross_entropy, (logits.detach().requires_grad_(), targets))
    # huge logits: the max is subtracted before exp (no overflow)
    big = torch.tensor([[1e4, 0.0, -1e4]], dtype=torch.float64)
    assert float(softmax_cross_entropy(big, torch.tensor([1]))) == pytest.approx(1e4, rel=1e-12)


def _batches(task, user):
    x, y = task.user_data(user)
    full = (y != PAD).all(dim=1)
    yield x[:5], y[:5]
    yield x[:1], y[:1]
    if full.any():  # a batch whose longest target is the 20th position
        rows = torch.cat([full.nonzero()[:1, 0], torch.arange(3)])
        yield x[rows], y[rows]
    short = (y != PAD).sum(dim=1) <= 3
    if short.any():
        yield x[short], y[short]


def test_text_train_loss_equals_the_criterion_in_value_and_gradient():
    """TextTask.train_loss skips pad positions; the masked mean and its gradient are the
    criterion's (float64 model: to rounding)."""
    task = _so_tiny()
    model = task.model().double()
    seen_full = False
    for user in task.users()[:6]:
        for x, y in _batches(task, user):
            seen_full |= bool((y != PAD).all(dim=1).any())
            fast = task.train_loss(model, x, y)
            grads_fast = torch.autograd.grad(fast, list(model.parameters()))
            slow = task.criterion(model(x), y)
            grads_slow = torch.autograd.grad(slow, list(model.parameters()))
            assert float(fast) == pytest.approx(float(slow), rel=1e-13)
            for a, b in zip(grads_fast, grads_slow):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    assert seen_full


def test_text_training_and_evaluation_match_the_whole_model_path(monkeypatch):
    task = _so_tiny()
    params = {k: v.clone() for k, v in task.model().state_dict().items()}
    hyper = ClientHyper(0.5, 2, 8)
    fast = task.local_update(params, "3", 1, hyper)
    model = task.load(params)
    fast_eval = task.evaluate(model)
    # the whole-model path: the base class's loss, every position through the head
    monkeypatch.setattr(TextTask, "train_loss", SupervisedTask.train_loss)
    monkeypatch.setattr("fedmf.tasks.text._target_logits", lambda model, x, y: None)
    slow = task.local_update(params, "3", 1, hyper)
    slow_eval = task.evaluate(model)
    assert fast.metrics["train-loss"] == pytest.approx(slow.metrics["train-loss"], rel=1e-5)
    for name in params:
        torch.testing.assert_close(fast.update[name], slow.update[name], rtol=1e-4, atol=1e-6)
    assert fast_eval["loss"] == pytest.approx(slow_eval["loss"], rel=1e-5)
    assert fast_eval["accuracy"] == pytest.approx(slow_eval["accuracy"], abs=1e-3)
    assert fast_eval["accuracy_no_oov_eos"] == pytest.approx(slow_eval["accuracy_no_oov_eos"], abs=1e-3)


@pytest.mark.parametrize("name", ["so-synthetic", "tiny"])
def test_parallel_clients_give_the_same_bits_as_one_at_a_time(name):
    task = _so_tiny() if name == "so-synthetic" else get_task("tiny", num_users=12)
    params = {k: v.clone() for k, v in task.model().state_dict().items()}
    hyper = ClientHyper(0.5, 2, 8)
    users = task.users()[:9]
    threads_before = torch.get_num_threads()
    one = task.local_updates(params, users, 2, hyper)
    # a fresh task (cold caches, several threads building them at once) and a reused one
    for other in (_so_tiny() if name == "so-synthetic" else get_task("tiny", num_users=12), task):
        many = other.local_updates(params, users, 2, hyper, workers=3)
        assert list(many) == users
        for user in users:
            assert many[user].num_examples == one[user].num_examples
            assert many[user].metrics == one[user].metrics
            for key in params:
                assert torch.equal(many[user].update[key], one[user].update[key]), (user, key)
    assert torch.get_num_threads() == threads_before  # the workers' one-thread blocks are their own
    fresh: list[int] = []  # and a thread started afterwards gets the process's count, not one
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [threads_before]


def test_parallel_clients_pass_a_bad_user_up_as_one_error():
    from fedmf.errors import ConfigError

    task = _so_tiny()
    params = task.model().state_dict()
    with pytest.raises(ConfigError, match="unknown so-synthetic user"):
        task.local_updates(params, ["1", "nobody", "2"], 0, ClientHyper(0.5, 1, 8), workers=2)
    with pytest.raises(ConfigError, match="workers"):
        task.local_updates(params, ["1"], 0, ClientHyper(0.5, 1, 8), workers=0)


def test_lru_is_safe_under_threads_and_pickles_empty():
    import pickle

    cache = LRU(3)
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        try:
            for i in range(2000):
                key = str((i * 7 + seed) % 11)
                assert cache.get(key, lambda: int(key) * 2) == int(key) * 2  # noqa: B023 (called within this iteration)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache._data) <= 3
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.size == 3 and not copy._data and copy.get("5", lambda: 10) == 10


def test_softmax_cross_entropy_refuses_what_it_does_not_compute():
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    loss = softmax_cross_entropy(logits, torch.tensor([0, 1, 4])) + (logits ** 3).sum()
    with pytest.raises(RuntimeError, match="first-order only"):  # no silently wrong Hessian
        torch.autograd.grad(loss, logits, create_graph=True)
    with pytest.raises(ValueError, match="N >= 1"):
        softmax_cross_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="N >= 1"):
        softmax_cross_entropy(torch.zeros(2, 5), torch.zeros(3, dtype=torch.int64))


def test_a_subclass_criterion_or_another_model_gets_no_shortcut(monkeypatch):
    """The shortcut is TextTask's own masked cross-entropy on a WordLSTM; a subclass with another
    criterion, or a model without that structure, trains on criterion(model(x), y)."""
    task = _so_tiny()
    model = task.model().double()
    x, y = task.user_data("2")
    x, y = x[:6], y[:6]

    def doubled(self, logits, targets):
        return 2 * TextTask.criterion(self, logits, targets)

    monkeypatch.setattr(type(task), "criterion", doubled)
    assert float(task.train_loss(model, x, y).detach()) == pytest.approx(
        2 * float(TextTask.criterion(task, model(x), y).detach()), rel=1e-13)
    monkeypatch.undo()

    class Wrapped(torch.nn.Module):  # same outputs, not a WordLSTM
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids)

    calls = []
    monkeypatch.setattr(TextTask, "criterion", lambda self, logits, targets: calls.append(1) or
                        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                          ignore_index=PAD))
    task.train_loss(Wrapped(model), x, y)
    assert calls == [1]


def test_parallel_clients_train_the_same_under_no_grad_and_refuse_vectorized_workers():
    task = get_task("tiny", num_users=6)
    params = {k: v.clone() for k, v in task.model().state_dict().items()}
    hyper = ClientHyper(0.5, 1, 8)
    users = task.users()
    with torch.no_grad():  # grad mode is per thread: local_update turns it on wherever it runs
        one = task.local_updates(params, users, 0, hyper)
        many = task.local_updates(params, users, 0, hyper, workers=3)
    for user in users:
        assert all(torch.equal(one[user].update[k], many[user].update[k]) for k in params)
    from fedmf.errors import ConfigError

    with pytest.raises(ConfigError, match="vectorized=False"):
        task.as_local_updates(hyper, workers=2)
