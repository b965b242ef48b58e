"""A Flower server's messages to its clients' nodes, and why a client's answer is missing.

:class:`NodeMessaging` builds each client's message content (who it is, the task, the round's
``RoundContext`` and the algorithm's downlink, serialized once when shared), maps clients to the
nodes that hold them, sends the messages through the grid and waits up to ``round_timeout``
seconds. A client whose node is offline, fails, or does not answer in time is missing: the reason
is kept for the round's event and logged, and the round goes on with the answers that arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from pflego import tree
from pflego.algorithms import Algorithm
from pflego.flower.population import Population, Report, Task
from pflego.flower.records import context_to_record, params_to_record
from pflego.flower.status import MeteredGrid
from pflego.types import RoundContext

if TYPE_CHECKING:
    from pflego.sim.privacy import Privacy

log = logging.getLogger("pflego.flower")


def error_text(message: Message) -> str:
    """A one-line description of an error reply."""
    reason = (message.error.reason or "").strip().splitlines()
    return f"error {message.error.code}: {reason[-1] if reason else 'no reason given'}"


class NodeMessaging:
    """The server's side of its messages to the nodes (a base of ``FlowerServer``).

    Attributes:
        grid: The grid the messages go through, counting their bytes.
        round_timeout: Seconds to wait for the replies of one round.
        run_key: Names the run on the nodes' disks (their state files).
        nodes: The node of each known client whose node is online (client id -> node id).
        population: The clients the server knows (``None`` before the first query round).
        algorithm: The run's algorithm (its downlink).
        privacy: The run's differential privacy (local noise is sent to the nodes), or ``None``.
        server: The algorithm's server state.
    """

    grid: MeteredGrid
    round_timeout: float
    run_key: str
    nodes: dict[int, int]
    population: Population | None
    algorithm: Algorithm | None
    privacy: Privacy | None
    server: dict[str, Any]

    def message(self, content: RecordDict, message_type: str, node: int, group: str) -> Message:
        return Message(content, dst_node_id=node, message_type=message_type, group_id=group)

    def run_record(self, **values: Any) -> ConfigRecord:
        """The ``pflego`` record of a message: the run key (nodes' state files) and more."""
        return ConfigRecord({"run": self.run_key, **values})

    def query(self, nodes: Sequence[int], task: Task | None, group: str) -> dict[int, Report]:
        """Ask ``nodes`` for their reports; with ``task``, nodes whose data misfits refuse (logged)."""
        content = RecordDict({"pflego": self.run_record()})
        if task is not None:
            content["task"] = ConfigRecord(task.to_record())
        messages = [self.message(content, "query", node, group) for node in nodes]
        reports = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.round_timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("node %s is left out: %s", node, error_text(reply))
            else:
                reports[node] = Report.from_record(reply.content["report"])
        return reports

    def online(self) -> list[int]:
        """Online nodes; forgets the nodes of clients that went offline."""
        online = set(self.grid.get_node_ids())
        self.nodes = {c: n for c, n in self.nodes.items() if n in online}
        return sorted(online)

    def client_records(self, client: int, ctx: RoundContext) -> dict[str, ConfigRecord]:
        """A client's round records: who it is (name, id, run key), the task and the context."""
        site = self.population.members[client].site
        local_noise = self.privacy is not None and self.privacy.local
        noise = {"dp-noise": float(self.privacy.noise)} if local_noise else {}
        return {
            "pflego": self.run_record(client=client, site=site, **noise),
            "task": ConfigRecord(self.population.task.to_record()),
            "ctx": context_to_record(ctx),
        }

    def payloads(
        self, clients: Sequence[int], ctx: RoundContext, evaluation: bool = False
    ) -> list[dict[str, torch.Tensor]]:
        """Each client's downlink (``evaluation``: the one evaluation predicts with): per-client
        payloads stacked on axis 0, or one shared payload."""
        payload = self.algorithm.evaluation_downlink if evaluation else self.algorithm.downlink
        if self.algorithm.per_client_downlink:
            return list(tree.unstack(payload(self.server, ctx, torch.as_tensor(list(clients)))))
        return [payload(self.server, ctx)] * len(clients)

    def contents(
        self, clients: Sequence[int], ctx: RoundContext, evaluation: bool = False
    ) -> dict[int, RecordDict]:
        """Each client's message content (a shared downlink is serialized once)."""
        records: dict[int, Any] = {}
        out = {}
        for client, payload in zip(clients, self.payloads(clients, ctx, evaluation), strict=True):
            if id(payload) not in records:
                records[id(payload)] = params_to_record(payload)
            out[client] = RecordDict(
                {"downlink": records[id(payload)], **self.client_records(client, ctx)}
            )
        return out

    def exchange(
        self, contents: dict[int, RecordDict], message_type: str, group: str
    ) -> tuple[dict[int, Message], dict[int, str]]:
        """Send each client's content to its node; returns the replies and why others are missing."""
        missing = {c: "no node holds this client" for c in contents if c not in self.nodes}
        messages = [
            self.message(content, message_type, self.nodes[c], group)
            for c, content in contents.items()
            if c in self.nodes
        ]
        client_of = {self.nodes[c]: c for c in contents if c in self.nodes}
        replies: dict[int, Message] = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.round_timeout):
            client = client_of.get(reply.metadata.src_node_id)
            if client is None:
                continue
            if reply.has_error():
                missing[client] = error_text(reply)
            else:
                replies[client] = reply
        for client in client_of.values():
            if client not in replies and client not in missing:
                missing[client] = f"no reply within {self.round_timeout:g} s"
        return replies, missing

    def note_missing(self, t: int, phase: str, missing: dict[int, str]) -> None:
        """Log each missing client of round ``t``'s ``phase`` with its node and why."""
        for client, why in sorted(missing.items()):
            log.warning(
                "round %d %s: client %d (node %s) missing: %s",
                t,
                phase,
                client,
                self.nodes.get(client, "-"),
                why,
            )
