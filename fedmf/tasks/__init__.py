"""Federated tasks by name (no Flower here: the in-process loop uses them too).

    task = get_task("tiny", num_users=20, seed=0)
    result = task.local_update(task.model().state_dict(), task.users()[0], 0, ClientHyper(0.1, 1, 16))
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError
from .base import ClientHyper, LocalResult, Task, stable_seed
from .supervised import SupervisedTask

__all__ = ["get_task", "TASKS", "Task", "SupervisedTask", "ClientHyper", "LocalResult", "stable_seed"]

#: task name -> "module:Class" (imported on first use, so a heavy task costs nothing until asked for)
_REGISTRY: dict[str, str] = {
    "tiny": "fedmf.tasks.tiny:TinyTask",
    "stackoverflow": "fedmf.tasks.stackoverflow:StackOverflowTask",
    "so-synthetic": "fedmf.tasks.stackoverflow:SyntheticStackOverflowTask",
    "shakespeare": "fedmf.tasks.shakespeare:ShakespeareTask",
}

#: the task names get_task knows
TASKS: tuple[str, ...] = tuple(sorted(_REGISTRY))


def get_task(name: str, **options: Any) -> Task:
    """A new task ``name`` with ``options`` (validated: ConfigError on an unknown name or bad value)."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    module, _, cls = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
