"""How a Flower server learns its population from the nodes, and admits nodes that come later.

A first ``query`` round forms the task and the population from the nodes' reports
(:mod:`.population`) and builds the algorithm and its initial server state; a node whose data
does not fit the task is told why and left out. Nodes that come online later (late joiners,
restarted nodes) are queried and join at the start of the next round. With differential privacy
(``dp_clip``, :mod:`pflego.privacy`) the server builds the accountant and the sensitivity from
the population's reported sample counts; the accountant describes the population formed in the
first round, so nodes that come later are left out of such a run.

Its messages (:class:`Membership` is also the server's side of every message): each client's
content (who it is, the task, the round's ``RoundContext`` and the algorithm's downlink, serialized
once when shared) goes to the node that holds the client through the grid, and the server waits
up to ``round_timeout`` seconds. A client whose node is offline, fails, or does not answer in time
is missing: the reason is kept for the round's event and logged, and the round goes on with the
answers that arrived.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from pflego.algorithms import Algorithm
from pflego.config import Config
from pflego.errors import ConfigError
from pflego.flower.population import Population, Report, Task, form_task
from pflego.flower.records import context_to_record, params_to_record
from pflego.flower.status import MeteredGrid
from pflego.sim import build_algorithm_for, with_step_sizes
from pflego.sim.privacy import Privacy
from pflego.types import RoundContext

log = logging.getLogger("pflego.flower")


def error_text(message: Message) -> str:
    """A one-line description of an error reply."""
    reason = (message.error.reason or "").strip().splitlines()
    return f"error {message.error.code}: {reason[-1] if reason else 'no reason given'}"


class Membership:
    """The population, its nodes and the server's messages to them (the base of ``FlowerServer``).

    Attributes:
        cfg: The run's experiment config (its ``clients`` is how many nodes to wait for).
        join_timeout: Seconds to wait at the start for ``cfg.clients`` nodes.
        declared: The run's declared ``input_shape`` and ``labels`` (``""``: from the nodes).
        grid: The grid the messages go through, counting their bytes.
        round_timeout: Seconds to wait for the replies of one round.
        run_key: Names the run on the nodes' disks (their state files).
        nodes: The node of each known client whose node is online (client id -> node id).
        population: The clients the server knows (``None`` before the first query round).
        algorithm: The run's algorithm (its downlink).
        privacy: The run's differential privacy (local noise is sent to the nodes), or ``None``.
        server: The algorithm's server state.
    """

    cfg: Config
    join_timeout: float
    declared: dict[str, str]
    grid: MeteredGrid
    round_timeout: float
    run_key: str
    nodes: dict[int, int]
    population: Population | None
    algorithm: Algorithm | None
    privacy: Privacy | None
    server: dict[str, Any]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.cfg.dtype)

    def admit(self, reports: dict[int, Report], t: int) -> list[int]:
        """Add the fitting new clients of ``reports`` and map every reporting node.

        Returns the nodes whose data does not fit the task. Under differential privacy a client
        that is not yet a member is left out after the first round (the accountant's population
        is fixed).
        """
        misfits = []
        if t > 0 and self.privacy is not None:
            for node, report in list(reports.items()):
                if self.population.client_of(report.site) is None:
                    log.warning(
                        "node %s (%s) is left out: differential privacy accounts for the "
                        "population of the first round",
                        node,
                        report.site,
                    )
                    del reports[node]
        outcome = self.population.add(reports.values(), t)
        for node, report in reports.items():
            client = outcome[report.site]
            if isinstance(client, str):
                log.warning("node %s (%s) is left out: %s", node, report.site, client)
                misfits.append(node)
                continue
            if self.nodes.get(client, node) != node:
                log.warning(
                    "client %d moved from node %s to node %s", client, self.nodes[client], node
                )
            self.nodes[client] = node
            if self.population.members[client].joined == t and t > 0:
                log.info("round %d: %s joined as client %d", t, report.site, client)
        return misfits

    def wait_for_nodes(self) -> None:
        """Wait until ``config.clients`` nodes are online, or ``join_timeout`` passes (go on)."""
        deadline = time.monotonic() + self.join_timeout
        while len(list(self.grid.get_node_ids())) < self.cfg.clients:
            if time.monotonic() > deadline:
                log.warning(
                    "starting with %d of %d nodes online",
                    len(list(self.grid.get_node_ids())),
                    self.cfg.clients,
                )
                break
            time.sleep(1.0)

    def form_population(self) -> None:
        """The first query round: the task, I, N and each N_i from the nodes' reports."""
        reports = self.query(self.online(), None, "population")
        if not reports:
            raise ConfigError("no node answered the first query round; is any SuperNode up?")
        task = form_task(reports.values(), self.declared["input_shape"], self.declared["labels"])
        self.population = Population(task)
        misfits = self.admit(reports, 0)
        if misfits:  # they are told why, and log it on their side too
            self.query(misfits, task, "refuse")
        if not self.population.members:
            raise ConfigError("no node's data fits the run (see the log); nothing to train")
        if self.cfg.sampling == "uniform-count" and self.cfg.max_cohort > len(
            self.population.members
        ):
            raise ConfigError(
                f"max_cohort={self.cfg.max_cohort} exceeds the {len(self.population.members)} "
                "clients whose nodes reported; lower it or start more nodes"
            )
        self.build()
        self.server = self.algorithm.initial_server(self.cfg.seed, self.dtype)
        log.info(
            "population: I=%d clients, N=%d training samples, %d labels, inputs %s, K_max=%d",
            self.population.num_clients,
            self.population.total_train,
            task.num_classes,
            task.input_shape,
            task.max_classes,
        )

    def build(self) -> None:
        """The model and algorithm of the task; unset step sizes become the algorithm's
        defaults in the config (so ``config.yaml`` records them, as in the simulator)."""
        task = self.population.task
        self.algorithm = build_algorithm_for(
            self.cfg, task.input_shape, task.num_classes, task.max_classes
        )
        self.cfg = with_step_sizes(self.cfg, self.algorithm)
        sizes = torch.tensor([m.n_train for m in self.population.members])
        self.privacy = Privacy.build(self.cfg, self.algorithm, sizes)

    def discover(self, t: int) -> None:
        """Query online nodes whose client is unknown: restarted nodes and late joiners."""
        new = sorted(set(self.online()) - set(self.nodes.values()))
        if new:
            self.admit(self.query(new, self.population.task, f"join-{t}"), t)

    def run_record(self, **values: Any) -> ConfigRecord:
        """The ``pflego`` record of a message: the run key (nodes' state files) and more."""
        return ConfigRecord({"run": self.run_key, **values})

    def query(self, nodes: Sequence[int], task: Task | None, group: str) -> dict[int, Report]:
        """Ask ``nodes`` for their reports; with ``task``, nodes whose data misfits refuse (logged)."""
        content = RecordDict({"pflego": self.run_record()})
        if task is not None:
            content["task"] = ConfigRecord(task.to_record())
        messages = [
            Message(content, dst_node_id=node, message_type="query", group_id=group)
            for node in nodes
        ]
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
        """Each client's part of the :class:`~pflego.types.Downlink` (``evaluation``: the one
        evaluation predicts with); a shared payload is the same object for every client."""
        sent = self.algorithm.send(self.server, ctx, torch.as_tensor(list(clients)), evaluation)
        return [sent.of(k) for k in range(len(clients))]

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
            Message(content, dst_node_id=self.nodes[c], message_type=message_type, group_id=group)
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
