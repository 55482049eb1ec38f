"""Adversarial cases for the batched LSTM clients (fedmf/tasks/batched_lstm.py) against the
sequential path (SupervisedTask.local_update with TextTask.train_loss): odd data (one sentence,
no targets, rows of other lengths, ids outside the vocabulary), odd hyperparameters (batch 1,
batch far larger than the data, several epochs), chunking, repeats, float64 parameters, bad
arguments and errors inside a chunk."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedmf.tasks.batched_lstm as batched_module
from fedmf.errors import ConfigError
from fedmf.tasks import ClientHyper, get_task
from fedmf.tasks.batched_lstm import batched_local_updates

SMALL_SYN = dict(num_users=12, vocab_size=30, max_sentences=40, min_sentences=5, mean_sentences=20.0,
                 eval_users=4, topics=2, seed=0)
_Syn = type(get_task("so-synthetic", **SMALL_SYN))


def _params(task, dtype=torch.float32):
    return {k: v.clone().to(dtype) for k, v in task.model().state_dict().items()}


def _assert_close(seq, bat, users, *, nan_loss=()):
    assert list(bat) == list(dict.fromkeys(users))
    for user in bat:
        a, b = seq[user], bat[user]
        assert a.num_examples == b.num_examples
        assert list(a.update) == list(b.update)
        for name in a.update:
            assert b.update[name].dtype == a.update[name].dtype
            assert torch.isfinite(b.update[name]).all(), (user, name)
            torch.testing.assert_close(b.update[name], a.update[name], rtol=1e-5, atol=1e-6)
        if user in nan_loss:
            assert math.isnan(a.metrics["train-loss"]) and math.isnan(b.metrics["train-loss"])
        else:
            assert b.metrics["train-loss"] == pytest.approx(a.metrics["train-loss"], rel=1e-5)


class _Edited(_Syn):
    """so-synthetic with some users' data edited by ``edits`` {user: fn(x, y) -> (x, y)}."""

    edits: dict = {}

    def user_data(self, user):
        x, y = super().user_data(user)
        edit = self.edits.get(user)
        return (x, y) if edit is None else edit(x.clone(), y.clone())


def _edited(**edits):
    cls = type("Edited", (_Edited,), {"edits": edits})
    return cls(**SMALL_SYN)


@pytest.mark.parametrize("hyper, chunk, round", [
    (ClientHyper(1.0, 1, 1), None, 0),     # batch 1: every step one sentence
    (ClientHyper(0.7, 3, 4), 2, 5),        # several epochs, chunks of 2
    (ClientHyper(0.5, 2, 64), 1, 9),       # batch larger than every user's data, chunks of 1
])
def test_edge_hypers_equal_sequential(hyper, chunk, round):
    task = _edited(**{"2": lambda x, y: (x[:1], y[:1])})  # a user of one sentence
    users = ["2", "5", "8", "0", "5"]  # sizes 1, 40, 8, 18; a repeat
    params = _params(task)
    seq = task.local_updates(params, users, round, hyper)
    bat = batched_local_updates(task, params, users, round, hyper, chunk_users=chunk)
    _assert_close(seq, bat, users)
    assert bat["2"].num_examples == 1


def test_round_changes_the_shuffle_in_both_paths():
    task = get_task("so-synthetic", **SMALL_SYN)
    params, hyper, users = _params(task), ClientHyper(1.0, 1, 4), ["0", "3"]
    a = batched_local_updates(task, params, users, 0, hyper)
    b = batched_local_updates(task, params, users, 1, hyper)
    assert not torch.allclose(a["0"].update["output.weight"], b["0"].update["output.weight"], atol=1e-4)
    _assert_close(task.local_updates(params, users, 1, hyper), b, users)


def test_batches_are_padded_to_the_data_not_to_batch_size(monkeypatch):
    """A batch_size far beyond the users' data (a full-batch run) must not make every step
    batch_size rows wide: that is memory and time for nothing (10**9 would not fit at all)."""
    task = get_task("so-synthetic", **SMALL_SYN)
    users = ["0", "8", "1"]  # 18, 8, 9 sentences
    widths = []
    real = batched_module._sgd_step

    def spy(p, k, x, y, lr, pad):
        widths.append(x.shape[1])
        return real(p, k, x, y, lr, pad)

    monkeypatch.setattr(batched_module, "_sgd_step", spy)
    params = _params(task)
    hyper = ClientHyper(0.5, 1, 1000)
    bat = batched_local_updates(task, params, users, 0, hyper, chunk_users=3)
    assert widths == [18]  # one step, as wide as the largest user
    _assert_close(task.local_updates(params, users, 0, hyper), bat, users)
    huge = ClientHyper(0.5, 1, 10**9)
    _assert_close(task.local_updates(params, users, 0, huge), batched_local_updates(task, params, users, 0, huge),
                  users)


def test_a_user_without_targets_takes_no_step_as_sequential():
    """All-pad targets (not produced by the shipped pipelines, whose every row has a target, but
    a TextTask subclass may hold them): the sequential masked mean has a NaN value and a zero
    gradient, so the user's steps leave the weights alone; the batched path must not write NaN."""

    def no_targets(x, y):
        return x, torch.zeros_like(y)

    def one_empty_row(x, y):
        y[0] = 0
        return x, y

    task = _edited(**{"1": no_targets, "3": one_empty_row})
    users = ["0", "1", "3"]
    params = _params(task)
    hyper = ClientHyper(0.5, 1, 1)  # batch 1: user 3 has one step without targets
    seq = task.local_updates(params, users, 0, hyper)
    bat = batched_local_updates(task, params, users, 0, hyper)
    assert all(float(v.abs().max()) == 0 for v in seq["1"].update.values())
    _assert_close(seq, bat, users, nan_loss=("1", "3"))


def test_rows_of_other_lengths_equal_sequential():
    """Rows longer (targets past column 20) or shorter than the others of the chunk."""
    task = _edited(**{"0": lambda x, y: (torch.cat([x, x[:, :5]], 1), torch.cat([y, y[:, :5]], 1)),
                      "3": lambda x, y: (x[:, :7], y[:, :7])})
    users = ["0", "3", "8"]
    params = _params(task)
    hyper = ClientHyper(0.5, 1, 4)
    assert (task.user_data("0")[1][:, 20:] != 0).any()
    _assert_close(task.local_updates(params, users, 0, hyper), batched_local_updates(task, params, users, 0, hyper),
                  users)


@pytest.mark.parametrize("where, value", [("x", -1), ("x", 34), ("y", 34), ("y", -2)])
def test_ids_outside_the_vocabulary_are_refused_not_read_from_a_neighbour(where, value):
    """The chunk's embeddings are one flat (users·ids, embed) table: an id of -1 (or num_ids)
    would read, and step, the next user's rows. Sequential fails (IndexError); batched must too."""

    def bad(x, y):
        (x if where == "x" else y)[0, 1] = value
        return x, y

    task = _edited(**{"1": bad})
    params = _params(task)
    with pytest.raises(ConfigError, match=r"user '1': .* ids must lie in \[0, 34\)"):
        batched_local_updates(task, params, ["0", "1", "2"], 0, ClientHyper(0.5, 1, 4))


def test_float64_and_grad_parameters_equal_sequential():
    task = get_task("so-synthetic", **SMALL_SYN)
    users = ["0", "4"]
    hyper = ClientHyper(0.5, 1, 8)
    params = _params(task, torch.float64)
    seq = task.local_updates(params, users, 2, hyper)
    bat = batched_local_updates(task, params, users, 2, hyper, chunk_users=1)
    _assert_close(seq, bat, users)
    grads = {k: torch.nn.Parameter(v.float()) for k, v in params.items()}
    before = {k: v.detach().clone() for k, v in grads.items()}
    out = batched_local_updates(task, grads, users, 2, hyper)
    assert not any(v.requires_grad for r in out.values() for v in r.update.values())
    assert all(torch.equal(grads[k].detach(), before[k]) for k in grads)  # the inputs are not touched


def test_an_error_in_a_later_chunk_returns_nothing():
    task = _edited(**{"5": lambda x, y: (_ for _ in ()).throw(RuntimeError("disk gone"))})
    params = _params(task)
    with pytest.raises(RuntimeError, match="disk gone"):
        batched_local_updates(task, params, ["0", "1", "2", "5"], 0, ClientHyper(0.5, 1, 8), chunk_users=2)
    with pytest.raises(ConfigError, match="nope"):
        batched_local_updates(task, params, ["0", "1", "nope"], 0, ClientHyper(0.5, 1, 8), chunk_users=2)


@pytest.mark.parametrize("kwargs", [{"chunk_users": True}, {"chunk_users": 2.0}, {"chunk_users": -1},
                                    {"budget_bytes": 1.5e9}, {"budget_bytes": 0}, {"device": "meta"},
                                    {"device": "nope"}])
def test_bad_arguments_give_one_line_errors(kwargs):
    task = get_task("so-synthetic", **SMALL_SYN)
    with pytest.raises(ConfigError) as e:
        batched_local_updates(task, _params(task), ["0"], 0, ClientHyper(0.5, 1, 8), **kwargs)
    assert "\n" not in str(e.value)


def test_numpy_chunk_users_accepted():
    task = get_task("so-synthetic", **SMALL_SYN)
    params, hyper = _params(task), ClientHyper(0.5, 1, 8)
    _assert_close(batched_local_updates(task, params, ["0", "1"], 0, hyper),
                  batched_local_updates(task, params, ["0", "1"], 0, hyper, chunk_users=np.int64(1)), ["0", "1"])


@pytest.mark.parametrize("argv, message", [
    (["--chunk-users", "0", "--vectorized"], "--chunk-users must be an integer >= 1"),
    (["--chunk-users", "2"], "--chunk-users needs --vectorized"),
])
def test_cli_chunk_users_errors_are_one_line(argv, message, capsys):
    from fedmf.cli import main

    assert main(["simulate", "--preset", "so-tiny", "--rounds", "1", "--out", "unused", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# regression: the in-place baddbmm_ step lost float accuracy at wide steps (3.6e-4 at batch 256)
def test_large_batches_keep_float_tolerance():
    task = get_task("so-synthetic", num_users=2, vocab_size=30, max_sentences=260, min_sentences=256,
                    mean_sentences=258.0, eval_users=1, topics=2, seed=0)
    user = task.users()[0]
    hyper = ClientHyper(0.5, 1, 256)
    params = _params(task)
    seq = task.local_updates(params, [user], 0, hyper)[user].update
    bat = batched_local_updates(task, params, [user], 0, hyper)[user].update
    worst = max(float((bat[k] - seq[k]).abs().max()) / float(seq[k].abs().max()) for k in seq)
    assert worst < 1e-4, worst


def test_parameters_in_another_order_keep_their_order():
    task = get_task("so-synthetic", **SMALL_SYN)
    params = dict(reversed(list(_params(task).items())))
    users, hyper = ["0", "7"], ClientHyper(0.5, 1, 8)
    bat = batched_local_updates(task, params, users, 0, hyper)
    assert all(list(r.update) == list(params) for r in bat.values())
    _assert_close(task.local_updates(params, users, 0, hyper), bat, users)
