"""A round's replies, validated as Flower messages before anything reaches the engine.

A reply counts only if it comes from the node of a user selected for this round, answers this
round of this server process (round and nonce), carries no error, is the first from its user,
and holds an ``arrays`` record that converts to tensors. Anything else is rejected with a
reason (recorded in the ledger when the sender is a known user) and never aggregated; nothing a
client sends can crash the server. The update's values are checked by ``fedmf.privatize``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Iterator, Mapping

from flwr.app import ArrayRecord, Message

from .identity import NodeDirectory

__all__ = ["RoundReplies"]

log = logging.getLogger("fedmf.server")
_FLOATING = {"float16", "bfloat16", "float32", "float64"}


class UnreadableArrays:
    """Stands for a reply whose arrays could not be converted to tensors."""


class LazyUpdates(Mapping):
    """user → update tensors, converted from the reply's ArrayRecord only when read: the engine
    reads each update once, so the converted tensors of one user at a time are alive, not all
    of them (at 1,000 users × 16 MB that is 16 GB less)."""

    def __init__(self) -> None:
        self._records: dict[str, ArrayRecord] = {}

    def add(self, user: str, record: ArrayRecord) -> None:
        self._records[user] = record

    def __getitem__(self, user: str) -> dict[str, Any]:
        record = self._records[user]
        try:
            tensors = record.to_torch_state_dict()
        except Exception:  # a damaged payload: the engine rejects it as not a mapping of tensors
            return UnreadableArrays()
        for name, array in record.items():  # the decoded .npy header must agree with the metadata checked
            tensor = tensors.get(name)
            if tensor is None or tuple(tensor.shape) != tuple(array.shape) or str(tensor.dtype) != f"torch.{array.dtype}":
                return UnreadableArrays()
        return tensors

    def __contains__(self, user: object) -> bool:  # without converting anything
        return user in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


class RoundReplies:
    """Collects round ``t``'s replies: ``updates`` (user → tensors) and ``rejected`` (user → reason)."""

    def __init__(self, t: int, nonce: str, expected: Mapping[str, int], nodes: NodeDirectory) -> None:
        self.t, self.nonce, self.expected, self.nodes = t, nonce, dict(expected), nodes
        self._user_by_node = {node: user for user, node in expected.items()}
        self.updates = LazyUpdates()
        self.rejected: dict[str, str] = {}
        self.unknown = 0  # replies from nodes with no known user (not recordable in the ledger)
        self._losses: dict[str, tuple[float, float]] = {}

    def read(self, replies: Iterable[Message], layout: Mapping[str, tuple[int, ...]]) -> None:
        for reply in replies:
            try:
                self._read_one(reply, layout)
            except Exception as e:  # a malformed message must never stop the round
                user = self._sender(reply)
                if user is not None and user not in self.updates:
                    self.rejected.setdefault(user, f"malformed reply ({type(e).__name__})")
                else:
                    self.unknown += 1

    def _sender(self, reply: Message) -> str | None:
        try:
            node = int(reply.metadata.src_node_id)
        except Exception:
            return None
        return self._user_by_node.get(node) or self.nodes.user_of(node)

    def _reject(self, user: str | None, reason: str) -> None:
        if user is None:
            self.unknown += 1
            log.warning("fedmf round %d: reply rejected (%s)", self.t, reason)
        elif user not in self.updates and user not in self.rejected:
            self.rejected[user] = reason

    def _read_one(self, reply: Message, layout: Mapping[str, tuple[int, ...]]) -> None:
        node = int(reply.metadata.src_node_id)
        user = self._user_by_node.get(node)
        if user is None:
            return self._reject(self.nodes.user_of(node), f"reply from a node not selected for round {self.t}")
        if user in self.updates or user in self.rejected:
            # one reply per user: a second one is refused and the first stands
            log.warning("fedmf round %d: a second reply from one user ignored", self.t)
            return None
        if reply.has_error():
            return self._reject(user, f"client error (code {reply.error.code})")
        if not reply.has_content():
            return self._reject(user, "empty reply")
        content = reply.content
        config = content.config_records.get("config")
        if config is None:
            return self._reject(user, "reply has no config record")
        if config.get("round") != self.t or config.get("run-nonce") != self.nonce:
            return self._reject(user, f"reply for another round or server (round {config.get('round')!r})")
        if config.get("user-id") != user:
            return self._reject(user, "reply names another user")
        arrays = content.array_records.get("arrays")
        if arrays is None:
            return self._reject(user, "reply has no arrays record")
        if set(arrays.keys()) != set(layout):
            return self._reject(user, "update names differ from the model's")
        for name, array in arrays.items():
            shape, dtype = tuple(getattr(array, "shape", ())), str(getattr(array, "dtype", ""))
            if shape != tuple(layout[name]) or dtype not in _FLOATING:
                return self._reject(user, f"{name}: shape {shape} / dtype {dtype!r} do not match the model")
        self.updates.add(user, arrays)
        metrics = content.metric_records.get("metrics")
        if metrics is not None:
            loss, count = metrics.get("train-loss"), metrics.get("num-examples")
            try:
                loss, count = float(loss), float(count)
            except (TypeError, ValueError, OverflowError):
                return None
            if math.isfinite(loss) and math.isfinite(count) and count > 0:
                self._losses[user] = (loss, count)
        return None

    def metrics(self, contributed: Iterable[str]) -> dict[str, float]:
        """Client-reported training loss of the ``contributed`` users (weighted by examples):
        outside the DP guarantee, as Flower documents for its metrics."""
        pairs = [self._losses[u] for u in contributed if u in self._losses]
        total = math.fsum(c for _, c in pairs)
        if total <= 0:
            return {}
        mean = math.fsum(loss * (c / total) for loss, c in pairs)  # weights ≤ 1: no overflow
        return {"train-loss": mean} if math.isfinite(mean) else {}
