"""Building an experiment from its settings: load and partition the data, hold out unseen clients,
build the model and the algorithm, and fill in the algorithm's default step sizes."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pflego.algorithms import ALGORITHMS, Algorithm, build_algorithm
from pflego.algorithms.base import check_settings
from pflego.config import Config
from pflego.data import ArrayDataset, FederatedData, dataset_info, federate, load_dataset
from pflego.data.stream import POPULATIONS
from pflego.environment import environment
from pflego.errors import ConfigError
from pflego.models import build_model
from pflego.optim import make_optimizer
from pflego.rng import seed_for


@dataclass
class Experiment:
    """A resolved run: the config, the federated data and the algorithm built for them.

    Attributes:
        config: The run's settings.
        data: The clients that train (the population of the round loop).
        algorithm: The algorithm built for the data's model.
        unseen: Clients that never train and personalize only at evaluation
            (``unseen_fraction``), or ``None``.
        data_files: The dataset's source files (their checksums go into ``environment.json``).
        public: The public (proxy) inputs ``[P, ...]`` of an algorithm with ``public_size``
            (model inputs, float32), or ``None``.
    """

    config: Config
    data: FederatedData
    algorithm: Algorithm
    unseen: FederatedData | None = None
    data_files: list[Path] = field(default_factory=list)
    public: Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.config.dtype)

    def environment(self) -> dict[str, Any]:
        """``environment.json``: versions, device, threads and the data files' checksums."""
        return environment(self.config.device, self.data_files)

    def partition_summary(self) -> list[dict[str, Any]]:
        """``partition.json``: the training clients, then the unseen ones (numbered after them)."""
        unseen = self.unseen.summary() if self.unseen is not None else []
        offset = self.data.num_clients
        return self.data.summary() + [
            {**row, "client": row["client"] + offset, "unseen": True} for row in unseen
        ]


def _optimizer(name: str, config: Config, weight_decay: float = 0.0):
    if name == "momentum":
        return make_optimizer(name, momentum=config.momentum, weight_decay=weight_decay)
    return make_optimizer(name, weight_decay=weight_decay)


def partition(raw: ArrayDataset, config: Config) -> FederatedData:
    """Split a loaded dataset over clients as ``config`` says (the official test split pooled
    with ``pool_test``, labels relabelled per client with ``labels=local``)."""
    data = federate(
        raw.pooled() if config.pool_test else raw,
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
    return data.with_local_labels() if config.labels == "local" else data


def split_unseen(
    data: FederatedData, fraction: float, seed: int
) -> tuple[FederatedData, FederatedData | None]:
    """Hold out ``round(fraction * I)`` clients (seeded choice) that never train."""
    count = round(fraction * data.num_clients)
    if count == 0:
        return data, None
    if count >= data.num_clients:
        raise ConfigError(
            f"unseen_fraction={fraction} leaves no client to train among {data.num_clients}"
        )
    order = np.random.default_rng(seed_for(seed, 5)).permutation(data.num_clients)
    unseen = np.sort(order[:count])
    seen = np.setdiff1d(np.arange(data.num_clients), unseen)
    return data.subset(seen), data.subset(unseen)


def build_algorithm_for(
    config: Config, input_shape: tuple[int, ...], num_classes: int, max_classes: int
) -> Algorithm:
    """The run's model and algorithm for inputs of ``input_shape``, C = ``num_classes`` labels
    and personal heads over up to K_max = ``max_classes`` local classes (no data needed)."""
    model_name = (
        dataset_info(config.dataset).default_model if config.model == "auto" else config.model
    )
    model = build_model(model_name, input_shape, num_classes, max_classes)
    check_settings(config)
    return build_algorithm(
        config.algorithm,
        model,
        config.options,
        client_optimizer=_optimizer(config.client_optimizer, config, config.weight_decay),
        server_optimizer=_optimizer(config.server_optimizer, config),
        head_init=config.head_init,
    )


def build_experiment(config: Config) -> Experiment:
    """Check names first, then load and partition the data and build model and algorithm."""
    if config.algorithm not in ALGORITHMS:
        raise ConfigError(
            f"unknown algorithm {config.algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    dataset_info(config.dataset)  # an unknown dataset fails here, before any data is loaded
    check_settings(config)  # before any data is loaded
    size = ALGORITHMS[config.algorithm].public_size
    if config.dataset in POPULATIONS:  # generated client by client: nothing to load
        if size:
            raise ConfigError(
                f"{config.algorithm} needs public data from a dataset's training pool, which the "
                f"generated {config.dataset} has not; choose another dataset"
            )
        data = POPULATIONS[config.dataset](config.clients, config.seed, config.test_fraction)
        return experiment_on(config, data)
    raw = load_dataset(
        config.dataset, config.data_dir, seed=config.seed, **config.dataset_settings()
    )
    exp = experiment_on(config, partition(raw, config), raw.sources)
    size = exp.algorithm.public_size  # the run's own value of the option
    return replace(exp, public=public_inputs(raw, size, config.seed)) if size else exp


#: The random stream of the public inputs' draw.
PUBLIC_STREAM = 31


def public_inputs(raw: ArrayDataset, size: int, seed: int) -> Tensor:
    """``size`` inputs of ``raw``'s training pool, drawn without replacement (seeded), as model
    inputs: the public (proxy) data set of an algorithm with ``public_size``."""
    available = len(raw.x_train)
    if size > available:
        raise ConfigError(
            f"public_size={size} exceeds the {available} training samples of {raw.name}; lower it"
        )
    rows = np.sort(
        np.random.default_rng(seed_for(seed, PUBLIC_STREAM)).choice(available, size, replace=False)
    )
    return torch.as_tensor(raw.x_train[rows]).to(torch.float32) * raw.scale


def experiment_on(
    config: Config, data: FederatedData, data_files: Sequence[Path] = ()
) -> Experiment:
    """``config``'s model and algorithm on already partitioned ``data`` (its unseen clients
    held out as ``config.unseen_fraction`` says), read from ``data_files``."""
    algorithm = build_algorithm_for(config, data.input_shape, data.num_classes, data.max_classes)
    if algorithm.uses_validation and data.val_offsets is None:
        warnings.warn(
            f"{config.algorithm} validates on a held-out split, but val_fraction=0 leaves none: "
            "it uses the training split instead (set val_fraction, e.g. 0.2)",
            stacklevel=2,
        )
    seen, unseen = split_unseen(data, config.unseen_fraction, config.seed)
    if config.sampling == "uniform-count" and config.max_cohort > seen.num_clients:
        raise ConfigError(
            f"max_cohort={config.max_cohort} exceeds the {seen.num_clients} clients that train; "
            "lower it"
        )
    return Experiment(with_step_sizes(config, algorithm), seen, algorithm, unseen, list(data_files))


def with_step_sizes(config: Config, algorithm: Algorithm) -> Config:
    """The config with unset step sizes replaced by the algorithm's defaults, so that a run
    directory's ``config.yaml`` records the step sizes the run used."""
    defaults = {
        "client_lr": algorithm.default_client_lr,
        "server_lr": algorithm.default_server_lr,
    }
    unset = {k: v for k, v in defaults.items() if getattr(config, k) is None}
    return config.replace(**unset) if unset else config
