"""The one round loop: sample, downlink, client updates, aggregate, server step, evaluate, log, checkpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from pflego import tree
from pflego.algorithms import ALGORITHMS, Algorithm, build_algorithm
from pflego.config import Config, load_config, read_yaml, to_dict
from pflego.data import DATASETS, ArrayDataset, FederatedData, federate, load_dataset
from pflego.errors import ConfigError
from pflego.eval import evaluate_pools
from pflego.history import History, RunDir
from pflego.models import build_model
from pflego.optim import make_optimizer
from pflego.sim.backends import make_backend
from pflego.sim.clients import (
    ClientPool,
    ClientStore,
    Cohort,
    first_visit_generator,
    minibatch_rng,
    seed_for,
)
from pflego.types import ClientState, RoundContext, ServerState


@dataclass
class Experiment:
    """A resolved run: the config, the federated data and the algorithm built for them."""

    config: Config
    data: FederatedData
    algorithm: Algorithm

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.config.dtype)


def _optimizer(name: str, config: Config):
    return (
        make_optimizer(name, momentum=config.momentum)
        if name == "momentum"
        else make_optimizer(name)
    )


def partition(raw: ArrayDataset, config: Config) -> FederatedData:
    """Split a loaded dataset over clients as ``config`` says."""
    return federate(
        raw,
        config.clients,
        config.partition,
        config.classes_per_client,
        config.alpha,
        config.min_client_size,
        config.test_fraction,
        config.seed,
        val_fraction=config.val_fraction,
        beta=config.pachinko_beta,
    )


def build_experiment(config: Config) -> Experiment:
    """Check names first, then load and partition the data and build model and algorithm."""
    if config.algorithm not in ALGORITHMS:
        raise ConfigError(
            f"unknown algorithm {config.algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    if config.dataset not in DATASETS:
        raise ConfigError(
            f"unknown dataset {config.dataset!r}; choose one of {', '.join(sorted(DATASETS))}"
        )
    data = partition(load_dataset(config.dataset, config.data_dir, seed=config.seed), config)
    model_name = DATASETS[config.dataset].default_model if config.model == "auto" else config.model
    model = build_model(model_name, data.input_shape, data.num_classes, data.max_classes)
    algorithm = build_algorithm(
        config.algorithm,
        model,
        config.options,
        client_optimizer=_optimizer(config.client_optimizer, config),
        server_optimizer=_optimizer(config.server_optimizer, config),
        head_init=config.head_init,
    )
    return Experiment(config, data, algorithm)


class Simulation:
    """State of a simulated run and the round loop over it.

    Every client's data is placed on ``config.device`` once; private states live in a stacked
    host-side :class:`ClientStore` and only the cohort's are copied to the device each round.
    """

    def __init__(self, experiment: Experiment, run_dir: RunDir | None) -> None:
        self.exp = experiment
        self.cfg = experiment.config
        self.run_dir = run_dir
        self.device = torch.device(self.cfg.device)
        self.algorithm = experiment.algorithm
        self.backend = make_backend(self.cfg.backend, self.algorithm, self.cfg.chunk_size)
        params = self.algorithm.init_params(self.cfg.seed, experiment.dtype)
        self.server: ServerState = self.algorithm.init_server(tree.to(params, self.device))
        self.store = ClientStore(experiment.data.num_clients)
        space, dtype = self.algorithm.label_space, experiment.dtype
        self.train_pool = ClientPool.build(experiment.data, "train", space, dtype, self.device)
        self.test_pool = ClientPool.build(experiment.data, "test", space, dtype, self.device)
        self.records: list[dict[str, Any]] = []
        self.next_round = 0
        self.seconds = 0.0

    # --- the population ---------------------------------------------------------------------

    def context(self, t: int) -> RoundContext:
        cfg, data = self.cfg, self.exp.data
        expected = cfg.participation * data.num_clients  # the dataset may fix the client count
        if cfg.sampling == "fixed":
            expected = max(1, round(expected))
        server_lr = cfg.server_lr if cfg.server_lr is not None else self.algorithm.default_server_lr
        return RoundContext(
            t, data.num_clients, expected, data.total_train, cfg.client_lr, server_lr
        )

    def cohort(self, t: int) -> np.ndarray:
        """Clients of round t: exactly r without replacement, or each with probability p."""
        rng = np.random.default_rng(seed_for(self.cfg.seed, 1, t))
        num = self.exp.data.num_clients
        if self.cfg.sampling == "fixed":
            return np.sort(rng.choice(num, int(self.context(t).cohort_size), replace=False))
        return np.flatnonzero(rng.random(num) < self.cfg.participation)

    def init_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's first-visit state (seeded by the client id, so every backend agrees)."""
        generator = first_visit_generator(self.cfg.seed, client)
        return self.algorithm.init_client(tree.to(downlink, "cpu"), generator, ctx)

    def client_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's stored state, or its first-visit state (seeded by the client id)."""
        if self.store.initialized[client]:
            return self.store.get(client)
        return self.init_state(client, downlink, ctx)

    def initialize(self, clients: np.ndarray, downlink, ctx: RoundContext) -> None:
        """Write the first-visit states of those ``clients`` that have none into the store."""
        missing = self.store.missing(clients)
        if len(missing):
            host = tree.to(downlink, "cpu")  # the store lives in host memory
            self.store.write(
                missing, tree.stack(self.init_state(int(i), host, ctx) for i in missing)
            )

    def states(self, clients: np.ndarray, downlink, ctx: RoundContext) -> ClientState:
        """The stacked states of ``clients`` on the device, initializing first visits in the store."""
        self.initialize(clients, downlink, ctx)
        return self.store.gather(clients, self.device)

    def round_inputs(self, t: int, clients: np.ndarray) -> Cohort:
        """The cohort's padded round inputs; minibatches are shuffled by (seed, round, client)."""
        cfg = self.cfg
        return self.train_pool.cohort(
            clients,
            cfg.inner_steps,
            cfg.batch_size,
            cfg.local_epochs,
            lambda i: minibatch_rng(cfg.seed, t, i),
        )

    # --- one round --------------------------------------------------------------------------

    def run_round(self, t: int) -> None:
        ctx = self.context(t)
        cohort = self.cohort(t)
        if len(cohort) == 0:  # Bernoulli sampling drew nobody: the stochastic gradient is zero
            return
        downlink = self.algorithm.downlink(self.server, ctx)
        states = self.states(cohort, downlink, ctx)
        out, new_states = self.backend(
            self.algorithm, downlink, states, self.round_inputs(t, cohort), ctx
        )
        self.store.scatter(cohort, new_states)
        self.server = self.algorithm.server_update(
            self.server, self.algorithm.aggregate(out, ctx), ctx
        )

    def evaluate(self, completed: int) -> dict[str, Any]:
        ctx = self.context(completed)
        downlink = self.algorithm.downlink(self.server, ctx)
        self.initialize(np.arange(self.exp.data.num_clients), downlink, ctx)
        summary, rows = evaluate_pools(  # moves the states to the device chunk by chunk
            self.algorithm,
            downlink,
            self.store.tensors,
            self.train_pool,
            self.test_pool,
            self.cfg.chunk_size,
        )
        record = evaluation_record(self.cfg, completed, summary, self.seconds)
        self.records.append(record)
        if self.run_dir:
            self.run_dir.log(record, rows)
        return record

    def should_evaluate(self, completed: int) -> bool:
        return evaluation_due(self.cfg, completed)

    # --- persistence ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_round": self.next_round,
            "server": self.server,
            "store": self.store.state_dict(),
            "records": self.records,
            "seconds": self.seconds,
            "config": to_dict(self.cfg),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_round, self.records = state["next_round"], state["records"]
        self.server = {k: tree.to(v, self.device) for k, v in state["server"].items()}
        self.seconds = state["seconds"]
        self.store.load_state_dict(state["store"])

    def checkpoint(self) -> None:
        if self.run_dir:
            self.run_dir.save_checkpoint(self.state_dict())

    def run(self, progress: bool = True) -> History:
        """Run the remaining rounds; evaluate, log and checkpoint on schedule."""
        cfg = self.cfg
        if self.next_round == 0 and not self.records:
            self.evaluate(0)
        bar = tqdm(
            range(self.next_round, cfg.rounds),
            desc=f"{cfg.algorithm} on {cfg.dataset}",
            unit="round",
            disable=not progress,
            initial=self.next_round,
            total=cfg.rounds,
        )
        for t in bar:
            start = time.perf_counter()
            self.run_round(t)
            self.seconds += time.perf_counter() - start
            self.next_round = t + 1
            if self.should_evaluate(t + 1):
                record = self.evaluate(t + 1)
                bar.set_postfix(
                    loss=f"{record['train_loss']:.4f}", acc=f"{100 * record['test_acc']:.2f}%"
                )
            if (t + 1) % cfg.checkpoint_every == 0 or t + 1 == cfg.rounds:
                self.checkpoint()
        bar.close()
        history = History(self.records, self.run_dir.path if self.run_dir else None)
        if self.run_dir:
            from pflego.plots import plot_histories

            plot_histories(
                {cfg.algorithm: history},
                self.run_dir.path / "curves.png",
                f"{cfg.algorithm} on {cfg.dataset}",
            )
        return history


def evaluation_due(config: Config, completed: int) -> bool:
    """Evaluate every ``eval_every`` rounds, at each of the last ``average_last`` and at the end."""
    return (
        completed % config.eval_every == 0
        or completed > config.rounds - config.average_last
        or completed == config.rounds
    )


def evaluation_record(
    config: Config, completed: int, summary: dict[str, float], seconds: float
) -> dict[str, Any]:
    """One line of ``metrics.jsonl``."""
    return {
        "round": completed,
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        **summary,
        "seconds": round(seconds, 3),
    }


def default_out(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.algorithm}-{config.dataset}-{stamp}"


def run_experiment(experiment: Experiment, out: str | Path, progress: bool = True) -> History:
    """Run a built experiment into the directory ``out``."""
    run_dir = RunDir(out)
    run_dir.start(to_dict(experiment.config), experiment.data.summary())
    return Simulation(experiment, run_dir).run(progress)


def run(
    config: Config | dict[str, Any] | str | Path | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    **overrides: Any,
) -> History:
    """Run one experiment and write its directory.

    Args:
        config: A ``Config``, a dict of settings, a YAML path, or ``None`` for the defaults.
        out: The run directory (default ``config.out`` or ``runs/<algorithm>-<dataset>-<time>``).
        progress: Show a progress bar.
        **overrides: Settings that replace those in ``config``.

    Returns:
        The run's :class:`History`.
    """
    cfg = load_config(config, **overrides)
    return run_experiment(build_experiment(cfg), out or cfg.out or default_out(cfg), progress)


def resume(run_dir: str | Path, progress: bool = True) -> History:
    """Continue a stopped run from its last checkpoint; the result equals an uninterrupted run."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    directory = RunDir(run_dir)
    cfg = load_config(read_yaml(directory.config))
    simulation = Simulation(build_experiment(cfg), directory)
    simulation.load_state_dict(directory.load_checkpoint())
    directory.rewind(simulation.records, simulation.next_round)
    return simulation.run(progress)
