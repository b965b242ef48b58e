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
from pflego.rng import first_visit_generator, minibatch_rng, seed_for
from pflego.sim.backends import FUSED_MIN_SAMPLES, Backend, fuses, make_backend, resolve_backend
from pflego.sim.backends_auto import AutoBackend, auto_backend, probing_enabled
from pflego.sim.build import Experiment
from pflego.sim.clients import ClientPool, ClientStore, Cohort, validation_split
from pflego.sim.evaluation import Evaluation, evaluation_sample
from pflego.sim.guards import (
    Updates,
    check_finite_server,
    deferred_interrupts,
    divergence_threshold,
    every_update_non_finite,
    finite_rows,
    finite_states,
    loss_diverged,
    loss_exploded,
    rows,
)
from pflego.sim.memory import retained_heap
from pflego.sim.metrics import build_pools
from pflego.sim.privacy import Privacy, server_round
from pflego.sim.profile import Profile
from pflego.sim.progress import RoundProgress
from pflego.trackers import tracking
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
        params = self.algorithm.init_params(self.cfg.seed, experiment.dtype)
        self.server: ServerState = self.algorithm.init_server(tree.to(params, self.device))
        self.store = ClientStore(experiment.data.num_clients)
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
        """Round t's context; its cohort size r sets PFLEGO's scaling I/r.

        ``fixed``: r = round(p I), and Pr(i in S_t) = r / I. ``bernoulli``: r = p I, the
        expected size, and Pr(i in S_t) = p = r / I. Either way I/r is the inverse inclusion
        probability and (I/r) sum_{i in S_t} alpha_i g_i is unbiased for sum_i alpha_i g_i.

        ``uniform-count``: r_t is drawn uniformly from {min_cohort, ..., max_cohort}, then r_t
        clients without replacement; the context carries that round's own r_t (drawn by
        :meth:`cohort_count` from the generator :meth:`cohort` uses, so the two agree). Given r_t,
        Pr(i in S_t | r_t) = r_t / I, so for any client quantities a_i
        E[(I/r_t) sum_{i in S_t} a_i] = sum_r P(r) (I/r) sum_i (r/I) a_i = sum_i a_i:
        the body step is unbiased given every r_t, and a head W_i, stepped only when i is
        sampled, moves in expectation by sum_r P(r) (r/I)(I/r) rho alpha_i g_W = rho alpha_i g_W.
        (Scaling by I / E[r] would be unbiased too, but adds the variance of r_t to the step.)
        """
        cfg, data = self.cfg, self.exp.data
        if cfg.sampling == "uniform-count":
            size = float(self.cohort_count(t))
        else:
            size = cfg.participation * data.num_clients  # the dataset may fix the client count
            if cfg.sampling == "fixed":
                size = max(1, round(size))
        client_lr, server_lr = (
            getattr(self.algorithm, f"default_{k}") if getattr(cfg, k) is None else getattr(cfg, k)
            for k in ("client_lr", "server_lr")
        )
        return RoundContext(
            t, data.num_clients, size, data.total_train, client_lr, server_lr, cfg.seed
        )

    def sampler(self, t: int) -> np.random.Generator:
        """The generator of round t's cohort, seeded by (seed, 1, t)."""
        return np.random.default_rng(seed_for(self.cfg.seed, 1, t))

    def cohort_count(self, t: int, rng: np.random.Generator | None = None) -> int:
        """``uniform-count``'s r_t: the first draw of round t's sampler, uniform on [min, max]."""
        rng = self.sampler(t) if rng is None else rng
        return int(rng.integers(self.cfg.min_cohort, self.cfg.max_cohort + 1))

    def cohort(self, t: int) -> np.ndarray:
        """Clients of round t: exactly r without replacement, each with probability p, or
        (``uniform-count``) r_t uniform on [min_cohort, max_cohort], then r_t without replacement."""
        rng = self.sampler(t)
        num = self.exp.data.num_clients
        if self.cfg.sampling == "uniform-count":
            return np.sort(rng.choice(num, self.cohort_count(t, rng), replace=False))
        if self.cfg.sampling == "fixed":
            return np.sort(rng.choice(num, int(self.context(t).cohort_size), replace=False))
        return np.flatnonzero(rng.random(num) < self.cfg.participation)

    def downlink(self, ctx: RoundContext, clients: np.ndarray, evaluation: bool = False) -> Params:
        """The downlink of ``clients`` (``evaluation``: the one evaluation predicts with): shared,
        or stacked per client when the algorithm says so."""
        payload = self.algorithm.evaluation_downlink if evaluation else self.algorithm.downlink
        if self.algorithm.per_client_downlink:
            return payload(self.server, ctx, torch.as_tensor(clients))
        return payload(self.server, ctx)

    def init_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's first-visit state (seeded by the client id, so every backend agrees)."""
        generator = first_visit_generator(self.cfg.seed, client)
        return self.algorithm.init_client(tree.to(downlink, "cpu"), generator, ctx)

    def client_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's stored state, or its first-visit state (seeded by the client id)."""
        if self.store.initialized[client]:
            return self.store.get(client)
        return self.init_state(client, self.one_downlink(downlink, client), ctx)

    def one_downlink(self, downlink: Params, client: int, position: int | None = None) -> Params:
        """Client ``client``'s own payload out of a downlink (the downlink itself when shared)."""
        if not self.algorithm.per_client_downlink:
            return downlink
        return {k: v[client if position is None else position] for k, v in downlink.items()}

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

    # --- one round --------------------------------------------------------------------------

    def run_round(self, t: int) -> None:
        """One round. A client whose upload or new state is not finite is left out (logged as
        ``dropped``), with the cohort size scaled as for a failed node; the new server state and
        client states are committed together, never half."""
        ctx = self.context(t)
        cohort = np.asarray(self.cohort(t), dtype=np.int64)
        if len(cohort) == 0:  # Bernoulli sampling drew nobody: the stochastic gradient is zero
            return
        self.settle(t, ctx, cohort, self.cohort_updates(t, ctx, cohort))

    def client_updates(
        self, t: int, ctx: RoundContext, clients: np.ndarray
    ) -> tuple[ClientOut, ClientState]:
        """The round's uploads and new states of ``clients`` (with local noise, if any)."""
        downlink = self.downlink(ctx, clients)
        states = self.states(clients, downlink, ctx)
        out, new_states = self.backend(
            self.algorithm, downlink, states, self.round_inputs(t, clients), ctx
        )
        if self.privacy is not None:  # local noise: each client noises its own upload
            out = self.privacy.on_clients(out, clients, t)
        return out, new_states

    def cohort_updates(self, t: int, ctx: RoundContext, cohort: np.ndarray) -> Updates:
        """The whole cohort's updates, trained here (a process of a distributed run trains its
        share and gathers the rest)."""
        out, new_states = self.client_updates(t, ctx, cohort)
        return Updates(out, new_states, np.arange(len(cohort)), finite_states(new_states, cohort))

    def settle(self, t: int, ctx: RoundContext, cohort: np.ndarray, updates: Updates) -> None:
        """Leave out the non-finite updates, run the server step and ``mix``, and commit."""
        weights = {"w": updates.out.weight.reshape(len(cohort), -1)}
        keep = finite_rows(updates.out.upload, weights) & updates.finite
        if not bool(keep.any()):
            raise every_update_non_finite(t, ctx)
        if not bool(keep.all()):
            self.dropped += [[t, int(c)] for c in cohort[~keep.numpy()]]
            updates = updates.kept(keep.numpy())
            ctx = ctx.realized(len(cohort), int(keep.sum()))
            cohort = cohort[keep.numpy()]
        out, new_states, clients = updates.out, updates.states, cohort[updates.held]
        server = server_round(
            self.algorithm, self.privacy, self.server, out, ctx, torch.as_tensor(cohort)
        )
        if self.algorithm.mixes and len(clients) != len(cohort):
            raise RuntimeError("mix needs the new states of the whole cohort")
        server, new_states = self.algorithm.mix(server, new_states, ctx, torch.as_tensor(cohort))
        check_finite_server(server, t, ctx)
        mine = np.isin(clients, self.owned(clients))  # a mixed state may be another's to store
        if not mine.all():
            clients, new_states = clients[mine], rows(new_states, np.flatnonzero(mine))
        with deferred_interrupts():
            self.store.scatter(clients, new_states)
            self.server = server

    def profile_summary(self) -> dict[str, Any]:
        """The profile with the facts that explain it."""
        probe = self.backend.report() if isinstance(self.backend, AutoBackend) else None
        return self.profile.summary(
            rounds=self.next_round,
            evaluations=len(self.records),
            backend=self.backend_name,
            **({"backend_probe": probe} if probe else {}),
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

    def evaluation_missing(self) -> bool:
        """Whether the evaluation due after ``next_round`` rounds is not logged yet."""
        due = self.next_round == 0 or self.should_evaluate(self.next_round)
        return due and (not self.records or self.records[-1]["round"] != self.next_round)

    def run(self, progress: bool = True) -> History:
        """Run the remaining rounds; evaluate, log and checkpoint on schedule.

        A checkpoint is written after the first evaluation and on Ctrl-C, so every interrupted
        run can be resumed.
        """
        cfg = self.cfg
        with tracking(self.run_dir, to_dict(cfg), self.records), retained_heap():
            try:
                if self.evaluation_missing():
                    self.evaluate(self.next_round)
                    self.checkpoint()
                self.train(progress)
            except KeyboardInterrupt:
                self.on_interrupt()
                raise
            finally:  # the last submitted checkpoint (the last good one, after a divergence)
                if self.writer:
                    with self.profile.part("checkpoint"):
                        self.writer.wait()
            history = History(self.records, self.run_dir.path if self.run_dir else None)
            if self.run_dir and self.plots:
                from pflego.plots import plot_histories

                plot_histories(
                    {cfg.algorithm: history},
                    self.run_dir.path / "curves.png",
                    f"{cfg.algorithm} on {cfg.dataset}",
                )
        return history

    def on_interrupt(self) -> None:
        """Ctrl-C: write a checkpoint of the rounds completed and wait until it is on disk."""
        self.checkpoint(wait=True)

    def train(self, progress: bool) -> None:
        cfg = self.cfg
        bar = RoundProgress(
            f"{cfg.algorithm} on {cfg.dataset}", self.next_round, cfg.rounds, progress
        )
        first_loss = self.records[0]["train_loss"] if self.records else None
        threshold = divergence_threshold(first_loss, self.algorithm.head_width)
        warned = False
        probing = isinstance(self.backend, AutoBackend) and self.backend.chosen is None
        for t in range(self.next_round, cfg.rounds):
            start = time.perf_counter()
            with self.profile.part("train"):
                self.run_round(t)
            self.seconds += time.perf_counter() - start
            if probing and self.backend.chosen is not None:
                probing = False
                if progress and self.speaks:
                    tqdm.write(f"{bar.desc}: {self.backend.summary()}", file=bar.stream)
            self.next_round = t + 1
            if self.should_evaluate(t + 1):
                record = self.evaluate(t + 1)
                bar.evaluated(t + 1, record)
                loss = record["train_loss"]
                if self.speaks and not warned and first_loss and loss > 100 * first_loss:
                    warned = True
                    tqdm.write(
                        f"pflego: warning: the training loss grew from {first_loss:.4g} to "
                        f"{loss:.4g} by round {t + 1}; the step sizes may be too large",
                        file=bar.stream,
                    )
                self.check_loss(first_loss, threshold, t + 1)
            if (t + 1) % cfg.checkpoint_every == 0 or t + 1 == cfg.rounds:
                self.checkpoint()
            bar.advance()
        bar.close()

    def check_loss(self, first_loss: float, threshold: float, completed: int) -> None:
        """Stop the run (``DivergedError``) when its training loss has stayed past
        ``threshold`` (:func:`~pflego.sim.guards.divergence_threshold`) for
        ``DIVERGENCE_EVALUATIONS`` evaluations, unless ``divergence=warn``. Every process of a
        distributed run holds the same records, so all stop together."""
        losses = [record["train_loss"] for record in self.records]
        if self.cfg.divergence == "stop" and loss_diverged(losses, threshold):
            raise loss_exploded(first_loss, losses[-1], completed, self.context(completed - 1))
