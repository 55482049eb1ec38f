"""Redo a round when the ledger fails: the bounded retry both drivers give ``run_rounds``.

    run_rounds(..., retry=ledger_retry((ConcurrentChargeError,), log=log))

A failure of ``errors`` in round t's guard or round step (``fedmf.run.loop``: the round was
aborted before its commit, so nothing of it was released) is retried after 1, 2, 4, … s (at most
30 s), up to 8 times; the last failure is raised. The Flower strategy retries every ``LedgerError``
(a database that went away); the in-process ``train`` the concurrent budget charge only
(``fedmf.budgets.ConcurrentChargeError``: another run spent a selected user's lifetime
budget first; redone, the round passes over that user).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ..ledger.db import LedgerError
from .loop import GUARD, ROUND, Retry

__all__ = ["ledger_retry", "LEDGER_RETRIES", "LEDGER_BACKOFF_S", "LEDGER_BACKOFF_MAX_S"]

T = TypeVar("T")
#: a round whose ledger write fails is redone after 1, 2, 4, … s (at most 30 s), up to 8 times
LEDGER_RETRIES, LEDGER_BACKOFF_S, LEDGER_BACKOFF_MAX_S = 8, 1.0, 30.0
#: what a ledger failure at each stage of the round loop left, for the retry's log line
_GIVEN_UP = {GUARD: "the round has not started", ROUND: "the round was aborted and nothing of it was released"}


def ledger_retry(errors: tuple[type[BaseException], ...] = (LedgerError,), *, retries: int | None = None,
                 backoff_s: float | None = None, backoff_max_s: float | None = None,
                 log: logging.Logger | None = None, sleep: Callable[[float], None] | None = None) -> Retry:
    """A ``Retry`` for ``run_rounds`` that redoes a step failing with one of ``errors`` (defaults:
    this module's constants, read when the retry runs)."""
    logger = log or logging.getLogger("fedmf")

    def retry(t: int, step: Callable[[], T], stage: str) -> T:
        most = LEDGER_RETRIES if retries is None else retries
        first = LEDGER_BACKOFF_S if backoff_s is None else backoff_s
        cap = LEDGER_BACKOFF_MAX_S if backoff_max_s is None else backoff_max_s
        for attempt in range(most + 1):
            try:
                return step()
            except errors as e:
                if attempt == most:
                    raise
                wait = min(cap, first * 2 ** attempt)
                logger.warning("fedmf round %d: the ledger failed (%s); %s; retry %d/%d in %.3g s", t, e,
                               _GIVEN_UP[stage], attempt + 1, most, wait)
                (sleep or time.sleep)(wait)
        raise AssertionError("unreachable")

    return retry
