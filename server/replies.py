"""A round's replies, validated as Flower messages before anything reaches the engine.

A reply counts only if it comes from the node of a user selected for this round, answers this
round of this server process (round and nonce), carries no error, is the first from its user,
holds exactly the records the ClientApp sends (``arrays``, ``config`` with exactly round,
run-nonce and user-id, optionally ``metrics`` with only num-examples and train-loss: never published
as sent; see ``losses``), and its
arrays have the model's names, shapes, a floating dtype and at most the bytes that shape and
dtype need as ``.npy`` (checked from the metadata, before anything is converted). Anything else
is rejected with a reason (recorded in the ledger when the sender is a known user) and never
aggregated; nothing a client sends can crash the server. The update's values are checked by
``fedmf.round.privatize``.

Memory: Flower's ``Grid.send_and_receive`` returns every reply of the round already received and
decoded (the bytes are in this process before any check can run). ``RoundReplies.read`` empties
that list as it reads it, so a rejected reply is released at once, and an accepted update's
bytes are released once the engine has read it: one reply costs one model's worth, as bounded
here, for as long as the round needs it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedmf.checks import FLOATING_DTYPES

from .identity import NodeDirectory

__all__ = ["RoundReplies", "max_array_bytes", "max_update_bytes", "npy_header_max_bytes",
           "CONFIG_KEYS", "METRIC_KEYS"]

log = logging.getLogger("fedmf.server")
#: the floating dtypes an update may use, and their bytes per value
_ITEMSIZE = FLOATING_DTYPES
#: the records a TRAIN reply holds (client/app.py ``train``), by name
_RECORDS = {"arrays": ArrayRecord, "config": ConfigRecord, "metrics": MetricRecord}
CONFIG_KEYS = frozenset({"round", "run-nonce", "user-id"})
METRIC_KEYS = frozenset({"num-examples", "train-loss"})


def npy_header_max_bytes(ndim: int) -> int:
    """An upper bound of the ``.npy`` header numpy writes for an ``ndim``-dimensional array (the
    format of Flower's ``Array.data``; NEP 1, "A simple file format for NumPy arrays"): a 12-byte
    preamble at most (version 2.0), the header dict (about 60 characters plus up to 21 per
    dimension: 19 digits of an int64, a comma and a space), numpy's 21 spaces of room for the
    first dimension to grow and a newline, padded to a multiple of 64 bytes."""
    return 12 + 60 + 21 * ndim + 22 + 63


def max_array_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """The most bytes an array of ``shape`` in the floating ``dtype`` takes as ``.npy``."""
    return _ITEMSIZE[dtype] * math.prod(shape) + npy_header_max_bytes(len(shape))


def max_update_bytes(layout: Mapping[str, tuple[int, ...]]) -> int:
    """The most bytes an update's arrays may take (every array in float64, the widest dtype
    accepted): the bound on what one reply's arrays may cost the server."""
    return sum(max_array_bytes(tuple(shape), "float64") for shape in layout.values())


class UnreadableArrays:
    """Stands for a reply whose arrays could not be converted to tensors."""


class LazyUpdates(Mapping):
    """user → update tensors, converted from the reply's ArrayRecord only when read: the engine
    reads each update once, so the converted tensors of one user at a time are alive, not all
    of them (at 1,000 users × 16 MB that is 16 GB less). Reading an update releases its record:
    a second read of the same user raises KeyError."""

    def __init__(self) -> None:
        self._users: dict[str, None] = {}  # every accepted user, in order, read or not
        self._records: dict[str, ArrayRecord] = {}  # the records not read yet

    def add(self, user: str, record: ArrayRecord) -> None:
        self._users[user] = None
        self._records[user] = record

    def __getitem__(self, user: str) -> dict[str, Any]:
        if user in self._users and user not in self._records:
            raise KeyError(f"this update was already read (its bytes are released): {user!r}")
        record = self._records.pop(user)
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
        return user in self._users

    def __iter__(self) -> Iterator[str]:
        return iter(self._users)

    def __len__(self) -> int:
        return len(self._users)


class RoundReplies:
    """Collects round ``t``'s replies: ``updates`` (user → tensors) and ``rejected`` (user → reason)."""

    def __init__(self, t: int, nonce: str, expected: Mapping[str, int], nodes: NodeDirectory) -> None:
        self.t, self.nonce, self.expected, self.nodes = t, nonce, dict(expected), nodes
        self._user_by_node = {node: user for user, node in expected.items()}
        self.updates = LazyUpdates()
        self.rejected: dict[str, str] = {}
        self.unknown = 0  # replies from nodes with no known user (not recordable in the ledger)
        self._losses: dict[str, Any] = {}  # user → reported train-loss, as sent (the engine clips it)

    def read(self, replies: Iterable[Message], layout: Mapping[str, tuple[int, ...]]) -> None:
        """Read the round's replies in order. A list (what ``Grid.send_and_receive`` returns) is
        emptied as it is read, so that each reply is released as soon as it has been read."""
        if isinstance(replies, list):
            replies.reverse()
            while replies:  # no name keeps a reply alive past its turn
                self._read_guarded(replies.pop(), layout)
        else:
            for reply in replies:
                self._read_guarded(reply, layout)

    def _read_guarded(self, reply: Message, layout: Mapping[str, tuple[int, ...]]) -> None:
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
        reason = _unexpected_content(content, config)
        if reason is not None:
            return self._reject(user, reason)
        if set(arrays.keys()) != set(layout):
            return self._reject(user, "update names differ from the model's")
        for name, array in arrays.items():
            shape, dtype = tuple(getattr(array, "shape", ())), str(getattr(array, "dtype", ""))
            if shape != tuple(layout[name]) or dtype not in _ITEMSIZE:
                return self._reject(user, f"{name}: shape {shape} / dtype {dtype!r} do not match the model")
            size, limit = len(array.data), max_array_bytes(shape, dtype)
            if size > limit:  # from the metadata: nothing is decoded
                return self._reject(user, f"{name}: {size} bytes, more than the {limit} its shape in {dtype} needs")
        self.updates.add(user, arrays)
        metrics = content.metric_records.get("metrics")
        if metrics is not None and "train-loss" in metrics:
            value = metrics.get("train-loss")  # num-examples is never read: no weighting
            # a number as sent (a list, say, is kept as None: it counts as 0 in the private release)
            self._losses[user] = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        return None

    def losses(self) -> dict[str, Any]:
        """The training loss each accepted reply reported, user → value as sent. Never published: only
        a plan's private client-metric release reads it (``fedmf.round.client_metrics``: clipped to [0, L],
        a missing or non-finite value counting as 0, summed, noised, ÷ the planned users)."""
        return dict(self._losses)


def _unexpected_content(content: RecordDict, config: ConfigRecord) -> str | None:
    """Why the reply holds more than the ClientApp sends (client/app.py ``train``), or None.
    Names chosen by the client are never echoed: reasons go to the ledger and the logs."""
    extra = [(name, record) for name, record in content.items() if not isinstance(record, _RECORDS.get(name, ()))]
    if extra:
        kinds = sorted({f"{name!r} as a {type(record).__name__}" if name in _RECORDS else type(record).__name__
                        for name, record in extra})
        return f"reply has {len(extra)} unexpected record(s): {', '.join(kinds)}"
    surplus = len(set(config.keys()) - CONFIG_KEYS)
    if surplus:
        return f"config record has {surplus} unexpected key(s)"
    metrics = content.metric_records.get("metrics")
    surplus = 0 if metrics is None else len(set(metrics.keys()) - METRIC_KEYS)
    if surplus:
        return f"metrics record has {surplus} unexpected key(s)"
    return None
