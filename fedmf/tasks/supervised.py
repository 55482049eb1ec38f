"""A supervised task: (inputs, labels) tensors, a classifier, local SGD, loss and accuracy written
once, and its batched twin (:mod:`fedmf.tasks.vectorized`, which needs nothing of this module: the
task tells it its pad label through :meth:`~fedmf.tasks.base.Task.vectorized_pad_label`).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence

import torch

from .. import checks
from ..errors import ConfigError
from ..threads import one_thread
from .base import ClientHyper, LocalResult, Task, stable_seed
from .vectorized import IGNORE_INDEX, supports_vectorized, vectorized_local_updates

__all__ = ["SupervisedTask"]


class SupervisedTask(Task):
    """A task over (inputs, labels) tensors with a classifier: local SGD, loss and accuracy are
    written once here. Subclasses provide ``users``, ``model``, ``user_data`` and ``heldout_data``,
    and ``seed`` among their options."""

    @abstractmethod
    def user_data(self, user: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of one training user; ConfigError for an unknown user."""

    @abstractmethod
    def heldout_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) that no training user holds."""

    def _work_model(self, params: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """This thread's training model, built once and loaded with ``params`` for each update
        (every parameter is overwritten: the same result as a fresh model, without building one)."""
        local = self.__dict__.setdefault("_work", threading.local())
        model = getattr(local, "model", None)
        if model is None:
            model = local.model = self.model()
        return self.load(params, into=model)

    def vectorized_updates(self, params: Mapping[str, torch.Tensor], users: Sequence[str], round: int,
                           hyper: ClientHyper, *, device: str | torch.device | None = None,
                           chunk_users: int | None = None) -> dict[str, LocalResult] | None:
        if not supports_vectorized(self):
            return None
        return vectorized_local_updates(self, params, users, round, hyper, device=device, max_users=chunk_users)

    def vectorized_pad_label(self) -> int | None:
        """torch's ignore index for the default cross-entropy; None for another loss or a
        ``local_update`` of its own (the vectorized path runs this class's SGD only)."""
        if type(self).local_update is not SupervisedTask.local_update:
            return None
        return IGNORE_INDEX if type(self).criterion is SupervisedTask.criterion else None

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of one batch (cross-entropy by default); accuracy is argmax(logits) == y."""
        return torch.nn.functional.cross_entropy(logits, y)

    def train_loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss local SGD differentiates on one batch: ``criterion(model(x), y)``. A task may
        compute the same value more cheaply (the text tasks skip pad positions)."""
        return self.criterion(model(x), y)

    def local_update(self, params: Mapping[str, torch.Tensor], user: str, round: int,
                     hyper: ClientHyper) -> LocalResult:
        checks.integer("round", round, minimum=0)
        if not isinstance(hyper, ClientHyper):
            raise ConfigError(f"hyper must be a ClientHyper, got {type(hyper).__name__}")
        # one thread for all of it, loading included: waking a second thread costs ~1 ms per small
        # op on a busy machine (benchmarks/simulate.py: 1.7-1.8x faster per update)
        with one_thread(), torch.enable_grad():  # grad mode is per thread: the same in every worker
            x, y = self.user_data(user)
            model = self._work_model(params)
            model.train()
            generator = torch.Generator().manual_seed(stable_seed(self.options["seed"], "train", user, round))
            optimizer = torch.optim.SGD(model.parameters(), lr=hyper.client_lr)
            n = len(y)
            if n == 0:
                raise ConfigError(f"user {user!r} holds no data")
            total, seen = 0.0, 0
            for _ in range(hyper.local_epochs):
                order = torch.randperm(n, generator=generator)
                for start in range(0, n, hyper.batch_size):
                    batch = order[start:start + hyper.batch_size]
                    optimizer.zero_grad(set_to_none=True)
                    loss = self.train_loss(model, x[batch], y[batch])
                    loss.backward()
                    optimizer.step()
                    total += float(loss.detach()) * len(batch)
                    seen += len(batch)
            new = model.state_dict()
            update = {name: new[name].detach().to(old.dtype) - old.detach() for name, old in params.items()}
        return LocalResult(update=update, num_examples=n, metrics={"train-loss": total / seen})

    def _score(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), one_thread():
                logits = model(x)
                loss = self.criterion(logits, y)
                accuracy = (logits.argmax(dim=-1) == y).double().mean()
        finally:
            model.train(training)
        return {"loss": float(loss), "accuracy": float(accuracy)}

    def evaluate(self, model: torch.nn.Module, *, device: str | torch.device | None = None) -> dict[str, float]:
        """Held-out evaluation; ``device``: score a copy of ``model`` there (e.g. ``cuda``)."""
        x, y = self.heldout_data()
        if device is None or torch.device(device) == next(model.parameters()).device:
            return self._score(model, x, y)
        import copy

        return self._score(copy.deepcopy(model).to(device), x.to(device), y.to(device))

    def evaluate_user(self, model: torch.nn.Module, user: str) -> tuple[int, dict[str, float]]:
        x, y = self.user_data(user)
        return len(y), self._score(model, x, y)
