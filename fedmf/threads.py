"""Intra-op thread control for memory-bound passes."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["one_thread"]


@contextlib.contextmanager
def one_thread(device: torch.device | str | None = None) -> Iterator[None]:
    """Run torch's CPU ops on one intra-op thread inside the block (results then do not depend
    on the process's thread count, and memory-bound passes skip an OpenMP team's wake-ups,
    which cost more than they save at these sizes on a busy machine). No-op for accelerators.
    It sets torch's process-wide thread count for the block: use it from one thread at a time
    (a thread that first touches torch inside another thread's block starts with one thread)."""
    if device is not None and torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
