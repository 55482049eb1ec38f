"""Which user is behind which Flower node.

The ledger identifies users, not Flower node ids: a user who reconnects under a new node id is
the same user. The server asks every node it has not identified yet, with one QUERY message,
for its user id; the ClientApp answers from its ``node_config`` (``user-id`` in deployment —
trusted, as documented — or the simulation's ``partition-id``). Nodes that do not answer, or
answer badly, are not available this round.
"""

from __future__ import annotations

import logging
from typing import Iterable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

__all__ = ["NodeDirectory", "IDENTITY_RECORD"]

IDENTITY_RECORD = "identity"
_MAX_USER_ID = 200
log = logging.getLogger("fedmf.server")


def _parse_identity(reply: Message) -> str | None:
    if reply.has_error() or not reply.has_content():
        return None
    record = reply.content.config_records.get(IDENTITY_RECORD)
    if record is None:
        return None
    user = record.get("user-id")
    if not isinstance(user, str) or not user or len(user) > _MAX_USER_ID or not user.isprintable():
        return None
    return user


class NodeDirectory:
    """node id → user id, learned by QUERY messages and kept for the server's lifetime."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._user_of: dict[int, str] = {}
        self._failed: set[int] = set()

    def user_of(self, node_id: int) -> str | None:
        return self._user_of.get(node_id)

    def refresh(self, grid: Grid) -> dict[str, int]:
        """The users reachable now: user id → its current node id (the newest node when a user
        reconnected; a user claimed by two live nodes at once is left out)."""
        live = [int(n) for n in grid.get_node_ids()]
        unknown = [n for n in live if n not in self._user_of and n not in self._failed]
        if unknown:
            self._identify(grid, unknown)
        claims: dict[str, list[int]] = {}
        for node in live:
            user = self._user_of.get(node)
            if user is not None:
                claims.setdefault(user, []).append(node)
        reachable = {}
        for user, nodes in claims.items():
            if len(nodes) == 1:
                reachable[user] = nodes[0]
            else:
                log.warning("fedmf: %d live nodes claim the same user; none of them is selected this round",
                            len(nodes))
        return reachable

    def _identify(self, grid: Grid, nodes: Iterable[int]) -> None:
        messages = [Message(RecordDict({"config": ConfigRecord({"request": "identity"})}), dst_node_id=node,
                            message_type=MessageType.QUERY) for node in nodes]
        asked = set(nodes)
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            try:  # nothing a node sends may stop the server
                node = int(reply.metadata.src_node_id)
            except Exception:
                log.warning("fedmf: an identity reply without a valid sender was ignored")
                continue
            if node not in asked:
                continue
            try:
                user = _parse_identity(reply)
            except Exception:
                user = None
            if user is None:
                self._failed.add(node)  # answered badly: never selected (a silent node is asked again)
            else:
                self._user_of[node] = user
