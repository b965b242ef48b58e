"""The one round loop: sample, downlink, client updates, aggregate, server step, evaluate, log,
checkpoint."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from pflego import tree
from pflego.config import to_dict
from pflego.environment import CHECKPOINT_FORMAT, pflego_version
from pflego.history import CheckpointWriter, History, RunDir
from pflego.rng import minibatch_rng, seed_for
from pflego.sim.backends import FUSED_MIN_SAMPLES, Backend, fuses, make_backend, resolve_backend
from pflego.sim.backends_auto import AutoBackend, auto_backend, probing_enabled
from pflego.sim.build import Experiment
from pflego.sim.clients import ClientPool, ClientStore, Cohort, validation_split
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
from pflego.sim.evaluation import Evaluation, evaluation_sample
from pflego.sim.guards import Updates, finite_states, rows
from pflego.sim.memory import retained_heap
from pflego.sim.metrics import build_pools
from pflego.sim.privacy import Privacy
from pflego.sim.profile import Profile
from pflego.sim.progress import RoundProgress
from pflego.tree import Params
from pflego.types import ClientOut, ClientState, RoundContext, Schedule, ServerState


class Simulation(Evaluation):
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
        downlink = self.downlink(ctx, client)
        own = self.one_downlink(downlink, 0, 0)
        state = tree.to(self.init_state(0, tree.to(own, "cpu"), ctx), self.device)
        plan = Schedule(2, 1)
        inputs = self.train_pool.cohort(
            client,
            plan,
            lambda i, stream: minibatch_rng(self.cfg.seed, 0, i, stream),
            self.algorithm.schedules(plan),
            self.pools[validation_split(self.exp.data)] if self.algorithm.uses_validation else None,
        )
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

    def round_inputs(self, t: int, clients: np.ndarray) -> Cohort:
        """The cohort's padded round inputs; minibatches are shuffled by (seed, round, client)."""
        run = self.run_schedule
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


class BackendReport(Callback):
    """Print ``auto``'s choice of backend once its probe has made it."""

    def __init__(self, backend: AutoBackend, bar: RoundProgress) -> None:
        self.backend, self.bar = backend, bar
        self.done = False

    def on_round_end(self, completed: int) -> None:
        if not self.done and self.backend.chosen is not None:
            self.done = True
            tqdm.write(f"{self.bar.desc}: {self.backend.summary()}", file=self.bar.stream)
