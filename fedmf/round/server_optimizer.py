"""The server optimizer: turns round t's privatized mean update x̂_t into the next model.

``kind="workload"`` (the default) applies exactly the workload A the mechanism was optimized
for, as post-processing of the noisy sums:

    m_t = beta * m_{t-1} + x̂_t ;  theta_{t+1} = theta_t + eta * lr_t * m_t
    so theta_{t+1} = theta_0 + eta * (A x̂)_t,  A[i, j] = sum_{s=j}^{i} lr_s * beta^(s-j)

("Multi-Epoch Matrix Factorization Mechanisms", Choquette-Choo et al. 2023, Sec. 5.2 /
App. F; fedmf/workloads.py). The model's noise is then eta * B Z and the mechanism's error
||A C^{-1}|| describes it.

``kind="sgd"`` / ``"adam"`` run torch.optim.SGD / Adam on the pseudo-gradient -x̂_t (FedOpt,
Reddi et al. 2021, Alg. 2). Still private (post-processing), but not the A the mechanism
was optimized for: a UserWarning says so.

Not a ``torch.optim.Optimizer`` subclass on purpose: its ``step`` takes the update, and an
``LRScheduler`` attached to it would silently change the trajectory away from A.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .. import checks
from ..errors import CheckpointError, ConfigError, HorizonReached, PlanMismatch
from ..workloads import Workload

__all__ = ["ServerOptimizer", "server_optimizer", "KINDS"]

KINDS = ("workload", "sgd", "adam")
_STATE_FORMAT = 1
_TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) that a tensor's elements occupy in memory."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _check_params(params: Any) -> dict[str, torch.Tensor]:
    if not isinstance(params, Mapping):
        raise ConfigError("server optimizer params must be a mapping name -> tensor, e.g. "
                          f"dict(model.named_parameters()), got {type(params).__name__}")
    if not params:
        raise ConfigError("server optimizer params are empty")
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if not isinstance(name, str):
            raise ConfigError(f"server optimizer param names must be strings, got {name!r}")
        if not isinstance(p, torch.Tensor):
            raise ConfigError(f"server optimizer param {name!r} is a {type(p).__name__}, not a tensor")
        if not p.is_floating_point():
            raise ConfigError(f"server optimizer param {name!r} has dtype {p.dtype}; only floating-point tensors "
                              "can be updated (leave integer buffers out)")
        out[name] = p
    spans = sorted((_span(p) + (name,) for name, p in out.items() if p.numel()), key=lambda s: s[0])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ConfigError(f"server optimizer params {first!r} and {second!r} share memory (tied weights would be "
                              "updated twice); pass dict(model.named_parameters())")
    return out


def _check_step_fits(params: Mapping[str, torch.Tensor], largest: float) -> None:
    """The step's largest multiplier lr·max|lrₜ| must be a finite number in every param's dtype
    (torch refuses an ``alpha`` its dtype cannot hold, after the round's noise was drawn)."""
    for name, p in params.items():
        if not largest <= torch.finfo(p.dtype).max:
            raise ConfigError(f"server learning rate × the schedule's largest rate = {largest:g} does not fit the "
                              f"model's {p.dtype} (param {name!r}; at most {torch.finfo(p.dtype).max:g})")


class ServerOptimizer:
    """Applies round t's privatized mean update to ``params`` in place; see the module docstring."""

    def __init__(self, params: Mapping[str, torch.Tensor], workload: Workload, rounds: int, lr: float, *,
                 kind: str = "workload", **options: Any) -> None:
        if not isinstance(workload, Workload):
            raise ConfigError(f"server optimizer workload must be a fedmf Workload, got {type(workload).__name__}")
        checks.positive_int("server optimizer rounds", rounds)
        checks.positive("server optimizer lr", lr)
        if kind not in KINDS:
            raise ConfigError(f"unknown server optimizer kind {kind!r} (expected one of {', '.join(KINDS)})")
        self._params = _check_params(params)
        self._workload, self._rounds, self._lr, self._kind = workload, rounds, float(lr), kind
        self._rates = [float(r) for r in workload.learning_rates(rounds)]
        _check_step_fits(self._params, self._lr * max((abs(r) for r in self._rates), default=1.0))
        self._round = 0
        self._inner: torch.optim.Optimizer | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        if kind == "workload":
            if options:
                raise ConfigError(f"server optimizer kind 'workload' takes no options, got {sorted(options)}")
            self._schedule = True
            self._buffers = {name: torch.zeros_like(p, memory_format=torch.preserve_format)
                             for name, p in self._params.items()}
            return
        self._schedule = options.pop("schedule", False)
        if not isinstance(self._schedule, bool):
            raise ConfigError(f"server optimizer option schedule must be True or False, got {self._schedule!r}")
        try:
            self._inner = _TORCH_OPTIMIZERS[kind](list(self._params.values()), lr=self._lr, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"server optimizer kind {kind!r}: bad options {options!r}: {exc}") from None
        warnings.warn(f"server optimizer kind {kind!r} is post-processing of the privatized updates (still private), "
                      f"but the mechanism was optimized for the workload A ({workload.name}), so its error "
                      "||A C^-1|| does not describe this model trajectory", UserWarning, stacklevel=2)

    # ---- read-only description ---------------------------------------------------------
    @property
    def round(self) -> int:
        """Index of the next round to apply (= rounds applied so far)."""
        return self._round

    @property
    def rounds(self) -> int:
        return self._rounds

    @property
    def lr(self) -> float:
        return self._lr

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def workload(self) -> Workload:
        return self._workload

    # ---- the round ---------------------------------------------------------------------
    def step(self, update: Mapping[str, torch.Tensor]) -> None:
        """Apply round t's privatized mean update (a model delta) in place and advance t."""
        t = self._round
        if t >= self._rounds:
            raise HorizonReached(f"server optimizer: round {t} is past the horizon of {self._rounds} rounds")
        deltas = self._check_update(update)
        factor = self._rates[t] if self._schedule else 1.0
        with torch.no_grad():
            if self._inner is None:
                alpha = self._lr * factor  # theta_{t+1} = theta_t + eta * lr_t * m_t (workloads.py, MEMF Sec. 5.2)
                for name, p in self._params.items():
                    buf = self._buffers[name]
                    buf.mul_(self._workload.momentum).add_(deltas[name])  # m_t = beta * m_{t-1} + x̂_t
                    p.add_(buf, alpha=alpha)
            else:
                self._torch_step(deltas, self._lr * factor)
        self._round = t + 1

    def _torch_step(self, deltas: dict[str, torch.Tensor], lr: float) -> None:
        # FedOpt (Reddi et al. 2021, Alg. 2): the server optimizer descends the pseudo-gradient -x̂_t.
        assert self._inner is not None
        for group in self._inner.param_groups:
            group["lr"] = lr
        saved = {name: p.grad for name, p in self._params.items()}
        try:
            for name, p in self._params.items():
                p.grad = deltas[name].neg()
            self._inner.step()
        finally:
            for name, p in self._params.items():
                p.grad = saved[name]

    def _check_update(self, update: Any) -> dict[str, torch.Tensor]:
        if not isinstance(update, Mapping):
            raise ConfigError(f"server optimizer update must be a mapping name -> tensor, got {type(update).__name__}")
        if set(update) != set(self._params):
            missing, extra = sorted(set(self._params) - set(update)), sorted(set(update) - set(self._params))
            raise ConfigError(f"server optimizer update names differ from the params: missing {missing}, "
                              f"unexpected {extra}")
        out = {}
        for name, p in self._params.items():
            u = update[name]
            if not isinstance(u, torch.Tensor) or not u.is_floating_point():
                raise ConfigError(f"server optimizer update {name!r} is not a floating-point tensor")
            if u.shape != p.shape:
                raise ConfigError(f"server optimizer update {name!r} has shape {tuple(u.shape)}, "
                                  f"the param {tuple(p.shape)}")
            out[name] = u.to(device=p.device, dtype=p.dtype)
            if not bool(torch.isfinite(out[name]).all()):
                raise ConfigError(f"server optimizer update {name!r} has non-finite values")
        return out

    # ---- checkpointing -----------------------------------------------------------------
    def _plan(self) -> dict[str, Any]:
        return {"kind": self._kind, "workload": self._workload.to_dict(), "rounds": self._rounds, "lr": self._lr,
                "schedule": self._schedule}

    def _layout(self) -> list[list[Any]]:
        return [[name, list(p.shape), str(p.dtype)] for name, p in self._params.items()]

    def state_dict(self) -> dict[str, Any]:
        """Round index, optimizer state (copies, on the params' devices) and the plan it belongs to."""
        state: dict[str, Any] = {"format": _STATE_FORMAT, **self._plan(), "round": self._round,
                                 "params": self._layout()}
        if self._inner is None:
            # with momentum 0 the buffer is overwritten before it is read: nothing to keep
            state["buffers"] = (None if self.workload.momentum == 0.0
                                else {name: buf.clone() for name, buf in self._buffers.items()})
        else:
            state["optimizer"] = copy.deepcopy(self._inner.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()`` of an optimizer built for the same plan and params."""
        checks.state_format(state, "server optimizer state", _STATE_FORMAT)
        for key, value in self._plan().items():
            if state.get(key) != value:
                raise PlanMismatch(f"server optimizer state was written for {key} {state.get(key)!r}, "
                                   f"this optimizer has {value!r}")
        if state.get("params") != self._layout():
            raise PlanMismatch("server optimizer state was written for other params (names, shapes or dtypes differ)")
        t = state.get("round")
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= self._rounds:
            raise CheckpointError(f"server optimizer state has an invalid round {t!r}")
        if self._inner is None:
            self._load_buffers(state.get("buffers"))
        else:
            self._load_inner(state.get("optimizer"))
        self._round = t

    def _load_buffers(self, buffers: Any) -> None:
        if buffers is None and self.workload.momentum == 0.0:
            for buf in self._buffers.values():
                buf.zero_()
            return
        if not isinstance(buffers, Mapping) or set(buffers) != set(self._params):
            raise CheckpointError("server optimizer state has no momentum buffer for every param")
        for name, p in self._params.items():
            b = buffers[name]
            if not isinstance(b, torch.Tensor) or b.shape != p.shape or b.dtype != p.dtype:
                raise CheckpointError(f"server optimizer state has a bad momentum buffer for {name!r}")
        for name, buf in self._buffers.items():
            buf.copy_(buffers[name])

    def _load_inner(self, inner: Any) -> None:
        assert self._inner is not None
        ours = self._inner.state_dict()["param_groups"]
        try:
            theirs = inner["param_groups"]
            same = len(theirs) == len(ours) and all(
                {k: v for k, v in a.items() if k != "lr"} == {k: v for k, v in b.items() if k != "lr"}
                for a, b in zip(theirs, ours))
        except (TypeError, KeyError, AttributeError):
            raise CheckpointError("server optimizer state has no readable torch optimizer state") from None
        if not same:
            raise PlanMismatch(f"server optimizer state was written for other {self._kind} options")
        shapes = [p.shape for p in self._params.values()]
        try:
            good = all(0 <= index < len(shapes) and all(
                not isinstance(value, torch.Tensor) or not value.dim() or value.shape == shapes[index]
                for value in values.values()) for index, values in inner["state"].items())
        except (TypeError, KeyError, AttributeError):
            good = False
        if not good:
            raise CheckpointError(f"server optimizer state has a bad {self._kind} state (params or shapes differ)")
        # torch may keep the given tensors (Tensor.to returns self): copy so later steps never touch the caller's state
        self._inner.load_state_dict(copy.deepcopy(dict(inner)))


def server_optimizer(params: Mapping[str, torch.Tensor], workload: Workload, rounds: int, lr: float, *,
                     kind: str = "workload", **options: Any) -> ServerOptimizer:
    """The server optimizer for ``rounds`` rounds of ``workload`` with server learning rate ``lr``.

    ``kind="workload"`` applies exactly A; ``"sgd"``/``"adam"`` take torch.optim.SGD/Adam options
    (momentum, betas, eps, ...) and ``schedule=True`` to follow the workload's learning-rate schedule.
    """
    return ServerOptimizer(params, workload, rounds, lr, kind=kind, **options)
