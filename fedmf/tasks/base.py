"""What a federated task is: a population of users with their own data, a model, and the local
training and evaluation run on it. No Flower here: the in-process loop (``fedmf.run.federated.train``)
and the Flower ClientApp call the same methods, and get bit-identical results.

Determinism contract: ``local_update`` depends only on (params, user, round, hyper, task options).
All randomness comes from a ``torch.Generator`` seeded by :func:`stable_seed` (never the global
RNG), and local training runs on one intra-op thread, so that the result does not depend on the
process's thread count (a Ray actor and the server process differ there).
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import checks
from ..errors import ConfigError

__all__ = ["ClientHyper", "LocalResult", "Task", "stable_seed", "check_options", "MAX_WORKERS",
           "default_workers"]

#: most parallel client threads ``local_updates`` runs
MAX_WORKERS = 256


def default_workers() -> int:
    """The CPUs this process may use (parallel clients: one intra-op thread each): its CPU
    affinity, capped by a cgroup v2 CPU quota (a container's ``--cpus``) when there is one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(cpus, MAX_WORKERS))


def stable_seed(*parts: Any) -> int:
    """A 63-bit seed from JSON-able ``parts``, the same in every process (BLAKE2b, not ``hash``)."""
    data = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"fedmf-task-v1").digest(), "big") >> 1


def check_options(task: str, options: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``options``, which may name only options ``defaults`` has."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown {task} task option(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **options}


@dataclass(frozen=True)
class ClientHyper:
    """Local training hyperparameters, the same for every user in a run."""

    client_lr: float
    local_epochs: int
    batch_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "client_lr", checks.positive("client-lr", self.client_lr))
        object.__setattr__(self, "local_epochs", checks.integer("local-epochs", self.local_epochs, minimum=1,
                                                                maximum=10_000))
        object.__setattr__(self, "batch_size", checks.integer("batch-size", self.batch_size, minimum=1))


@dataclass
class LocalResult:
    """One user's local training: the model delta (new − old), examples seen per epoch, metrics."""

    update: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)




class Task(ABC):
    """A federated task. Subclasses set ``name`` and implement ``_validate`` and the abstract methods."""

    name: ClassVar[str] = ""

    def __init__(self, **options: Any) -> None:
        self.options: dict[str, Any] = self._validate(dict(options))

    @classmethod
    @abstractmethod
    def _validate(cls, options: dict[str, Any]) -> dict[str, Any]:
        """All options with defaults filled in; ConfigError on an unknown name or a bad value."""

    @property
    def key(self) -> str:
        """The task and its options as canonical JSON (equal keys: equal tasks)."""
        return json.dumps([self.name, self.options], sort_keys=True, separators=(",", ":"))

    @abstractmethod
    def users(self) -> list[str]:
        """The training population's user ids."""

    @abstractmethod
    def model(self) -> torch.nn.Module:
        """A freshly initialized model, identical in every process (seeded from the options)."""

    @abstractmethod
    def local_update(self, params: Mapping[str, torch.Tensor], user: str, round: int,
                     hyper: ClientHyper) -> LocalResult:
        """Train a fresh model loaded with ``params`` on ``user``'s data; deterministic."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out evaluation (data no training user holds): {"loss", "accuracy"}."""

    @abstractmethod
    def evaluate_user(self, model: torch.nn.Module, user: str) -> tuple[int, dict[str, float]]:
        """(examples, {"loss", "accuracy"}) of ``model`` on ``user``'s own data."""

    def load(self, params: Mapping[str, torch.Tensor], *, into: torch.nn.Module | None = None) -> torch.nn.Module:
        """A fresh model holding ``params`` (names and shapes must match the task's model); with
        ``into``, that model (one of this task's) is loaded instead of a new one built."""
        model = self.model() if into is None else into
        state = model.state_dict()
        if set(params) != set(state):
            raise ConfigError(f"parameters {sorted(params)} do not match the {self.name} model's {sorted(state)}")
        for name, value in params.items():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(state[name].shape):
                raise ConfigError(f"parameter {name!r} must be a tensor of shape {tuple(state[name].shape)}")
        model.load_state_dict(dict(params))
        return model

    def local_updates(self, params: Mapping[str, torch.Tensor], users: Sequence[str], round: int,
                      hyper: ClientHyper, *, vectorized: bool = False,
                      device: str | torch.device | None = None, workers: int = 1,
                      chunk_users: int | None = None) -> dict[str, LocalResult]:
        """``local_update`` of every user in ``users``: {user: result}, in ``users``' order.

        ``workers`` > 1 runs that many users at a time on as many threads (each update on one
        intra-op thread, as always): the same bits as one after another, since every update depends
        only on its own inputs. ``vectorized=True`` asks for the task's batched path (the text
        tasks' LSTM: :mod:`fedmf.tasks.batched_lstm`; other supported tasks:
        :mod:`fedmf.tasks.vectorized`), equal to the sequential one within float tolerance (not
        bit for bit), trained on ``device`` (default: the parameters') ``chunk_users`` users at a
        time (default: the path's own; memory); a task without one loops (on the CPU: ``device``
        must then be None or cpu)."""
        checks.integer("workers", workers, minimum=1, maximum=MAX_WORKERS)
        if chunk_users is not None:
            checks.integer("chunk_users", chunk_users, minimum=1)
        if vectorized:
            batched = self.vectorized_updates(params, users, round, hyper, device=device, chunk_users=chunk_users)
            if batched is not None:
                return batched
        if device is not None and torch.device(device).type != "cpu":
            raise ConfigError(f"task {self.name!r}: only vectorized clients run on {device}; this one trains "
                              "on the CPU")
        users = list(users)
        if workers == 1 or len(users) < 2:
            return {user: self.local_update(params, user, round, hyper) for user in users}
        threads = torch.get_num_threads()
        pool = ThreadPoolExecutor(min(workers, len(users)), thread_name_prefix="fedmf-client")
        try:
            futures = [pool.submit(self.local_update, params, user, round, hyper) for user in users]
            results = [future.result() for future in futures]
        except BaseException:  # a failing user (or Ctrl-C): do not train the users still queued
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:  # the workers' one-thread blocks leave torch's default for new threads at 1: restore it
            pool.shutdown(wait=True)
            torch.set_num_threads(threads)
        return dict(zip(users, results))

    def vectorized_updates(self, params: Mapping[str, torch.Tensor], users: Sequence[str], round: int,
                           hyper: ClientHyper, *, device: str | torch.device | None = None,
                           chunk_users: int | None = None) -> dict[str, LocalResult] | None:
        """The task's batched path for ``local_updates(vectorized=True)``: {user: result}, or None
        when it has none (``local_updates`` then loops). None here;
        :class:`~fedmf.tasks.supervised.SupervisedTask` has one (:mod:`fedmf.tasks.vectorized`),
        :class:`~fedmf.tasks.text.TextTask` another (:mod:`fedmf.tasks.batched_lstm`)."""
        return None

    def vectorized_pad_label(self) -> int | None:
        """The label that pads a batch in the vectorized path (one the task's loss ignores), or None
        when the vectorized path does not handle this task. None here."""
        return None

    def as_local_updates(self, hyper: ClientHyper, *, vectorized: bool = True,
                         device: str | torch.device | None = None, workers: int = 1,
                         chunk_users: int | None = None, with_metrics: bool = False
                         ) -> Callable[[Mapping[str, torch.Tensor], Sequence[Hashable], int], dict[Hashable, Any]]:
        """``local_updates`` in the shape ``fedmf.run.federated.train(local_updates=...)`` calls:
        (params, users, t) -> {user: delta}, the round's users trained together (``vectorized``)
        or ``workers`` at a time (``chunk_users``: see ``local_updates``). ``with_metrics``: each
        user's whole ``LocalResult`` (delta and metrics, for a private client-metric release)."""
        checks.integer("workers", workers, minimum=1, maximum=MAX_WORKERS)
        if chunk_users is not None and not vectorized:
            raise ConfigError("chunk_users is for vectorized clients: give vectorized=True with chunk_users")
        if vectorized and workers > 1:
            raise ConfigError("workers is for one-at-a-time clients: give vectorized=False with workers > 1")

        def local_updates(params: Mapping[str, torch.Tensor], users: Sequence[Hashable], t: int
                          ) -> dict[Hashable, Any]:
            names = {str(user): user for user in users}
            results = self.local_updates(params, list(names), t, hyper, vectorized=vectorized, device=device,
                                         workers=workers, chunk_users=chunk_users)
            return {names[name]: result if with_metrics else result.update for name, result in results.items()}

        return local_updates

    def as_local_update(self, hyper: ClientHyper, *, with_metrics: bool = False
                        ) -> Callable[[Mapping[str, torch.Tensor], Hashable, int], Any]:
        """``local_update`` in the shape ``fedmf.run.federated.train`` calls: (params, user, t) -> delta
        (``with_metrics``: the whole ``LocalResult``, delta and metrics)."""

        def local_update(params: Mapping[str, torch.Tensor], user: Hashable, t: int) -> Any:
            result = self.local_update(params, str(user), t, hyper)
            return result if with_metrics else result.update

        return local_update

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"
