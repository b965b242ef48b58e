"""Populations generated client by client on demand: any number of clients, memory for a cohort.

A generated population never holds every client's samples. Its clients' sizes are drawn for the
whole population at once (the run needs N = sum N_i); a client's samples are drawn from its own
seed whenever a round or an evaluation needs them, so a cohort of 1,000 out of 1,000,000 clients
costs what 1,000 clients cost. The simulator's :class:`~pflego.sim.clients.GeneratedPool`
stands where a :class:`~pflego.sim.clients.ClientPool` stands and hands out a small pool of the
clients asked.

``synthetic-stream``: Synthetic(0.5, 0.5) of FedProx / pFedMe (as ``synthetic``) with small
clients, ``n_i = floor(LogNormal(2.5, 0.5)) + 5`` samples (about 18; 25% test), ``clients`` of
them (a million is fine). A client's classes are the support of its own draws, so its label set
follows from its samples as for any other dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pflego.data.datasets import register
from pflego.data.federated import ArrayDataset
from pflego.errors import ConfigError

#: Generated populations by dataset name: ``build(clients, seed, test_fraction)``.
POPULATIONS: dict[str, Callable[[int, int, float], GeneratedClients]] = {}


@dataclass
class GeneratedClients:
    """A population whose clients are generated on demand (duck-types ``FederatedData``).

    Attributes:
        name: Dataset name.
        num_classes: C.
        input_shape: One sample's shape.
        train_counts: ``N_i`` of every client.
        test_counts: Test samples of every client.
        draw: ``draw(i, n)`` -> client ``i``'s ``n`` samples ``(x float32, y int64)``; the first
            ``train_counts[i]`` are its training split, the rest its test split.
    """

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    train_counts: np.ndarray
    test_counts: np.ndarray
    draw: Callable[[int, int], tuple[np.ndarray, np.ndarray]]
    scale: float = 1.0
    val_offsets: None = None
    groups: None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_clients(self) -> int:
        return len(self.train_counts)

    @property
    def train_sizes(self) -> Tensor:
        return torch.from_numpy(self.train_counts)

    @property
    def test_sizes(self) -> Tensor:
        return torch.from_numpy(self.test_counts)

    @property
    def total_train(self) -> int:
        return int(self.train_counts.sum())

    @property
    def max_classes(self) -> int:
        """K_max: personal heads are C wide (a client's label set is known only once drawn)."""
        return self.num_classes

    def inputs(self, x: Tensor) -> Tensor:
        return x.to(torch.float32)

    def subset(self, clients: np.ndarray) -> GeneratedClients:
        raise ConfigError(
            f"{self.name} is generated client by client: unseen_fraction is not supported; "
            "set unseen_fraction=0"
        )

    def summary(self) -> list[dict[str, Any]]:
        """Per client: its train / test sample counts (classes are known once drawn)."""
        return [
            {"client": i, "train": int(a), "test": int(b)}
            for i, (a, b) in enumerate(zip(self.train_counts, self.test_counts))
        ]

    def clients(self, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The samples of ``ids`` (the last request is kept: train and test pools share it)."""
        key = np.asarray(ids, np.int64).tobytes()
        if self._cache.get("key") != key:
            counts = self.train_counts[ids] + self.test_counts[ids]
            self._cache.update(
                key=key, value=[self.draw(int(i), int(n)) for i, n in zip(ids, counts)]
            )
        return self._cache["value"]


# --- synthetic-stream -------------------------------------------------------------------------


def synthetic_stream(
    num_clients: int,
    seed: int = 0,
    test_fraction: float = 0.25,
    alpha: float = 0.5,
    beta: float = 0.5,
    dim: int = 60,
    num_classes: int = 10,
) -> GeneratedClients:
    """Synthetic(alpha, beta) with small clients, generated per client on demand.

    Client ``i``'s generator is seeded by ``(seed, i)``: ``u_i ~ N(0, alpha^2)``,
    ``B_i ~ N(0, beta^2)``, ``W_i[j, c], b_i[c] ~ N(u_i, 1)``, ``v_i[j] ~ N(B_i, 1)``,
    ``x ~ N(v_i, diag(j^-1.2))``, ``y = argmax(x W_i + b_i)`` (as ``synthetic``); its size
    ``n_i = floor(LogNormal(2.5, 0.5)) + 5`` comes from one draw for the whole population.
    """
    rng = np.random.default_rng([seed, 11])
    counts = np.floor(rng.lognormal(2.5, 0.5, num_clients)).astype(np.int64) + 5
    test = np.maximum(1, np.round(counts * test_fraction).astype(np.int64))
    std = np.arange(1, dim + 1) ** -0.6

    def draw(client: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        own = np.random.default_rng([seed, 12, client])
        u, b_mean = own.normal(0, alpha), own.normal(0, beta)
        w, b = own.normal(u, 1, (dim, num_classes)), own.normal(u, 1, num_classes)
        v = own.normal(b_mean, 1, dim)
        x = (v + std * own.standard_normal((n, dim))).astype(np.float32)
        return x, np.argmax(x @ w + b, axis=1).astype(np.int64)

    return GeneratedClients(
        f"synthetic-stream({alpha},{beta})", num_classes, (dim,), counts - test, test, draw
    )


POPULATIONS["synthetic-stream"] = synthetic_stream


@register(
    "synthetic-stream",
    "mlp",
    False,
    "Synthetic(0.5, 0.5) with small clients (~18 samples), generated per client: any number",
)
def load_synthetic_stream(root, seed: int = 0) -> ArrayDataset:
    raise ConfigError(
        "synthetic-stream is generated client by client and has no array form; "
        "use it through pflego run / pflego bench (build_experiment)"
    )
