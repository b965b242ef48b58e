"""The generic server loop on a Flower ``Grid``: one loop for every registered algorithm.

:class:`FlowerServer` waits for the nodes and learns the population from them: a first ``query``
round forms the task and the population from the nodes' reports (:mod:`.population`) and builds
the algorithm and its initial server state; a node whose data does not fit the task is told why
and left out. Nodes that come online later (late joiners, restarted nodes) are queried and join at
the start of the next round. With differential privacy (``dp_clip``, :mod:`pflego.privacy`) the
accountant and the sensitivity come from the population's reported sample counts; the accountant
describes the population formed in the first round, so nodes that come later are left out of
such a run.

Then it runs every training round (the engine's round with Flower messages as its transport,
:mod:`.training`) and evaluates on the simulator's schedule: every client's node (or that of each
client in the simulator's fixed sample ``eval_clients``) evaluates its personalized model and
answers one row, summarized as in the simulator, with what the Flower run knows besides (the
clients evaluated, the SecAgg+ step and largest error bound of the period, the privacy spent, the
non-finite updates dropped since the last evaluation). Each client's message (who it is, the task,
the round's ``RoundContext`` and the algorithm's downlink, serialized once when shared) goes to
the node that holds the client, and the server waits up to ``round_timeout`` seconds; a client
whose node is offline, fails, or does not answer in time is missing: the reason is kept for the
round's event and logged, and the round goes on with the answers that arrived. A run that Flower
cannot do is refused first (:mod:`.unsupported`). A run that diverges (``DivergedError``: a
round whose every update or whose server state is not finite, or the simulator's divergence check
of the training loss under ``divergence=stop``) stops and is logged in ``flower.jsonl`` as phase
``diverged`` (``pflego flower local`` then exits with code 3). Each round prints and logs a
status line (sampled / answered / failed clients, bytes down and up, seconds per phase,
:mod:`.status`).

After every round the server saves its state atomically in the run directory (``checkpoint.pt``):
the next round, the algorithm's server state, the population, the records, the dropped updates,
the seconds spent, the run key and the config. A restarted ServerApp given ``resume`` loads it,
rebuilds the algorithm, rewinds the run directory to the checkpoint and continues (the nodes keep
their clients' states on their disks under the same run key). A simulator checkpoint is refused.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from pflego.config import Config, to_dict
from pflego.environment import CHECKPOINT_FORMAT, environment, pflego_version
from pflego.errors import ConfigError, DivergedError
from pflego.flower.population import Population, Report, Task, form_task
from pflego.flower.records import context_to_record, params_to_record
from pflego.flower.secure import SecureAggregation
from pflego.flower.status import EVENTS, MeteredGrid, log_event, status_line, timed
from pflego.flower.training import PlainTransport, SecureTransport
from pflego.flower.unsupported import refuse_unsupported
from pflego.history import History, RunDir
from pflego.sim import (
    build_algorithm_for,
    evaluation_due,
    evaluation_record,
    evaluation_sample,
    with_step_sizes,
)
from pflego.sim.engine import (
    Callback,
    Checkpoints,
    Curves,
    DivergenceCheck,
    Evaluate,
    Sampling,
    Tracking,
    run_round,
    train,
)
from pflego.sim.privacy import Privacy
from pflego.sim.summary import summarize
from pflego.types import RoundContext

log = logging.getLogger("pflego.flower")
CHECKPOINT_KIND = "flower-server"


def error_text(message: Message) -> str:
    """A one-line description of an error reply."""
    reason = (message.error.reason or "").strip().splitlines()
    return f"error {message.error.code}: {reason[-1] if reason else 'no reason given'}"


class FlowerServer:
    """A run's server: the population and its nodes, the shared state, the round loop, and the
    messages to the nodes.

    Args:
        config: The run's experiment config (its ``clients`` is how many nodes to wait for).
        grid: Flower's grid (or the in-process grid of tests/flower_inprocess.py).
        run_dir: Where to write the run directory, or ``None``.
        round_timeout: Seconds to wait for the replies of one round.
        join_timeout: Seconds to wait at the start for ``config.clients`` nodes.
        input_shape: The model's input shape (``"1,28,28"``), or ``""`` to take it from the nodes.
        label_names: The run's label names (``"cat,dog"``), or ``""`` to take them from the nodes.
        secure: SecAgg+ settings to sum the uploads securely, or ``None``.
        resume: Continue from the run directory's checkpoint.
        run_key: Names this run on the nodes' disks (their state files); a resumed run keeps the
            key of the run it continues.
    """

    def __init__(
        self,
        config: Config,
        grid: Grid,
        run_dir: RunDir | None = None,
        round_timeout: float = 120.0,
        join_timeout: float = 120.0,
        input_shape: str = "",
        label_names: str = "",
        secure: SecureAggregation | None = None,
        resume: bool = False,
        run_key: str = "1",
    ) -> None:
        refuse_unsupported(config, secure is not None)
        if resume and run_dir is None:
            raise ConfigError("resume needs the run directory (out=...) holding checkpoint.pt")
        self.cfg = config
        self.grid = MeteredGrid(grid)  # counts the bytes of the messages
        self.run_dir = run_dir
        self.round_timeout = round_timeout
        self.join_timeout = join_timeout
        self.declared = {"input_shape": input_shape, "labels": label_names}
        self.secure = secure.check() if secure is not None else None
        self.resume = resume
        self.run_key = run_key
        self.population: Population | None = None  # the clients the server knows
        self.algorithm = None
        self.sampling: Sampling | None = None
        self.privacy: Privacy | None = None  # local noise is sent to the nodes
        self.server = {}  # the algorithm's server state
        self.nodes: dict[int, int] = {}  # the online node of each known client
        self.records = []
        self.dropped = []  # [round, client] of non-finite updates left out
        self.secure_errors = []  # this evaluation period's SecAgg+ error bounds
        self.next_round = 0
        self.seconds = 0.0  # wall seconds spent in training rounds
        self.events = []  # the events of the round that ran last
        self.speaks = True  # the divergence check's warning goes to the ServerApp's log

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.cfg.dtype)

    # --- the population -----------------------------------------------------------------------

    def start(self) -> None:
        """Form the population (or load it with the rest of a checkpoint) and map the nodes."""
        self.wait_for_nodes()
        if self.resume and self.run_dir.checkpoint.is_file():
            self.load()
            self.discover(self.next_round)
            return
        if self.resume:  # stopped before its first checkpoint: nothing was trained
            log.info("%s has no checkpoint yet: starting from round 0", self.run_dir.path)
        self.form_population()
        if self.run_dir:
            self.run_dir.start(
                to_dict(self.cfg), self.population.summary(), environment(self.cfg.device, [])
            )
            (self.run_dir.path / EVENTS).write_text("")  # a fresh run's own events

    def wait_for_nodes(self) -> None:
        """Wait until ``config.clients`` nodes are online, or ``join_timeout`` passes (go on)."""
        deadline = time.monotonic() + self.join_timeout
        while (online := len(list(self.grid.get_node_ids()))) < self.cfg.clients:
            if time.monotonic() > deadline:
                log.warning("starting with %d of %d nodes online", online, self.cfg.clients)
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
        """The model, algorithm and sampling of the task; unset step sizes become the
        algorithm's defaults in the config (so ``config.yaml`` records them, as in the
        simulator)."""
        task = self.population.task
        self.algorithm = build_algorithm_for(
            self.cfg, task.input_shape, task.num_classes, task.max_classes
        )
        self.cfg = with_step_sizes(self.cfg, self.algorithm)
        self.sampling = Sampling(self.cfg, self.algorithm, self.population)
        sizes = torch.tensor([m.n_train for m in self.population.members])
        self.privacy = Privacy.build(self.cfg, self.algorithm, sizes)

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

    def discover(self, t: int) -> None:
        """Query online nodes whose client is unknown: restarted nodes and late joiners."""
        new = sorted(set(self.online()) - set(self.nodes.values()))
        if new:
            self.admit(self.query(new, self.population.task, f"join-{t}"), t)

    # --- the rounds -----------------------------------------------------------------------------

    def run(self) -> History:
        """Form the population, then run every round; evaluate, log and checkpoint on schedule
        (callbacks of the training loop, with the curves and trackers)."""
        self.start()
        cfg, records = self.cfg, self.records
        title = f"{cfg.algorithm} on {cfg.dataset} (Flower)"
        checkpoints = Checkpoints(lambda: self.timed("checkpoint", self.checkpoint), 1, cfg.rounds)
        tracking = [Tracking(self.run_dir, to_dict(cfg), records)] if self.run_dir else []
        curves = [Curves(self.run_dir, records, cfg.algorithm, title)] if self.run_dir else []
        divergence = DivergenceCheck(self, self.algorithm.head_width, cfg.divergence == "stop")
        then = [*tracking, divergence, checkpoints]
        evaluate = Evaluate(functools.partial(evaluation_due, cfg), self.evaluation, then, records)
        callbacks = [*curves, *tracking, evaluate, checkpoints, RoundEvents(self)]
        try:
            train(self.next_round, cfg.rounds, self.step, callbacks)
        except DivergedError as exc:  # `pflego flower local` reads it back: exit code 3
            event = {"round": self.next_round, "phase": "diverged", "error": str(exc)}
            log_event(self.run_dir, event)
            raise
        return History(records, self.run_dir.path if self.run_dir else None)

    def timed(self, phase: str, work: Callable[[], Any]) -> Any:
        """``work()``, timed as ``phase`` into the event of the round that ran last (if any)."""
        with timed(self.events[0].setdefault("phases", {}) if self.events else {}, phase):
            return work()

    def step(self, t: int) -> None:
        """Training round ``t``, timed; its event starts the round's ``events``."""
        start = time.perf_counter()
        self.events = [self.run_round(t)]
        self.seconds += time.perf_counter() - start
        self.next_round = t + 1

    def run_round(self, t: int) -> dict[str, Any]:
        """One training round; returns what happened (sampled, answered, missing clients)."""
        phases: dict[str, float] = {}
        self.grid.down = self.grid.up = 0
        with timed(phases, "query"):
            self.discover(t)
        transport = (PlainTransport if self.secure is None else SecureTransport)(self, phases)
        done = run_round(t, self.sampling, transport, self.server, self.privacy)
        event: dict[str, Any] = {
            "round": t,
            "phase": "train",
            "population": self.population.num_clients,
            "sampled": done.sampled.tolist(),
            "answered": [],
            "missing": {},
            **transport.event,
        }
        if len(done.dropped):
            dropped = done.dropped.tolist()
            log.warning("round %d: non-finite updates of clients %s dropped", t, dropped)
            self.dropped += [[t, c] for c in dropped]
            event["dropped"] = dropped
        if len(done.kept):
            event["cohort_size"] = done.ctx.cohort_size
        return event | {"bytes_down": self.grid.down, "bytes_up": self.grid.up, "phases": phases}

    def evaluation(self, completed: int) -> dict[str, Any] | None:
        """The evaluation after ``completed`` rounds, timed into the round's event."""
        return self.timed("evaluate", lambda: self.evaluate(completed))

    def evaluate(self, completed: int) -> dict[str, Any] | None:
        """Every client's node (or that of each client in the simulator's fixed sample
        ``eval_clients``) evaluates its personalized model; the server summarizes.

        Its ``flower.jsonl`` event joins the events of the round that ran last, or (none: before
        the first round) is written at once.
        """
        ctx = self.context(completed)
        self.online()
        sample = evaluation_sample(self.cfg, self.population.num_clients).tolist()
        clients = sorted(set(self.nodes) & set(sample))
        contents = self.contents(clients, ctx, evaluation=True)
        replies, missing = self.exchange(contents, "evaluate", f"evaluate-{completed}")
        for client in sample:
            if client not in replies and client not in missing:
                missing[client] = "its node is offline"
        self.note_missing(completed, "evaluate", missing)
        event = {
            "round": completed,
            "phase": "evaluate",
            "answered": sorted(replies),
            "missing": {str(c): w for c, w in sorted(missing.items())},
        }
        if self.events:
            self.events.append(event)
        else:
            log_event(self.run_dir, event)
        if not replies:
            log.warning("evaluation after round %d: no node answered", completed)
            return None
        rows = [json.loads(replies[c].content["pflego"]["row"]) for c in sorted(replies)]
        for row, client in zip(rows, sorted(replies)):
            row["client"] = client
        record = evaluation_record(self.cfg, completed, summarize(rows), self.seconds)
        if self.algorithm.adapts:
            record["adapted"] = True
        if len(sample) < self.population.num_clients:
            record["eval_clients"] = len(sample)
        if self.secure is not None:
            record["secagg_step"] = self.secure.step
            record["secagg_error_bound"] = max(self.secure_errors, default=0.0)
            self.secure_errors = []
        if self.privacy is not None:
            record |= self.privacy.record(completed)
        record["dropped"], self.dropped = self.dropped, []
        self.records.append(record)
        if self.run_dir:
            self.run_dir.log(record, rows)
        log.info(
            "round %d: train_loss %.6f test_acc %.4f",
            completed,
            record["train_loss"],
            record["test_acc"],
        )
        return record

    def context(self, t: int) -> RoundContext:
        """Round t's context over the known population (that of the simulator's sampling)."""
        return self.sampling.context(t)

    # --- the checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed server needs (what ``checkpoint.pt`` holds)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "pflego": pflego_version(),
            "kind": CHECKPOINT_KIND,
            "next_round": self.next_round,
            "server": self.server,
            "population": self.population.state_dict(),
            "records": self.records,
            "dropped": self.dropped,
            "seconds": self.seconds,
            "run_key": self.run_key,
            "config": to_dict(self.cfg),
        }

    def checkpoint(self) -> None:
        """Save the state to the run directory's ``checkpoint.pt`` (if any)."""
        if self.run_dir:
            self.run_dir.save_checkpoint(self.state_dict())

    def load(self) -> None:
        """Continue from the run directory's checkpoint (written by a Flower server)."""
        state = self.run_dir.load_checkpoint()
        if state.get("kind") != CHECKPOINT_KIND:
            raise ConfigError(
                f"{self.run_dir.path} holds a simulator checkpoint; continue it with "
                "`pflego run --resume`"
            )
        self.population = Population.from_state_dict(state["population"])
        self.build()
        self.server = state["server"]
        self.next_round, self.records = state["next_round"], state["records"]
        self.dropped, self.seconds = state["dropped"], state["seconds"]
        self.run_key = state["run_key"]
        if self.cfg.rounds < self.next_round:
            raise ConfigError(
                f"rounds={self.cfg.rounds} is fewer than the {self.next_round} rounds "
                f"{self.run_dir.path} has already run"
            )
        self.run_dir.write_config(to_dict(self.cfg))  # a resumed run may extend its rounds
        self.run_dir.rewind(self.records, self.next_round)
        self.run_dir.record_environment(environment(self.cfg.device, []))
        log_event(self.run_dir, {"round": self.next_round, "phase": "resume"})
        log.info("resuming at round %d of %d", self.next_round, self.cfg.rounds)

    # --- the messages ---------------------------------------------------------------------------

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


class RoundEvents(Callback):
    """After each round (its evaluation and checkpoint timed into its event): log the round's
    events, and print and log its status line (an operator sees a stuck or slow site)."""

    def __init__(self, server: FlowerServer) -> None:
        self.server = server

    def on_round_end(self, completed: int) -> None:
        for logged in self.server.events:
            log_event(self.server.run_dir, logged)
        line = status_line(self.server.events[0])
        print(f"pflego: {line}", flush=True)
        log.info("%s", line)


__all__ = ["FlowerServer"]
