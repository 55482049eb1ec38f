"""Vectorized clients: the selected users of a round trained together, in one process.

    results = task.local_updates(params, users, round, hyper, vectorized=True)   # {user: LocalResult}

The same local SGD as :meth:`SupervisedTask.local_update`, run for all ``users`` at once with
``torch.func``: ``vmap(grad_and_value(loss))`` over a leading user axis of stacked parameters,
``functional_call`` of the task's own model, its own ``criterion``.

* Each user's batch schedule is drawn exactly as the sequential path draws it (a
  ``torch.Generator`` seeded by ``stable_seed(seed, "train", user, round)``, one ``randperm(n)``
  per epoch, batches of ``batch_size`` in order), so every user sees the same batches in the
  same order.
* Users differ in example count, so their batches and step counts differ: step ``s`` of the
  vectorized loop is every user's ``s``-th batch, padded to ``batch_size`` with a pad row whose
  label the criterion ignores (``-100`` for the default cross-entropy, ``PAD`` for the text tasks,
  whose criterion already ignores pad targets). A masked mean equals the unpadded mean, so the
  gradient is the same; a user whose steps are all done (or a batch with no target) keeps its
  parameters (``torch.where`` on an ``active`` mask, not a zero gradient).
* The result equals the sequential path within float tolerance (batched matmuls sum in another
  order), not bit for bit: the in-process loop's bit-identity with the Flower path holds only
  for the sequential path, which stays the default.

Supported: :class:`SupervisedTask` subclasses whose ``criterion`` is the default cross-entropy or
:class:`TextTask`'s pad-masked one, whose model has no buffers, trained by plain SGD (as
``local_update``). The text tasks' ``WordLSTM`` runs through a functional LSTM written here (the
same gate equations as ``nn.LSTM``: i, f, g, o), because ``vmap`` has no batching rule for the
fused ``aten::lstm``. ``local_updates(vectorized=True)`` on a text task takes
:mod:`fedmf.tasks.batched_lstm` instead (explicit batched matrix products, a written-out backward
pass: less memory per user and faster); this path stays for the other tasks and for comparison
(``benchmarks/so_paper_round.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call, grad_and_value, vmap

from .. import checks
from ..errors import ConfigError
from ..threads import one_thread
from .base import ClientHyper, LocalResult, Task, stable_seed
from .models import WordLSTM

if TYPE_CHECKING:  # types only: supervised.py imports this module
    from .supervised import SupervisedTask

__all__ = ["vectorized_local_updates", "supports_vectorized", "batch_schedule", "IGNORE_INDEX"]

#: torch's default ignore_index of cross_entropy
IGNORE_INDEX = -100


def supports_vectorized(task: Any) -> bool:
    """True when :func:`vectorized_local_updates` handles ``task`` (else ``local_updates`` loops): a
    task with a pad label (:meth:`~fedmf.tasks.base.Task.vectorized_pad_label`) whose model has no
    buffers."""
    if not isinstance(task, Task) or task.vectorized_pad_label() is None:
        return False
    model = task.model()
    return not any(True for _ in model.buffers())


def batch_schedule(task: SupervisedTask, user: str, n: int, round: int, hyper: ClientHyper) -> list[torch.Tensor]:
    """``user``'s batches (index tensors into its data), in the order ``local_update`` takes them."""
    generator = torch.Generator().manual_seed(stable_seed(task.options["seed"], "train", user, round))
    out: list[torch.Tensor] = []
    for _ in range(hyper.local_epochs):
        order = torch.randperm(n, generator=generator)
        out.extend(order[start:start + hyper.batch_size] for start in range(0, n, hyper.batch_size))
    return out


def _lstm_forward(lstm: torch.nn.LSTM, prefix: str, p: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One-layer, batch-first, unidirectional ``nn.LSTM`` written out (vmap-able): (B, T, E) → (B, T, H)."""
    w_ih, w_hh = p[f"{prefix}weight_ih_l0"], p[f"{prefix}weight_hh_l0"]
    bias = p[f"{prefix}bias_ih_l0"] + p[f"{prefix}bias_hh_l0"]
    hidden = lstm.hidden_size
    gates_x = x @ w_ih.T + bias  # (B, T, 4H): the input projection of every step at once
    h = x.new_zeros(x.shape[0], hidden)
    c = x.new_zeros(x.shape[0], hidden)
    outs = []
    for t in range(x.shape[1]):
        gates = gates_x[:, t] + h @ w_hh.T
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs, dim=1)


def _forward_fn(model: torch.nn.Module) -> Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    """(params, x) → logits for one user; vmap-able."""
    if isinstance(model, WordLSTM):
        lstm = model.lstm
        if lstm.num_layers != 1 or lstm.bidirectional or not lstm.batch_first or lstm.proj_size or not lstm.bias:
            raise ConfigError("vectorized clients: only a one-layer, batch-first, unidirectional LSTM is supported")

        def word_lstm(p: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            e = torch.nn.functional.embedding(x, p["embedding.weight"])
            h = _lstm_forward(lstm, "lstm.", p, e)
            d = torch.nn.functional.linear(h, p["dense.weight"], p["dense.bias"])
            return torch.nn.functional.linear(d, p["output.weight"], p["output.bias"])

        return word_lstm
    if any(isinstance(m, torch.nn.RNNBase) for m in model.modules()):
        raise ConfigError("vectorized clients: recurrent modules other than the text tasks' WordLSTM are not supported")

    def generic(p: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, dict(p), (x,))

    return generic


def _pad_row(x: torch.Tensor, ignore: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pad input row shaped like one of ``x``'s rows (zeros; PAD ids for int inputs) and its label fill."""
    return torch.zeros((1, *x.shape[1:]), dtype=x.dtype), torch.tensor(ignore)


def vectorized_local_updates(task: SupervisedTask, params: Mapping[str, torch.Tensor], users: Sequence[str],
                             round: int, hyper: ClientHyper, *, max_users: int | None = None,
                             device: str | torch.device | None = None) -> dict[str, LocalResult]:
    """``{user: task.local_update(params, user, round, hyper)}`` computed for all users together
    (within float tolerance of the sequential results). ``max_users`` caps the users of one
    vmap call (memory); users are taken in the given order. ``device`` (default: the
    parameters' device) is where the users train; the updates come back on the parameters'
    device, in their dtypes."""
    checks.integer("round", round, minimum=0)
    compute = _compute_device(device, params)
    if not isinstance(hyper, ClientHyper):
        raise ConfigError(f"hyper must be a ClientHyper, got {type(hyper).__name__}")
    if not supports_vectorized(task):
        raise ConfigError(f"task {task.name!r} has no vectorized local update")
    users = list(dict.fromkeys(users))
    if max_users is not None:
        checks.integer("max_users", max_users, minimum=1)
    out: dict[str, LocalResult] = {}
    if not users:
        return out
    step = max_users or len(users)
    with one_thread():
        template = task.load(params)  # checks names and shapes; the model's own dtypes
    for start in range(0, len(users), step):
        out.update(_run(task, template, params, users[start:start + step], round, hyper, compute))
    return out


def _compute_device(device: str | torch.device | None, params: Mapping[str, torch.Tensor]) -> torch.device:
    if device is None:
        first = next(iter(params.values()), None)
        return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"vectorized clients: bad device {device!r} ({e})") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"vectorized clients: device {device!r} asked for, but CUDA is not available here")
    return out


def users_data(task: SupervisedTask, users: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) of each user, in order; a one-line ConfigError for a user without data."""
    data = []
    for user in users:
        x, y = task.user_data(user)
        if len(y) == 0:
            raise ConfigError(f"user {user!r} holds no data")
        data.append((x, y))
    return data


def _run(task: SupervisedTask, template: torch.nn.Module, params: Mapping[str, torch.Tensor], users: list[str],
         round: int, hyper: ClientHyper, device: torch.device) -> dict[str, LocalResult]:
    ignore = task.vectorized_pad_label()
    assert ignore is not None
    data = users_data(task, users)
    num_users, b = len(users), hyper.batch_size
    n_max = max(len(y) for _, y in data)
    # every user's data padded to n_max + 1 rows; row n_max (and beyond a user's n) is the pad row
    x0, _ = data[0]
    pad_x, _ = _pad_row(x0, ignore)
    xs = torch.empty((num_users, n_max + 1, *x0.shape[1:]), dtype=x0.dtype)
    ys = torch.full((num_users, n_max + 1, *data[0][1].shape[1:]), ignore, dtype=data[0][1].dtype)
    for u, (x, y) in enumerate(data):
        xs[u, :len(y)] = x
        xs[u, len(y):] = pad_x
        ys[u, :len(y)] = y
    schedules = [batch_schedule(task, user, len(y), round, hyper) for user, (_, y) in zip(users, data)]
    steps = max(len(s) for s in schedules)
    index = torch.full((steps, num_users, b), n_max, dtype=torch.int64)
    sizes = torch.zeros((steps, num_users), dtype=torch.int64)
    for u, schedule in enumerate(schedules):
        for s, batch in enumerate(schedule):
            index[s, u, :len(batch)] = batch
            sizes[s, u] = len(batch)

    state = template.state_dict()
    names = list(state)
    forward = _forward_fn(template)
    criterion = task.criterion

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return criterion(forward(p, x), y)

    step_fn = vmap(grad_and_value(loss_fn))
    lr = hyper.client_lr
    # the schedules were drawn on the CPU (as the sequential path draws them); the work runs on ``device``
    xs, ys, index, sizes = xs.to(device), ys.to(device), index.to(device), sizes.to(device)
    rows = torch.arange(num_users, device=device).unsqueeze(1)
    total = torch.zeros(num_users, dtype=torch.float64, device=device)
    with one_thread():
        p = {k: state[k].detach().to(device).unsqueeze(0).expand(num_users, *state[k].shape).clone()
             for k in names}
        for s in range(steps):
            idx = index[s]
            xb, yb = xs[rows, idx], ys[rows, idx]
            active = sizes[s] > 0
            grads, loss = step_fn(p, xb, yb)
            # a batch whose targets are all ignored (text: all pad) has a NaN mean in both paths;
            # the sequential step then writes NaN too, so only inactive users are held back
            for k in names:
                shape = (num_users,) + (1,) * (p[k].dim() - 1)
                p[k] = torch.where(active.view(shape), p[k] - lr * grads[k], p[k])
            total += torch.where(active, loss.detach().double() * sizes[s], 0.0)
    seen = sizes.sum(dim=0).cpu()
    total = total.cpu()
    p = {k: v.to(params[k].device) for k, v in p.items()}  # one transfer per tensor, not per user
    out: dict[str, LocalResult] = {}
    for u, user in enumerate(users):
        update = {name: p[name][u].detach().to(old.dtype) - old.detach() for name, old in params.items()}
        out[user] = LocalResult(update=update, num_examples=len(data[u][1]),
                                metrics={"train-loss": float(total[u]) / int(seen[u])})
    return out
