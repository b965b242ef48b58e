"""When a run evaluates and which clients, and the ``metrics.jsonl`` record (the simulator's
evaluation: :class:`~pflego.sim.rounds.Simulation`; the metrics: :mod:`pflego.sim.metrics`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from pflego.config import Config
from pflego.rng import seed_for


def evaluation_sample(config: Config, num_clients: int) -> np.ndarray:
    """The clients every evaluation covers: all, or ``eval_clients`` of them drawn once."""
    count = config.eval_clients
    if count is None or count >= num_clients:
        return np.arange(num_clients)
    rng = np.random.default_rng(seed_for(config.seed, 9))
    return np.sort(rng.choice(num_clients, count, replace=False))


def same_values(a: Any, b: Any) -> bool:
    """Whether two nested dicts and lists of tensors hold the same structure and values."""
    (left, structure), (right, other) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return structure == other and all(
        isinstance(y, Tensor) and torch.equal(x, y) if isinstance(x, Tensor) else x == y
        for x, y in zip(left, right, strict=True)
    )


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
