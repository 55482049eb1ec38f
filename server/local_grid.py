"""An in-process Flower ``Grid``: nodes are functions Message → reply (or None: no reply).

For tests and benchmarks: it drives the real strategy against ClientApp handlers (or prepared
replies) in one process, without a SuperLink. ``client_node(app, node_config)`` wraps a
``ClientApp`` as such a node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

__all__ = ["LocalGrid", "client_node", "Node"]

Node = Callable[[Message], "Message | None"]


def client_node(app, node_config: Mapping[str, object], node_id: int = 0, run_config: Mapping | None = None) -> Node:
    """A node that answers with ``app`` (a ``flwr.clientapp.ClientApp``) under ``node_config``."""
    context = Context(run_id=1, node_id=node_id, node_config=dict(node_config), state=RecordDict(),
                      run_config=dict(run_config or {}))

    def node(message: Message) -> Message | None:
        return app(message, context)

    return node


class LocalGrid(Grid):
    """A Grid over in-process nodes (``{node_id: node}``, changeable between rounds)."""

    def __init__(self, nodes: Mapping[int, Node]) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):  # what a Flower runtime sets
            if getattr(TaskIdentity, name) is None:
                setattr(TaskIdentity, name, value)
        self.nodes: dict[int, Node] = dict(nodes)
        self._run = None
        self._outbox: dict[str, Message] = {}
        self._pushed = 0
        self.sent: list[Message] = []

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            self._pushed += 1
            message_id = f"m{self._pushed}"
            message.metadata.__dict__["_message_id"] = message_id  # as Flower's grids do: replies refer to it
            self._outbox[message_id] = message
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for message_id in message_ids:
            message = self._outbox.pop(message_id)
            node = self.nodes.get(message.metadata.dst_node_id)
            reply = node(message) if node is not None else None
            if reply is not None:
                replies.append(reply)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        self.sent.extend(messages)
        return list(self.pull_messages(self.push_messages(messages)))
