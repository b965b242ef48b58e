"""The simulator: its round loop (sample, downlink, client updates, aggregate, server step),
evaluation inside it (which clients, how they personalize first, the unseen clients, the record),
log and checkpoints."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import reduce
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from pflego import tree
from pflego.config import to_dict
from pflego.environment import CHECKPOINT_FORMAT, pflego_version
from pflego.history import CheckpointWriter, History, RunDir, snapshot
from pflego.rng import adapt_rng, minibatch_rng, seed_for
from pflego.sim.backends import FUSED_MIN_SAMPLES, Backend, fuses, make_backend, resolve_backend
from pflego.sim.backends_auto import AutoBackend, auto_backend, probing_enabled
from pflego.sim.build import Experiment
from pflego.sim.clients import ClientPool, ClientStore, Cohort, validation_split
from pflego.sim.engine import (
    BackendReport,
    Checkpoints,
    Curves,
    DivergenceCheck,
    Evaluate,
    RoundProgress,
    Sampling,
    Tracking,
    evaluation_due,
    evaluation_record,
    evaluation_sample,
    run_round,
    train,
)
from pflego.sim.guards import Updates, deferred_interrupts, finite_states, rows
from pflego.sim.memory import retained_heap
from pflego.sim.metrics import Personalization, build_pools, client_rows
from pflego.sim.privacy import Privacy
from pflego.sim.profile import Profile
from pflego.sim.summary import participation_gap, summarize
from pflego.tree import Params
from pflego.types import (
    ClientData,
    ClientOut,
    ClientState,
    Downlink,
    RoundContext,
    Schedule,
    ServerState,
)


class Simulation:
    """State of a simulated run and the round loop over it.

    Every client's data is placed on ``config.device`` once; private states live in a stacked
    host-side :class:`ClientStore` and only the cohort's are copied to the device each round.
    """

    def __init__(
        self, experiment: Experiment, run_dir: RunDir | None, profile: Profile | None = None
    ) -> None:
        self.exp = experiment
        self.cfg = experiment.config
        self.run_dir = run_dir
        self.profile = profile or Profile()
        self.writer = CheckpointWriter(run_dir) if run_dir else None
        self.device = torch.device(self.cfg.device)
        self.algorithm = experiment.algorithm
        self.server: ServerState = self.algorithm.initial_server(
            self.cfg.seed, experiment.dtype, self.device
        )
        if experiment.public is not None:  # the public inputs the algorithm declared
            public = experiment.public.to(self.device, experiment.dtype)
            self.server = {**self.server, "public": {"x": public}}
        self.store = ClientStore(experiment.data.num_clients)
        self.sampling = Sampling(self.cfg, self.algorithm, experiment.data)
        space, dtype = self.algorithm.label_space, experiment.dtype
        with self.profile.part("data"):
            self.pools = build_pools(experiment.data, space, dtype, self.device)
            self.unseen_pools = (
                build_pools(experiment.unseen, space, dtype, self.device)
                if experiment.unseen is not None
                else None
            )
            self.eval_ids = evaluation_sample(self.cfg, experiment.data.num_clients)
            self.eval_pools = dict(self.pools)
            if self.cfg.eval_train_samples is not None and isinstance(self.train_pool, ClientPool):
                self.eval_pools["train"] = self.train_pool.select(
                    np.arange(experiment.data.num_clients), self.train_subsample
                )
        self.backend: Backend = self.pick_backend()
        self.privacy = Privacy.build(self.cfg, self.algorithm, experiment.data.train_sizes)
        self.records: list[dict[str, Any]] = []
        self.dropped: list[list[int]] = []  # [round, client] of updates left out since the last log
        self.next_round = 0
        self.seconds = 0.0
        self.eval_rows: dict[int, dict[str, Any]] = {}  # each client's last evaluation
        self.eval_server: ServerState | None = None  # the server state it was made with
        self.speaks = True  # prints its warnings (one process of a distributed run does)
        self.plots = True  # draws curves.png into the run directory at the end

    def train_subsample(self, client: int, n: int) -> np.ndarray:
        """The fixed rows of client ``client``'s training split that evaluation reads
        (``eval_train_samples`` of its ``n``, drawn once per client)."""
        keep = self.cfg.eval_train_samples
        if keep >= n:
            return np.arange(n)
        rng = np.random.default_rng(seed_for(self.cfg.seed, 13, client))
        return np.sort(rng.permutation(n)[:keep])

    @property
    def train_pool(self) -> ClientPool:
        return self.pools["train"]

    @property
    def test_pool(self) -> ClientPool:
        return self.pools["test"]

    @property
    def run_schedule(self) -> Schedule:
        return Schedule(self.cfg.inner_steps, self.cfg.batch_size, self.cfg.local_epochs)

    def pick_backend(self) -> Backend:
        """The configured backend; ``auto`` measures its candidates on the first round it runs
        (:mod:`pflego.sim.backends_auto`), or without probing follows :func:`resolve_backend`."""
        cfg = self.cfg
        if cfg.backend == "auto" and probing_enabled():
            fuses = self.device.type == "cpu" and self.fusion_probe()
            return auto_backend(self.algorithm, self.device, cfg.chunk_size, fuses)
        name = resolve_backend(cfg.backend, self.device, self.fusion_probe)
        self.resolved_backend = name
        return make_backend(name, self.algorithm, cfg.chunk_size)

    @property
    def backend_name(self) -> str:
        """The backend that runs the rounds (``auto`` while its probe has not run yet)."""
        if isinstance(self.backend, AutoBackend):
            return self.backend.chosen or "auto"
        return self.resolved_backend

    def fusion_probe(self) -> bool:
        """Whether clients are large enough to train one by one (:data:`FUSED_MIN_SAMPLES`) and
        the algorithm's local steps all fuse: client 0's update on two 1-sample steps (nothing
        is stored; an update that fails here counts as not fusing)."""
        if self.train_pool.sizes.mean() < FUSED_MIN_SAMPLES:
            return False
        ctx, client = self.context(0), np.array([0])
        own = self.one_downlink(self.downlink(ctx, client), 0, 0)
        state = tree.to(self.init_state(0, own, ctx), self.device)
        inputs = self.round_inputs(0, client, Schedule(2, 1))
        try:
            return fuses(self.algorithm, own, state, inputs.client(0), ctx)
        except Exception:  # noqa: BLE001  (a heuristic: training reports real errors itself)
            return False

    # --- the population ---------------------------------------------------------------------

    def context(self, t: int) -> RoundContext:
        """Round t's context (:meth:`Sampling.context`)."""
        return self.sampling.context(t)

    def cohort(self, t: int) -> np.ndarray:
        """Round t's clients (:meth:`Sampling.cohort`)."""
        return self.sampling.cohort(t)

    def downlink(self, ctx: RoundContext, clients: np.ndarray, evaluation: bool = False) -> Params:
        """The payload of ``clients``' :class:`~pflego.types.Downlink` (``evaluation``: the one
        evaluation predicts with): shared, or stacked per client."""
        return self.algorithm.send(self.server, ctx, torch.as_tensor(clients), evaluation).payload

    def init_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's first-visit state (:meth:`~pflego.algorithms.Algorithm.first_visit_state`)."""
        cpu = tree.to(downlink, "cpu")
        return self.algorithm.first_visit_state(cpu, self.cfg.seed, client, ctx, self.exp.dtype)

    def client_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's stored state, or its first-visit state (seeded by the client id)."""
        if self.store.initialized[client]:
            return self.store.get(client)
        return self.init_state(client, self.one_downlink(downlink, client), ctx)

    def one_downlink(self, downlink: Params, client: int, position: int | None = None) -> Params:
        """Client ``client``'s own payload out of a downlink's payload (at ``position``, or at
        its id when the payload holds every client's)."""
        return self.algorithm.received(downlink).of(client if position is None else position)

    def initialize(self, clients: np.ndarray, downlink, ctx: RoundContext) -> None:
        """Write the first-visit states of those ``clients`` that have none into the store.

        ``downlink`` is the shared payload, or the per-client payloads of ``clients`` in order.
        """
        missing = self.store.missing(clients)
        if len(missing):
            host = tree.to(downlink, "cpu")  # the store lives in host memory
            where = {int(c): k for k, c in enumerate(clients)}
            self.store.write(
                missing,
                tree.stack(
                    self.init_state(int(i), self.one_downlink(host, int(i), where[int(i)]), ctx)
                    for i in missing
                ),
            )

    def states(self, clients: np.ndarray, downlink, ctx: RoundContext) -> ClientState:
        """The stacked states of ``clients`` on the device, initializing first visits in the store."""
        self.initialize(clients, downlink, ctx)
        return self.store.gather(clients, self.device)

    def round_inputs(self, t: int, clients: np.ndarray, plan: Schedule | None = None) -> Cohort:
        """The cohort's padded round inputs (on the run's schedule, or ``plan``); minibatches are
        shuffled by (seed, round, client)."""
        run = plan or self.run_schedule
        return self.train_pool.cohort(
            clients,
            run,
            lambda i, stream: minibatch_rng(self.cfg.seed, t, i, stream),
            self.algorithm.schedules(run),
            self.pools[validation_split(self.exp.data)] if self.algorithm.uses_validation else None,
        )

    # --- one round: this process as the engine's transport ---------------------------------

    def run_round(self, t: int) -> None:
        """One round (:func:`~pflego.sim.engine.run_round`); a client whose upload or new state
        is not finite is left out and logged as ``dropped``."""
        done = run_round(t, self.sampling, self, self.server, self.privacy)
        self.dropped += [[t, int(c)] for c in done.dropped]

    def client_updates(
        self, t: int, ctx: RoundContext, cohort: np.ndarray, share: np.ndarray | None = None
    ) -> tuple[ClientOut, ClientState]:
        """The round's uploads and new states of the cohort's members at positions ``share``
        (default all; with local noise, if any). Their downlink is their part of the one the whole
        cohort is sent: a member's part may depend on the others (FedMTL, FedCross)."""
        sent = self.algorithm.send(self.server, ctx, torch.as_tensor(cohort))
        clients = cohort if share is None else cohort[share]
        downlink = (sent if share is None else sent.select(share)).payload
        states = self.states(clients, downlink, ctx)
        out, new_states = self.backend(
            self.algorithm, downlink, states, self.round_inputs(t, clients), ctx
        )
        if self.privacy is not None:  # local noise: each client noises its own upload
            out = self.privacy.on_clients(out, clients, t)
        return out, new_states

    def updates(self, t: int, ctx: RoundContext, cohort: np.ndarray) -> Updates:
        """The whole cohort's updates, trained here (a process of a distributed run trains its
        share and gathers the rest)."""
        out, new_states = self.client_updates(t, ctx, cohort)
        held = np.arange(len(cohort))
        return Updates(cohort, out, new_states, held, finite_states(new_states, cohort))

    def commit(self, server: ServerState, clients: np.ndarray, states: ClientState) -> None:
        """Keep the new server state and store the new states this process owns (a mixed
        state may be another's to store)."""
        mine = np.isin(clients, self.owned(clients))
        if not mine.all():
            clients, states = clients[mine], rows(states, np.flatnonzero(mine))
        self.store.scatter(clients, states)
        self.server = server

    def profile_summary(self) -> dict[str, Any]:
        """The profile with the facts that explain it."""
        probe = self.backend.report() if isinstance(self.backend, AutoBackend) else None
        chosen = self.backend.backend if isinstance(self.backend, AutoBackend) else self.backend
        graphs = getattr(chosen, "graphs", None)  # the graph backend's methods run as vmap
        fallbacks = graphs.fallbacks if graphs is not None else {}
        return self.profile.summary(
            rounds=self.next_round,
            evaluations=len(self.records),
            backend=self.backend_name,
            **({"backend_probe": probe} if probe else {}),
            **({"graph_fallbacks": dict(fallbacks)} if fallbacks else {}),
            threads=torch.get_num_threads(),
            clients=self.exp.data.num_clients,
            evaluated_clients=len(self.eval_ids),
            device=str(self.device),
        )

    # --- evaluation -------------------------------------------------------------------------

    def personalization(
        self, completed: int, unseen: bool = False, clients: np.ndarray | None = None
    ) -> Personalization | None:
        """How clients personalize before the evaluation after ``completed`` rounds.

        The evaluation names clients by their position in ``clients`` (by default, their ids).
        """
        if not (unseen or self.algorithm.adapts):
            return None
        pool = (self.unseen_pools if unseen else self.pools)["train"]
        plan = self.algorithm.adapt_schedule(self.run_schedule)
        if unseen and self.cfg.join_epochs is not None:  # e.g. PGFed's new clients: 20 epochs
            plan = plan._replace(local_epochs=self.cfg.join_epochs)
        offset = self.exp.data.num_clients if unseen else 0

        def cohort(ids: np.ndarray) -> Cohort:
            rng = lambda i, stream: adapt_rng(self.cfg.seed, completed, i + offset, stream)  # noqa: E731
            return pool.cohort(ids if clients is None else clients[ids], plan, rng)

        def clients_of(ids: np.ndarray) -> list[ClientData]:
            chunk = cohort(ids)
            return [chunk.client(j) for j in range(len(chunk))]

        return Personalization(
            "join" if unseen else "adapt",
            lambda ids: cohort(ids).data,
            self.context(completed),
            clients_of,
            fused=self.backend_name != "loop",  # loop: the autograd reference, also here
        )

    def evaluate(self, completed: int) -> dict[str, Any]:
        """Evaluate every client (or the fixed sample ``eval_clients``), and every unseen client,
        and log one record."""
        with self.profile.part("evaluate"), self.calibrated(completed):
            summary, rows = self.evaluate_population(completed)
            summary |= self.population_summary()
            if self.unseen_pools is not None:
                unseen_summary, unseen_rows = self.evaluate_unseen(completed)
                summary |= unseen_summary | participation_gap(summary | unseen_summary)
                rows += unseen_rows
        record = evaluation_record(self.cfg, completed, summary, self.seconds)
        if self.algorithm.adapts:
            record["adapted"] = True
        if len(self.eval_ids) < self.exp.data.num_clients:
            record["eval_clients"] = len(self.eval_ids)
        if self.cfg.eval_train_samples is not None:
            record["eval_train_samples"] = self.cfg.eval_train_samples
        if self.privacy is not None:
            record |= self.privacy.record(completed)
        record["dropped"] = self.dropped
        with deferred_interrupts():
            self.records.append(record)
            self.dropped = []
            if self.run_dir:
                self.run_dir.log(record, rows)
        return record

    @contextmanager
    def calibrated(self, completed: int) -> Iterator[None]:
        """Within it, the server state is the algorithm's ``calibrate`` of every training
        client's ``statistics`` (the evaluation downlink over its whole training split, summed),
        for an algorithm that calibrates (CCVR); the server's own state comes back after."""
        if not self.algorithm.calibrates:
            yield
            return
        ctx, ids = self.context(completed), np.arange(self.exp.data.num_clients)
        downlink = self.algorithm.send(self.server, ctx, torch.as_tensor(ids), evaluation=True)
        rng = lambda i, stream: adapt_rng(self.cfg.seed, completed, i, stream)  # noqa: E731
        clients = self.pools["train"].cohort(ids, self.run_schedule, rng)
        parts = (
            self.algorithm.statistics(downlink.of(c), clients.client(c), ctx)
            for c in range(len(ids))
        )
        own = self.server
        self.server = self.algorithm.calibrate(own, reduce(tree.add, parts), ctx)
        try:
            yield
        finally:
            self.server = own

    def evaluate_population(self, completed: int) -> tuple[dict[str, float], list[dict]]:
        """Rows of the evaluated clients; a client whose state did not change since its last
        evaluation keeps its row when the server state did not change either and nothing
        personalizes at evaluation (the numbers would be the same)."""
        ctx, ids = self.context(completed), self.owned(self.eval_ids)

        def own_rows() -> list[dict]:
            missing = self.store.missing(ids)
            if len(missing):  # first-visit states from the round's downlink
                self.initialize(missing, self.downlink(ctx, missing), ctx)
            stale = ids
            if not self.algorithm.adapts:
                unchanged = self.eval_server is not None and same_values(
                    self.server, self.eval_server
                )
                known = np.array([int(i) in self.eval_rows for i in ids], dtype=bool)
                if unchanged:
                    stale = ids[self.store.changed[torch.as_tensor(ids)].numpy() | ~known]
                self.eval_server = snapshot(self.server)
            for row in self.client_rows(stale, completed, ctx):
                self.eval_rows[row["client"]] = row
            self.store.changed[torch.as_tensor(stale, dtype=torch.int64)] = False
            return [self.eval_rows[int(i)] for i in ids]

        rows = self.gather_rows(own_rows, self.eval_ids)
        return summarize(rows), rows

    def should_evaluate(self, completed: int) -> bool:
        return evaluation_due(self.cfg, completed)

    def owned(self, clients: np.ndarray) -> np.ndarray:
        """Those of ``clients`` whose states this process holds and evaluates: all of them (a
        process of a distributed run holds its share)."""
        return clients

    def gather_rows(self, own_rows: Callable[[], list[dict]], order: np.ndarray) -> list[dict]:
        """The evaluation rows that ``own_rows()`` makes in every process, joined in the order of
        the client ids ``order`` (one process makes them all)."""
        return own_rows()

    def population_summary(self) -> dict[str, float]:
        """The algorithm's ``population_metrics`` over every client's stored state."""
        population = self.algorithm.population_metrics(self.server, self.store.tensors)
        return {k: float(v) for k, v in population.items()}

    def client_rows(self, clients: np.ndarray, completed: int, ctx: RoundContext) -> list[dict]:
        """Evaluation rows of ``clients``: on the pools as they are when that is every client,
        else on pools of just them (a generated population always)."""
        if len(clients) == 0:
            return []
        keep = self.train_subsample if self.cfg.eval_train_samples is not None else None
        pools = self.eval_pools
        if len(clients) < self.exp.data.num_clients or not isinstance(self.train_pool, ClientPool):
            pools = {
                split: pool.select(clients, keep if split == "train" else None)
                for split, pool in self.pools.items()
            }
        first = self.algorithm.send(self.server, ctx, torch.as_tensor(clients[:1]), True)

        def downlink_for(ids: np.ndarray) -> Downlink:
            if not first.per_client:
                return first
            return self.algorithm.send(self.server, ctx, torch.as_tensor(clients[ids]), True)

        return client_rows(  # moves the states to the device chunk by chunk
            self.algorithm,
            downlink_for,
            self.store.read(clients),
            pools,
            self.personalization(completed, clients=clients),
            self.cfg.chunk_size,
            ids=clients,
            counts={"train": self.train_pool.sizes[clients]} if keep else None,
        )

    def evaluate_unseen(self, completed: int) -> tuple[dict[str, float], list[dict]]:
        """Clients that never trained join from their first-visit state with ``join``.

        They receive the newcomer's downlink (``downlink`` without client ids); their states are
        built for this evaluation only. Metrics carry the prefix ``unseen_``.
        """
        ctx = self.context(completed)
        offset, count = self.exp.data.num_clients, self.exp.unseen.num_clients
        mine = self.owned(np.arange(offset, offset + count)) - offset
        payload = self.algorithm.evaluation_downlink(self.server, ctx)
        host = tree.to(payload, "cpu")
        newcomer = self.algorithm.received(payload)
        downlink_for = lambda ids: newcomer.sent_to(len(ids))  # noqa: E731

        def own_rows() -> list[dict]:
            if not len(mine):
                return []
            states = tree.stack(self.init_state(offset + int(j), host, ctx) for j in mine)
            pools = self.unseen_pools
            if len(mine) < count:
                pools = {split: pool.select(mine) for split, pool in pools.items()}
            rows = client_rows(
                self.algorithm,
                downlink_for,
                states,
                pools,
                self.personalization(completed, unseen=True, clients=mine),
                self.cfg.chunk_size,
                ids=offset + mine,
            )
            return [row | {"unseen": 1} for row in rows]

        rows = self.gather_rows(own_rows, np.arange(offset, offset + count))
        return summarize(rows, "unseen_"), rows

    # --- persistence ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "pflego": pflego_version(),
            "next_round": self.next_round,
            "server": self.server,
            "store": self.store_state(),
            "records": self.records,
            "dropped": self.dropped,
            "seconds": self.seconds,
            "backend": self.backend_name,
            "config": to_dict(self.cfg),
        }

    def store_state(self) -> dict[str, Any] | None:
        """The checkpoint's client store (a distributed run gathers it into its first process)."""
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round, self.records = state["next_round"], state["records"]
        self.server = {k: tree.to(v, self.device) for k, v in state["server"].items()}
        self.seconds = state["seconds"]
        self.dropped = state.get("dropped", [])
        self.store.load_state_dict(state["store"])
        chosen = state.get("backend")
        if isinstance(self.backend, AutoBackend) and chosen not in (None, "auto"):
            self.backend.fix(chosen, "kept from the checkpoint")  # an uninterrupted run's numbers

    def checkpoint(self, wait: bool = False) -> None:
        """Write a checkpoint on the background writer (``wait``: and block until it is on disk)."""
        if self.writer:
            with self.profile.part("checkpoint"):
                self.writer.submit(self.state_dict())
                if wait:
                    self.writer.wait()

    def run(self, progress: bool = True) -> History:
        """Run the remaining rounds; evaluate, log and checkpoint on schedule.

        A checkpoint is written after the first evaluation and on Ctrl-C, so every interrupted
        run can be resumed.
        """
        with retained_heap():
            try:
                self.train(progress)
            except KeyboardInterrupt:
                self.on_interrupt()
                raise
            finally:  # the last submitted checkpoint (the last good one, after a divergence)
                if self.writer:
                    with self.profile.part("checkpoint"):
                        self.writer.wait()
                if self.run_dir and self.run_dir.environment.is_file():
                    self.run_dir.record_backend(self.backend_name)
        return History(self.records, self.run_dir.path if self.run_dir else None)

    def on_interrupt(self) -> None:
        """Ctrl-C: write a checkpoint of the rounds completed and wait until it is on disk."""
        self.checkpoint(wait=True)

    def train(self, progress: bool) -> None:
        """The remaining rounds, with evaluation (also the one due at the start), the divergence
        check, checkpoints, progress, curves and trackers as callbacks of the training loop (the
        process that writes the run directory draws and tracks)."""
        cfg, title = self.cfg, f"{self.cfg.algorithm} on {self.cfg.dataset}"
        bar = RoundProgress(title, self.next_round, cfg.rounds, progress)
        divergence = DivergenceCheck(self, self.algorithm.head_width, cfg.divergence == "stop")
        checkpoints = Checkpoints(self.checkpoint, cfg.checkpoint_every, cfg.rounds)
        probing = isinstance(self.backend, AutoBackend) and self.backend.chosen is None
        tracking = [Tracking(self.run_dir, to_dict(cfg), self.records)] if self.run_dir else []
        draws = self.run_dir and self.plots
        curves = [Curves(self.run_dir, self.records, cfg.algorithm, title)] if draws else []
        then = [bar, *tracking, divergence, checkpoints]
        callbacks = [
            *curves,
            *tracking,
            *([BackendReport(self.backend, bar)] if probing and progress and self.speaks else []),
            Evaluate(self.should_evaluate, self.evaluate, then, self.records),
            checkpoints,
            bar,
        ]
        train(self.next_round, cfg.rounds, self.step, callbacks)

    def step(self, t: int) -> None:
        """Round ``t``, timed, and the count of rounds done."""
        start = time.perf_counter()
        with self.profile.part("train"):
            self.run_round(t)
        self.seconds += time.perf_counter() - start
        self.next_round = t + 1


def same_values(a: Any, b: Any) -> bool:
    """Whether two nested dicts and lists of tensors hold the same structure and values."""
    (left, structure), (right, other) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return structure == other and all(
        isinstance(y, Tensor) and torch.equal(x, y) if isinstance(x, Tensor) else x == y
        for x, y in zip(left, right, strict=True)
    )
