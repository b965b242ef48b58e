"""An in-process Flower grid: the ServerApp's loop and the ClientApp run in one Python process.

It passes real Flower ``Message`` objects between :class:`~pflego.flower.server.FlowerServer` and
:data:`~pflego.flower.apps.client_app`, with one ``Context`` per node, so the whole Flower path
(records, ClientApp, server loop) runs without daemons. Tests use it to compare with the
simulator; ``drop`` simulates nodes that fail or never answer. :func:`load_node` gives one
partition's node directly.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from pflego.config import Config
from pflego.flower.node import ClientNode, PartitionSource
from pflego.flower.records import encode_config

RUN_ID = 1


class InProcessGrid:
    """A grid whose nodes are ``Context`` objects served by a ``ClientApp`` in this process.

    It answers the two calls the server makes of a Flower ``Grid``: ``get_node_ids`` and
    ``send_and_receive``.

    Args:
        client_app: The ClientApp every node runs.
        config: The run's experiment config (sent as the run config).
        state_dir: Where nodes save client states.
        node_ids: Node ids, one per client (default ``1000 + i``).
        drop: ``drop(node_id, message) -> None | "error" | "silent"``: make a node fail with an
            error reply or never answer.
        node_configs: Each node's node config (default: ``partition-id=i`` for node i).
        run_config: Entries added to the run config.
    """

    def __init__(
        self,
        client_app: Callable[[Message, Context], Message],
        config: Config,
        state_dir: str | Path,
        node_ids: Iterable[int] | None = None,
        drop: Callable[[int, Message], str | None] | None = None,
        node_configs: list[dict] | None = None,
        run_config: dict | None = None,
    ) -> None:
        if node_configs is None:
            node_configs = [
                {"partition-id": i, "num-partitions": config.clients} for i in range(config.clients)
            ]
        ids = (
            list(node_ids) if node_ids is not None else [1000 + i for i in range(len(node_configs))]
        )
        self.run_config = {
            "pflego-config": encode_config(config),
            "state-dir": str(state_dir),
            **(run_config or {}),
        }
        self.client_app = client_app
        self.contexts: dict[int, Context] = {}
        for node, node_config in zip(ids, node_configs):
            self.add_node(node, node_config)
        # What the ServerApp process sets up in a deployment: lets ``Message(...)`` be built.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 1
        self.drop = drop or (lambda node, message: None)
        self.sent: list[Message] = []

    def add_node(self, node: int, node_config: dict) -> None:
        """Bring a node online (a late joiner, or a restarted node with a new id)."""
        self.contexts[node] = Context(
            RUN_ID, node, dict(node_config), RecordDict(), dict(self.run_config)
        )

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if node not in self.contexts:
                replies.append(Message(Error(5, "node unavailable"), reply_to=message))
                continue
            fault = self.drop(node, message)
            if fault == "silent":
                continue
            if fault == "error":
                replies.append(Message(Error(0, "injected failure"), reply_to=message))
                continue
            # What a node receives is a copy, as after the wire (a shared content would be
            # changed by one node for the next: SecAgg+'s mod pops its stage key).
            delivered = Message(content=copy.deepcopy(message.content), metadata=message.metadata)
            try:
                replies.append(self.client_app(delivered, self.contexts[node]))
            except Exception:  # noqa: BLE001  (a failing ClientApp becomes an error reply)
                replies.append(Message(Error(0, traceback.format_exc()), reply_to=message))
        return replies


def load_node(config: Config, partition: int) -> ClientNode:
    """The node of partition ``partition`` as client ``partition`` (the run's own task)."""
    source = PartitionSource(config, partition)
    return source.node(partition, source.task)
