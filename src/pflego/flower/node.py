"""What one SuperNode does for its client, without any Flower types.

A node serves one client, either a partition of the run's dataset or the site's own data:

- **partition** (``partition-id=i``): the node rebuilds the experiment from the run's config (the
  partition is a deterministic function of the config and seed, so every node agrees on it) and
  keeps only client i's rows;
- **site data** (``data=/path format=...``, :mod:`pflego.flower.sitedata`): the node reads its
  own files; the run's task (input shape, label space, K_max), learned by the server from every
  node's report, maps its label names to global ids.

Either way the node runs the algorithm's ``client_update`` on exactly the inputs the simulator
would give that client: the same ``client_data``, the same minibatch schedule (seeded by
``seed_for(seed, 2, t, i)``) and the same first-visit state (``seed_for(seed, 3, i)``), where i is
the client id the server assigned (the partition id when every node is there from the start).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from pflego.algorithms import Algorithm
from pflego.config import Config, load_config
from pflego.data import FederatedData
from pflego.errors import ConfigError, DataError
from pflego.flower.population import Report, Task
from pflego.flower.sitedata import Site, default_site_name, read_site
from pflego.history import atomic_write
from pflego.rng import adapt_rng, minibatch_rng
from pflego.sim import build_algorithm_for, build_experiment
from pflego.sim.clients import client_data, client_schedules
from pflego.sim.metrics import Personalization, evaluate
from pflego.sim.privacy import Accountant, Privacy
from pflego.tree import Params
from pflego.types import ClientOut, ClientState, RoundContext, Schedule


@dataclass
class ClientNode:
    """One client's data and the algorithm, as a SuperNode holds them.

    Attributes:
        config: The run's config.
        client: The client id i the server assigned (the partition id when every node is
            there from the start).
        data: The client's own data as a one-client ``FederatedData``.
        algorithm: The algorithm built for the run.
    """

    config: Config
    client: int
    data: FederatedData
    algorithm: Algorithm
    privacy: Privacy | None = None

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.config.dtype)

    def first_visit_state(self, downlink: Params, ctx: RoundContext) -> ClientState:
        """The state the simulator gives this client at its first visit (seeded by its id, in
        the run's dtype)."""
        return self.algorithm.first_visit_state(
            downlink, self.config.seed, self.client, ctx, self.dtype
        )

    @property
    def run_schedule(self) -> Schedule:
        return Schedule(self.config.inner_steps, self.config.batch_size, self.config.local_epochs)

    def train(
        self, downlink: Params, state: ClientState, ctx: RoundContext
    ) -> tuple[ClientOut, ClientState]:
        """One round of the algorithm's local work for this client."""
        cfg = self.config
        n = int(self.data.train_sizes[0])
        run = self.run_schedule
        main, named = client_schedules(
            n,
            run,
            self.algorithm.schedules(run),
            lambda stream: minibatch_rng(cfg.seed, ctx.round, self.client, stream),
        )
        data = client_data(
            self.data,
            0,
            self.algorithm.label_space,
            main,
            self.dtype,
            named,
            validation=self.algorithm.uses_validation,
        )
        out, new_state = self.algorithm.client_update(downlink, state, data, ctx)
        if self.privacy is not None:  # local noise: clipped and noised before it leaves
            out = self.privacy.on_client(out, self.client, ctx.round)
        return out, new_state

    def evaluate(self, downlink: Params, state: ClientState, ctx: RoundContext) -> dict[str, Any]:
        """This client's row of the evaluation table (after ``adapt`` where the algorithm has one)."""
        personalization = None
        if self.algorithm.adapts:
            n = int(self.data.train_sizes[0])
            plan = self.algorithm.adapt_schedule(self.run_schedule)
            batches = client_schedules(
                n,
                plan,
                {},
                lambda stream: adapt_rng(self.config.seed, ctx.round, self.client, stream),
            )[0]
            inputs = client_data(self.data, 0, self.algorithm.label_space, batches, self.dtype)
            stacked = tree_map(lambda t: t.unsqueeze(0), inputs)
            personalization = Personalization(
                "adapt", lambda ids: stacked, ctx, lambda ids: [inputs]
            )
        one = self.algorithm.received(downlink).sent_to(1)  # this client's, as one of one
        _, rows = evaluate(
            self.algorithm, one, lambda _: state, self.data, self.dtype, personalization
        )
        return {**rows[0], "client": self.client}


def config_key(config: Config) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


@lru_cache(maxsize=4)
def _experiment(config_json: str):
    return build_experiment(load_config(json.loads(config_json)))


@lru_cache(maxsize=8)
def _algorithm(config_json: str, task: Task) -> Algorithm:
    config = load_config(json.loads(config_json))
    return build_algorithm_for(config, task.input_shape, task.num_classes, task.max_classes)


class PartitionSource:
    """Client ``partition`` of the run's dataset, rebuilt from the config."""

    def __init__(self, config: Config, partition: int) -> None:
        if not 0 <= partition < config.clients:
            raise ConfigError(
                f"partition-id={partition} is outside 0..{config.clients - 1} (the run has "
                f"{config.clients} clients); start each SuperNode with its own partition-id"
            )
        self.config, self.partition = config, partition
        self.experiment = _experiment(config_key(config))
        # Its rows as a one-client FederatedData; the label table keeps the population's width
        # K_max, so a personal head has the same shape as in the simulator.
        self.data = self.experiment.data.subset(np.array([partition]))

    def report(self) -> Report:
        row = self.data.summary()[0]
        return Report(
            f"partition-{self.partition}",
            row["train"],
            row["test"],
            tuple(str(c) for c in row["classes"]),
            tuple(self.data.input_shape),
            self.data.num_classes,
            self.data.max_classes,
        )

    @property
    def task(self) -> Task:
        """The dataset's own task: its input shape, labels 0..C-1 and the partition's K_max."""
        return Task(
            tuple(self.data.input_shape),
            tuple(str(k) for k in range(self.data.num_classes)),
            self.data.max_classes,
        )

    def node(self, client: int, task: Task) -> ClientNode:
        """The client's node for a task, which must be the partition's own."""
        own = self.task
        if task != own:
            raise DataError(
                f"partition {self.partition} has inputs {own.input_shape}, "
                f"{own.num_classes} labels and K_max={own.max_classes}, but the run's task has "
                f"{task.input_shape}, {task.num_classes} labels and K_max={task.max_classes}"
            )
        return ClientNode(self.config, client, self.data, self.experiment.algorithm)


class SiteSource:
    """The site's own data (:class:`~pflego.flower.sitedata.Site`)."""

    def __init__(self, config: Config, site: Site) -> None:
        self.config, self.site = config, site

    def report(self) -> Report:
        return self.site.report()

    def node(self, client: int, task: Task) -> ClientNode:
        """The client's node: its data over the task's label space and the task's model."""
        data = self.site.federated(task)
        return ClientNode(self.config, client, data, _algorithm(config_key(self.config), task))


@lru_cache(maxsize=16)
def _site(name: str, path: str, fmt: str, label_column: str, config_json: str) -> Site:
    arrays = read_site(path, fmt, label_column)
    return Site.load(name, arrays, load_config(json.loads(config_json)))


def load_source(config: Config, node_config: dict[str, Any]) -> PartitionSource | SiteSource:
    """What this SuperNode serves, from its node config.

    ``data=/path format=imagefolder|npz|csv|idx [label-column=label] [site=NAME]``: the site's
    own data; otherwise ``partition-id=i [num-partitions=I]``: a partition of the run's dataset.
    """
    if node_config.get("data"):
        path = str(node_config["data"])
        fmt = str(node_config.get("format", "") or "")
        if not fmt:
            raise ConfigError(
                f"data={path} needs its format: add format=imagefolder|npz|csv|idx to --node-config"
            )
        name = str(node_config.get("site", "") or "") or default_site_name(path)
        label_column = str(node_config.get("label-column", "label"))
        return SiteSource(config, _site(name, path, fmt, label_column, config_key(config)))
    if "partition-id" not in node_config:
        raise ConfigError(
            "start the SuperNode with --node-config 'data=/path format=...' (its own data) or "
            "'partition-id=<i> num-partitions=<I>' (a partition of the run's dataset)"
        )
    partitions = node_config.get("num-partitions")
    if partitions is not None and int(partitions) != config.clients:
        raise ConfigError(
            f"this node has num-partitions={partitions} but the run has clients={config.clients}"
        )
    return PartitionSource(config, int(node_config["partition-id"]))


def local_privacy(config: Config, noise: float | None) -> Privacy | None:
    """A node's local differential privacy (``dp_local``): the run's clipping norm and seed with
    the noise multiplier ``noise`` the server resolved and sent (only the server knows the
    population its accountant calibrates it for); ``None`` without local noise."""
    if config.dp_clip is None or not config.dp_local:
        return None
    if noise is None:
        raise ConfigError("the run adds local noise (dp_local), but the server sent no dp-noise")
    accountant = Accountant(float(noise), 0, 0.0, config.sampling, config.dp_delta, local=True)
    return Privacy(config.dp_clip, accountant, config.seed, ())


class StateFiles:
    """Client states on the node's disk, one file per (run, client, round), written atomically.

    Flower keeps ``context.state`` in the SuperNode's memory only; these files let a restarted
    node continue with the client's personal state instead of a fresh one. Each state is tagged
    with the round that produced it and the two newest are kept: a round the server repeats after
    a restart reads the state from before it, whatever the interrupted attempt wrote.
    """

    keep = 2

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def folder(self, run: str, client: int) -> Path:
        return self.directory / f"run-{run}" / f"client-{client}"

    def rounds(self, run: str, client: int) -> list[int]:
        """The rounds whose states are on disk, oldest first."""
        folder = self.folder(run, client)
        if not folder.is_dir():
            return []
        names = (p.name for p in folder.glob("round-*.pt"))
        return sorted(int(n[len("round-") : -len(".pt")]) for n in names)

    def load(self, run: str, client: int, before: int) -> ClientState | None:
        """The newest state from a round before ``before``, or ``None``."""
        earlier = [t for t in self.rounds(run, client) if t < before]
        if not earlier:
            return None
        path = self.folder(run, client) / f"round-{earlier[-1]}.pt"
        return torch.load(path, weights_only=True)

    def save(self, run: str, client: int, round_: int, state: ClientState) -> None:
        folder = self.folder(run, client)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"round-{round_}.pt"
        atomic_write(path, lambda p: torch.save({k: v.detach() for k, v in state.items()}, p))
        for old in self.rounds(run, client)[: -self.keep]:
            (folder / f"round-{old}.pt").unlink(missing_ok=True)
