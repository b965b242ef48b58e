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

from pflego.algorithms import ALGORITHMS, Algorithm, build_algorithm
from pflego.config import Config, load_config, read_yaml, to_dict
from pflego.data import DATASETS, FederatedData, federate, load_dataset
from pflego.errors import ConfigError
from pflego.eval import evaluate
from pflego.history import History, RunDir
from pflego.models import build_model
from pflego.optim import make_optimizer
from pflego.sim.backends import BACKENDS
from pflego.sim.clients import ClientStore, client_data, schedule, seed_for
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
    raw = load_dataset(config.dataset, config.data_dir, seed=config.seed)
    data = federate(
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
    """State of a simulated run and the round loop over it."""

    def __init__(self, experiment: Experiment, run_dir: RunDir | None) -> None:
        self.exp = experiment
        self.cfg = experiment.config
        self.run_dir = run_dir
        self.backend = BACKENDS[self.cfg.backend]
        self.algorithm = experiment.algorithm
        self.server: ServerState = self.algorithm.init_server(
            self.algorithm.init_params(self.cfg.seed, experiment.dtype)
        )
        self.store = ClientStore(experiment.data.num_clients)
        self.records: list[dict[str, Any]] = []
        self.next_round = 0
        self.seconds = 0.0

    # --- the population ---------------------------------------------------------------------

    def context(self, t: int) -> RoundContext:
        cfg, data = self.cfg, self.exp.data
        expected = (
            max(1, round(cfg.participation * cfg.clients))
            if cfg.sampling == "fixed"
            else cfg.participation * cfg.clients
        )
        server_lr = cfg.server_lr if cfg.server_lr is not None else self.algorithm.default_server_lr
        return RoundContext(
            t, data.num_clients, expected, data.total_train, cfg.client_lr, server_lr
        )

    def cohort(self, t: int) -> np.ndarray:
        """Clients of round t: exactly r without replacement, or each with probability p."""
        rng = np.random.default_rng(seed_for(self.cfg.seed, 1, t))
        num = self.exp.data.num_clients
        if self.cfg.sampling == "fixed":
            return np.sort(
                rng.choice(num, max(1, round(self.cfg.participation * num)), replace=False)
            )
        return np.flatnonzero(rng.random(num) < self.cfg.participation)

    def client_state(self, client: int, downlink, ctx: RoundContext) -> ClientState:
        """A client's stored state, or its first-visit state (seeded by the client id)."""
        if self.store.visited[client]:
            return self.store.get(client)
        generator = torch.Generator().manual_seed(seed_for(self.cfg.seed, 3, client))
        return self.algorithm.init_client(downlink, generator, ctx)

    # --- one round --------------------------------------------------------------------------

    def run_round(self, t: int) -> None:
        cfg, data = self.cfg, self.exp.data
        ctx = self.context(t)
        cohort = self.cohort(t)
        if len(cohort) == 0:  # Bernoulli sampling drew nobody: the stochastic gradient is zero
            return
        downlink = self.algorithm.downlink(self.server, ctx)
        states = [self.client_state(int(i), downlink, ctx) for i in cohort]
        datas = []
        for i in cohort:
            n = int(data.train_sizes[i])
            rng = np.random.default_rng(seed_for(cfg.seed, 2, t, int(i)))
            batches = schedule(n, cfg.inner_steps, cfg.batch_size, cfg.local_epochs, rng)
            datas.append(
                client_data(data, int(i), self.algorithm.label_space, batches, self.exp.dtype)
            )
        out, new_states = self.backend(self.algorithm, downlink, states, datas, ctx)
        for i, state in zip(cohort, new_states):
            self.store.put(int(i), state)
        self.server = self.algorithm.server_update(
            self.server, self.algorithm.aggregate(out, ctx), ctx
        )

    def evaluate(self, completed: int) -> dict[str, Any]:
        ctx = self.context(completed)
        downlink = self.algorithm.downlink(self.server, ctx)
        summary, rows = evaluate(
            self.algorithm,
            downlink,
            lambda i: self.client_state(i, downlink, ctx),
            self.exp.data,
            self.exp.dtype,
        )
        record = {
            "round": completed,
            "algorithm": self.cfg.algorithm,
            "dataset": self.cfg.dataset,
            **summary,
            "seconds": round(self.seconds, 3),
        }
        self.records.append(record)
        if self.run_dir:
            self.run_dir.log(record, rows)
        return record

    def should_evaluate(self, completed: int) -> bool:
        cfg = self.cfg
        return (
            completed % cfg.eval_every == 0
            or completed > cfg.rounds - cfg.average_last
            or completed == cfg.rounds
        )

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
        self.next_round, self.server, self.records = (
            state["next_round"],
            state["server"],
            state["records"],
        )
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


def default_out(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.algorithm}-{config.dataset}-{stamp}"


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
    experiment = build_experiment(cfg)
    run_dir = RunDir(out or cfg.out or default_out(cfg))
    run_dir.start(to_dict(cfg), experiment.data.summary())
    return Simulation(experiment, run_dir).run(progress)


def resume(run_dir: str | Path, progress: bool = True) -> History:
    """Continue a stopped run from its last checkpoint; the result equals an uninterrupted run."""
    directory = RunDir(run_dir) if Path(run_dir).is_dir() else None
    if directory is None:
        raise ConfigError(f"run directory {run_dir} does not exist")
    cfg = load_config(read_yaml(directory.config))
    simulation = Simulation(build_experiment(cfg), directory)
    state = directory.load_checkpoint()
    simulation.load_state_dict(state)
    directory.rewind(simulation.records, simulation.next_round)
    return simulation.run(progress)
