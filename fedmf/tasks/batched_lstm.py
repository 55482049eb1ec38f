"""Batched clients for the text tasks' LSTM: many users' local SGD on one device, per-user weights
stacked along a leading user axis, forward and backward written out as batched matrix products.

    results = batched_local_updates(task, params, users, round, hyper, device="cuda", chunk_users=512)

The same local SGD as :meth:`~fedmf.tasks.supervised.SupervisedTask.local_update` with
:meth:`~fedmf.tasks.text.TextTask.train_loss` (the pad-masked mean cross-entropy), for
:class:`~fedmf.tasks.models.WordLSTM` (embedding → one LSTM layer → dense → output):

* every user's batches are those of the sequential path (:func:`~fedmf.tasks.vectorized.batch_schedule`:
  one ``randperm`` per epoch from ``stable_seed(seed, "train", user, round)``, batches of
  ``batch_size``, the last one partial), padded with all-pad rows (no target) to the chunk's largest
  batch (at most ``batch_size``; ids outside the embedding refused: one flat table holds the chunk's);
* a chunk of users is sorted by step count (longest first), so the users still training at step
  ``s`` are a prefix of the chunk: step ``s`` runs on that prefix only, nothing is masked;
* per step: embedding rows gathered from the flattened (users·ids, embed) table; the LSTM's input
  projection as one ``baddbmm`` over all steps, then one ``baddbmm`` per time step for the
  recurrent term (gates i, f, g, o as ``nn.LSTM``), run up to the chunk's last target column (the
  LSTM is causal); dense and output layers on the non-pad target positions only, packed to the
  front of each user's rows (one ``baddbmm`` each); softmax cross-entropy with its gradient formed
  in place of the logits ((softmax − onehot)/targets, the standard softmax-regression gradient,
  Bishop PRML Eq. 4.109);
* the backward pass is written out (backpropagation through time, the LSTM cell's derivatives
  by the chain rule: Hochreiter & Schmidhuber 1997 / Graves 2012 §4.6) and every weight takes its
  SGD step ``w ← w − lr·∇w`` as soon as its gradient is formed and no later product needs it
  (``baddbmm_(…, alpha=−lr)``; the embedding by ``index_add_`` of its rows' gradients): no
  gradient buffer the size of the weights is kept — except for steps wider than
  ``EXACT_STEP_POSITIONS`` positions, whose gradients are formed and then added once (float
  accuracy; one weight-sized buffer at a time).

Equal to the sequential path within float tolerance (other summation orders), not bit for bit.
Float32 throughout. Memory per user is :func:`bytes_per_user` (a formula, see there); users are
trained ``chunk_users`` at a time (default: as many as :func:`default_budget_bytes` holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .. import checks
from ..errors import ConfigError
from ..threads import one_thread
from .base import ClientHyper, LocalResult
from .models import WordLSTM
from .vectorized import _compute_device, batch_schedule, users_data  # one device parser for both paths

if TYPE_CHECKING:  # types only: text.py imports this module
    from .supervised import SupervisedTask

__all__ = ["batched_local_updates", "supports_batched", "bytes_per_user", "chunk_for_budget",
           "default_budget_bytes", "CPU_BUDGET_BYTES", "CUDA_BUDGET_FRACTION", "WEIGHTS"]

#: the WordLSTM's state names, in the order this module reads them
WEIGHTS = ("embedding.weight", "lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.bias_ih_l0", "lstm.bias_hh_l0",
           "dense.weight", "dense.bias", "output.weight", "output.bias")
#: default memory budget of one chunk on the CPU
CPU_BUDGET_BYTES = 4 * 2**30
#: default budget of one chunk on CUDA: this fraction of the device's free memory
CUDA_BUDGET_FRACTION = 0.8
_FLOAT = 4  # bytes of a float32
#: above this many positions per step a weight's gradient is formed (bmm) and added once: an in-place
#: ``baddbmm_`` lets a CPU BLAS add each block of positions to the float32 weight separately, one
#: rounding at the weight's magnitude per block (~400 positions), so the update's error grows with the
#: positions (3.6e-4 of the update at batch 256, 3e-6 at the default 16 = 320 positions)
EXACT_STEP_POSITIONS = 320


def supports_batched(task: SupervisedTask) -> bool:
    """True when ``task``'s model is a :class:`WordLSTM` with a one-layer, batch-first,
    unidirectional LSTM with biases (the model this module writes out)."""
    model = task.model()
    if type(model) is not WordLSTM:
        return False
    lstm = model.lstm
    return (lstm.num_layers == 1 and not lstm.bidirectional and lstm.batch_first and not lstm.proj_size
            and lstm.bias and tuple(model.state_dict()) == WEIGHTS)


def bytes_per_user(num_ids: int, embed: int, hidden: int, batch_size: int, seq_len: int = 20) -> int:
    """Peak bytes one user adds to a chunk (float32; an upper bound: every position a target).

    With P the model's parameters, N = batch_size·seq_len positions and K ≤ N target positions:
    4·[P (the user's weights) + N·(E + 4H + 2H) (embedded inputs; gates, cell and hidden states
    kept for the backward pass) + K·(H + E + V) (packed hidden states, dense outputs, logits that
    become the softmax gradient) + N·H (hidden-state gradient) + N·E (input gradient)] + 2·8·N
    (the ids and targets of one batch, int64) + 8·N (the packing order); with N above
    ``EXACT_STEP_POSITIONS``, plus the largest weight (its gradient is formed before the step)."""
    for name, value in (("num_ids", num_ids), ("embed", embed), ("hidden", hidden), ("batch_size", batch_size),
                        ("seq_len", seq_len)):
        checks.integer(name, value, minimum=1)
    v, e, h = num_ids, embed, hidden
    params = v * e + 4 * h * e + 4 * h * h + 8 * h + h * e + e + e * v + v
    n = batch_size * seq_len
    floats = params + n * (e + 6 * h) + n * (h + e + v) + n * h + n * e
    if n > EXACT_STEP_POSITIONS:  # the largest weight's gradient, formed before it is added
        floats += max(v * e, 4 * h * h, 4 * h * e)
    return _FLOAT * floats + 3 * 8 * n


def default_budget_bytes(device: torch.device) -> int:
    """The memory one chunk may take: ``CUDA_BUDGET_FRACTION`` of the free memory of a CUDA
    device, ``CPU_BUDGET_BYTES`` elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(CUDA_BUDGET_FRACTION * free)
    return CPU_BUDGET_BYTES


def chunk_for_budget(budget_bytes: int, per_user_bytes: int) -> int:
    """Users per chunk that fit ``budget_bytes`` at ``per_user_bytes`` each (at least 1)."""
    return max(1, int(budget_bytes) // int(per_user_bytes))


def batched_local_updates(task: SupervisedTask, params: Mapping[str, torch.Tensor], users: Sequence[str],
                          round: int, hyper: ClientHyper, *, device: str | torch.device | None = None,
                          chunk_users: int | None = None, budget_bytes: int | None = None
                          ) -> dict[str, LocalResult]:
    """``{user: task.local_update(params, user, round, hyper)}`` for a text task's WordLSTM,
    computed ``chunk_users`` users at a time (default: as many as ``budget_bytes`` holds by
    :func:`bytes_per_user`; default budget :func:`default_budget_bytes`) on ``device`` (default:
    the parameters'). Within float tolerance of the sequential results; the updates come back on
    the parameters' device, in their dtypes, in ``users``' order (repeats dropped)."""
    checks.integer("round", round, minimum=0)
    if not isinstance(hyper, ClientHyper):
        raise ConfigError(f"hyper must be a ClientHyper, got {type(hyper).__name__}")
    pad = task.vectorized_pad_label()
    if pad is None or not supports_batched(task):
        raise ConfigError(f"task {task.name!r} has no batched LSTM local update")
    compute = _compute_device(device, params)
    if compute.type not in ("cpu", "cuda"):
        raise ConfigError(f"batched LSTM clients train on cpu or cuda, got device {str(compute)!r}")
    if chunk_users is not None:
        checks.integer("chunk_users", chunk_users, minimum=1)
    if budget_bytes is not None:
        checks.integer("budget_bytes", budget_bytes, minimum=1)
    users = list(dict.fromkeys(users))
    if not users:
        return {}
    with one_thread():
        template = task.load(params)  # checks names and shapes
    state = {k: v.detach() for k, v in template.state_dict().items()}
    if chunk_users is None:
        per_user = bytes_per_user(template.output.out_features, template.embedding.embedding_dim,
                                  template.lstm.hidden_size, hyper.batch_size)
        chunk_users = chunk_for_budget(budget_bytes or default_budget_bytes(compute), per_user)
    out: dict[str, LocalResult] = {}
    for start in range(0, len(users), chunk_users):
        out.update(_run_chunk(task, state, params, users[start:start + chunk_users], round, hyper, compute, pad))
    return {user: out[user] for user in users}


def _run_chunk(task: SupervisedTask, state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
               users: list[str], round: int, hyper: ClientHyper, device: torch.device, pad: int
               ) -> dict[str, LocalResult]:
    data = users_data(task, users)
    schedules = [batch_schedule(task, user, len(y), round, hyper) for user, (_, y) in zip(users, data)]
    # longest first (stable): the users still training at step s are a prefix of the chunk
    order = sorted(range(len(users)), key=lambda u: -len(schedules[u]))
    n_max = max(len(y) for _, y in data)
    # no batch is longer than its user's data: pad to the longest one, not to batch_size
    num_users, b = len(users), min(hyper.batch_size, n_max)
    seq_len = _check_ids(users, data, state["embedding.weight"].shape[0])
    # every user's rows, padded to n_max + 1: row n_max (and beyond a user's n) is an all-pad row
    xs = torch.full((num_users, n_max + 1, seq_len), pad, dtype=torch.int64)
    ys = torch.full((num_users, n_max + 1, seq_len), pad, dtype=torch.int64)
    steps = len(schedules[order[0]])
    index = torch.full((steps, num_users, b), n_max, dtype=torch.int64)
    sizes = torch.zeros((steps, num_users), dtype=torch.int64)
    active = [0] * steps  # users training at step s
    for slot, u in enumerate(order):
        x, y = data[u]
        xs[slot, :len(y), :x.shape[1]] = x  # shorter rows: pad columns (no target; the LSTM is causal)
        ys[slot, :len(y), :y.shape[1]] = y
        for s, batch in enumerate(schedules[u]):
            index[s, slot, :len(batch)] = batch
            sizes[s, slot] = len(batch)
            active[s] = slot + 1
    xs, ys, index, weights = xs.to(device), ys.to(device), index.to(device), sizes.double().to(device)
    rows = torch.arange(num_users, device=device).unsqueeze(1)
    total = torch.zeros(num_users, dtype=torch.float64, device=device)
    lr = hyper.client_lr
    with one_thread(device):
        # a copy per user (clone: a chunk of one must not alias, and then step, the template)
        p = {k: state[k].to(device=device, dtype=torch.float32).unsqueeze(0)
             .expand(num_users, *state[k].shape).clone(memory_format=torch.contiguous_format) for k in WEIGHTS}
        for s in range(steps):
            k = active[s]
            idx = index[s, :k]
            loss = _sgd_step(p, k, xs[rows[:k], idx], ys[rows[:k], idx], lr, pad)
            total[:k] += loss.double() * weights[s, :k]
    seen = sizes.sum(dim=0)
    total = total.cpu()
    updates: list[dict[str, torch.Tensor]] = [{} for _ in users]
    for name, old in params.items():  # one transfer per tensor, not per user; one chunk-sized copy at a time
        delta = p.pop(name).to(device=old.device, dtype=old.dtype)
        delta.sub_(old.detach().unsqueeze(0))
        for slot in range(num_users):
            updates[slot][name] = delta[slot].clone()
        del delta
    out: dict[str, LocalResult] = {}
    for slot, u in enumerate(order):
        out[users[u]] = LocalResult(update=updates[slot], num_examples=len(data[u][1]),
                                    metrics={"train-loss": float(total[slot]) / int(seen[slot])})
    return out


def _check_ids(users: list[str], data: list[tuple[torch.Tensor, torch.Tensor]], num_ids: int) -> int:
    """The longest row of ``data``; a one-line ConfigError for an id outside [0, num_ids) (the chunk's
    embedding tables are one flat table: such an id would read, and step, another user's rows)."""
    for user, (x, y) in zip(users, data):
        if x.ndim != 2 or x.shape != y.shape:
            raise ConfigError(f"user {user!r}: inputs and targets must be (sentences, length) of one shape, "
                              f"got {tuple(x.shape)} and {tuple(y.shape)}")
        for what, ids in (("input", x), ("target", y)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_ids):
                raise ConfigError(f"user {user!r}: {what} ids must lie in [0, {num_ids}), got "
                                  f"[{int(ids.min())}, {int(ids.max())}]")
    return max(x.shape[1] for x, _ in data)


def _sgd_step(p: Mapping[str, torch.Tensor], k: int, x: torch.Tensor, y: torch.Tensor, lr: float,
              pad: int) -> torch.Tensor:
    """One SGD step of the chunk's first ``k`` users on their batches ``x``, ``y`` (k, B, T) int64,
    in place on ``p``; returns each user's batch loss (k,) (the masked mean cross-entropy)."""
    emb, w_ih, w_hh = p["embedding.weight"][:k], p["lstm.weight_ih_l0"][:k], p["lstm.weight_hh_l0"][:k]
    b_ih, b_hh = p["lstm.bias_ih_l0"][:k], p["lstm.bias_hh_l0"][:k]
    w_d, b_d, w_o, b_o = p["dense.weight"][:k], p["dense.bias"][:k], p["output.weight"][:k], p["output.bias"][:k]
    num_ids, embed = emb.shape[1:]
    hidden = w_hh.shape[2]
    batch = x.shape[1]
    target = y != pad
    columns = target.any(dim=1).any(dim=0).nonzero()
    steps = int(columns[-1]) + 1 if len(columns) else 1  # the LSTM is causal: later columns change nothing
    # time-major inside each user: (k, T, B, ·), so that step t of all users is one strided batch
    x = x[:, :, :steps].transpose(1, 2).contiguous()
    y = y[:, :, :steps].transpose(1, 2).contiguous()
    target = target[:, :, :steps].transpose(1, 2).reshape(k, steps * batch)
    positions = steps * batch
    ids = (x + torch.arange(k, device=x.device).view(k, 1, 1) * num_ids).reshape(-1)
    table = emb.view(k * num_ids, embed)
    xe = table.index_select(0, ids).view(k, positions, embed)

    # LSTM forward: gates (pre-activation, then activated in place) i, f, g, o as nn.LSTM
    gates = torch.baddbmm((b_ih + b_hh).unsqueeze(1), xe, w_ih.transpose(1, 2)).view(k, steps, batch, 4 * hidden)
    cells = torch.empty(k, steps, batch, hidden, device=x.device)
    hs = torch.empty(k, steps, batch, hidden, device=x.device)
    w_hh_t = w_hh.transpose(1, 2)
    for t in range(steps):
        a = gates[:, t]
        if t:
            a.baddbmm_(hs[:, t - 1], w_hh_t)
        a[..., :2 * hidden].sigmoid_()
        a[..., 2 * hidden:3 * hidden].tanh_()
        a[..., 3 * hidden:].sigmoid_()
        i, f, g, o = a.split(hidden, dim=-1)
        c = cells[:, t]
        if t:
            torch.mul(f, cells[:, t - 1], out=c)
            c.addcmul_(i, g)
        else:
            torch.mul(i, g, out=c)
        torch.tanh(c, out=hs[:, t]).mul_(o)

    # head on the target positions only, packed to the front of each user's rows
    counts = target.sum(dim=1)
    width = max(1, int(counts.max()))
    pack = torch.argsort((~target).to(torch.int8), dim=1, stable=True)[:, :width]
    valid = torch.arange(width, device=x.device).unsqueeze(0) < counts.unsqueeze(1)
    # 1/targets; a user without targets takes no step (as sequential: the masked mean's gradient is 0)
    weight = valid.float() / counts.clamp(min=1).unsqueeze(1).float()
    hsel = hs.view(k, positions, hidden).gather(1, pack.unsqueeze(2).expand(k, width, hidden))
    ysel = y.view(k, positions).gather(1, pack)
    dense = torch.baddbmm(b_d.unsqueeze(1), hsel, w_d.transpose(1, 2))
    grad = torch.baddbmm(b_o.unsqueeze(1), dense, w_o.transpose(1, 2))  # logits, then their gradient
    top = grad.amax(dim=2, keepdim=True)
    picked = grad.gather(2, ysel.unsqueeze(2))
    grad.sub_(top).exp_()
    norm = grad.sum(dim=2, keepdim=True)
    loss = ((norm.log() + top - picked).squeeze(2) * weight).sum(dim=1)
    loss.masked_fill_(counts == 0, float("nan"))  # the mean of no targets, as sequential
    grad.div_(norm)
    grad.scatter_add_(2, ysel.unsqueeze(2), torch.full_like(picked, -1.0))
    grad.mul_(weight.unsqueeze(2))
    del top, picked, norm

    # backward, each weight stepped once no later product needs it
    exact = positions > EXACT_STEP_POSITIONS

    def step(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """w ← w − lr·(a @ b): in place, or (wide steps) with the gradient formed first, added once."""
        if exact:
            w.add_(torch.bmm(a, b), alpha=-lr)
        else:
            w.baddbmm_(a, b, alpha=-lr)

    d_dense = torch.bmm(grad, w_o)
    step(w_o, grad.transpose(1, 2), dense)
    b_o.add_(grad.sum(dim=1), alpha=-lr)
    del grad
    d_hsel = torch.bmm(d_dense, w_d)
    step(w_d, d_dense.transpose(1, 2), hsel)
    b_d.add_(d_dense.sum(dim=1), alpha=-lr)
    del d_dense, hsel, dense
    d_hs = torch.zeros(k, positions, hidden, device=x.device)
    d_hs.scatter_(1, pack.unsqueeze(2).expand(k, width, hidden), d_hsel)  # pack is a permutation: no repeats
    d_hs = d_hs.view(k, steps, batch, hidden)
    del d_hsel

    # backpropagation through time; the pre-activation gate gradients overwrite the gates
    d_h = torch.zeros(k, batch, hidden, device=x.device)
    d_c = torch.zeros(k, batch, hidden, device=x.device)
    for t in reversed(range(steps)):
        a = gates[:, t]
        i, f, g, o = (part.clone() for part in a.split(hidden, dim=-1))
        d_h += d_hs[:, t]
        tanh_c = torch.tanh(cells[:, t])
        d_c.addcmul_(d_h * o, 1 - tanh_c * tanh_c)
        di, df, dg, do = a.split(hidden, dim=-1)
        torch.mul(d_c, g, out=di).mul_(i * (1 - i))
        if t:
            torch.mul(d_c, cells[:, t - 1], out=df).mul_(f * (1 - f))
        else:
            df.zero_()
        torch.mul(d_c, i, out=dg).mul_(1 - g * g)
        torch.mul(d_h, tanh_c, out=do).mul_(o * (1 - o))
        d_c.mul_(f)
        if t:
            d_h = torch.bmm(a, w_hh)
    d_gates = gates.view(k, positions, 4 * hidden)
    d_xe = torch.bmm(d_gates, w_ih)
    if steps > 1:  # h_{-1} = 0: step 0's gates have no recurrent term
        step(w_hh, d_gates[:, batch:].transpose(1, 2), hs[:, :-1].reshape(k, positions - batch, hidden))
    step(w_ih, d_gates.transpose(1, 2), xe)
    d_bias = d_gates.sum(dim=1)
    b_ih.add_(d_bias, alpha=-lr)
    b_hh.add_(d_bias, alpha=-lr)
    table.index_add_(0, ids, d_xe.view(-1, embed), alpha=-lr)
    return loss
