"""Intra-op thread control for memory-bound passes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["one_thread"]


@contextlib.contextmanager
def one_thread(device: torch.device | str | None = None) -> Iterator[None]:
    """Run torch's CPU ops on one intra-op thread inside the block (results then do not depend
    on the process's thread count, and memory-bound passes skip an OpenMP team's wake-ups,
    which cost more than they save at these sizes on a busy machine). No-op for accelerators.
    The count it sets is the calling thread's (OpenMP's per-thread nthreads-var): blocks in
    several threads at once do not change each other's count or the main thread's, but a thread
    that first touches torch while a block is open starts with one thread (torch also records
    the last count set as new threads' default)."""
    if device is not None and torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
