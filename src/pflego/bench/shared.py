"""What the bench's sections share: the dataset choice, timing, the speed setting, Markdown tables.

The speed sections (backends, tau) run many simulations on one loaded, partitioned dataset and one
model (:class:`Bench`), each in both training modes of :data:`MODES` (full-batch gradient descent,
the PFLEGO paper's setting, and minibatch SGD with batch size 10) for each of :data:`ALGORITHMS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pflego.algorithms import build_algorithm
from pflego.config import load_config
from pflego.data import load_dataset
from pflego.errors import PflegoError
from pflego.sim import Experiment, Simulation, build_experiment
from pflego.sim.profile import wait_for_device

T = TypeVar("T")

ALGORITHMS = ("pflego", "fedavg", "fedper")
MODES = {"full-batch GD": {}, "minibatch SGD (B=10)": {"batch_size": 10}}


def pick_dataset(data_dir: str | None) -> str:
    """``mnist`` when its files are under ``data_dir``, else the embedded ``mnist5k``."""
    if data_dir is None:
        return "mnist5k"
    try:
        load_dataset("mnist", data_dir)
    except PflegoError:
        return "mnist5k"
    return "mnist"


class Bench:
    """Experiments sharing one loaded, partitioned dataset and one model."""

    def __init__(
        self, dataset: str, data_dir: str | None, clients: int, participation: float
    ) -> None:
        base = {
            "dataset": dataset,
            "data_dir": data_dir,
            "clients": clients,
            "participation": participation,
            "algorithm": "pflego",
        }
        self.base = build_experiment(load_config(base))

    def simulation(self, algorithm: str, backend: str, **settings: Any) -> Simulation:
        """A fresh simulation of ``algorithm`` on ``backend`` with the base's data and model."""
        cfg = self.base.config.replace(algorithm=algorithm, backend=backend, **settings)
        alg = build_algorithm(algorithm, self.base.algorithm.model)
        return Simulation(Experiment(cfg, self.base.data, alg), None)


def timed(work: Callable[[], T]) -> tuple[T, float]:
    """What ``work()`` returns, and the wall-clock seconds it took (its CUDA kernels included)."""
    wait_for_device()  # what was queued before is not this work's
    start = time.perf_counter()
    result = work()
    wait_for_device()  # CUDA kernels run asynchronously: wait for them
    return result, time.perf_counter() - start


def time_round(sim: Simulation, t: int) -> float:
    """Wall-clock seconds of round ``t`` of ``sim``."""
    return timed(lambda: sim.run_round(t))[1]


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of ``rows`` (cells already formatted) under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
