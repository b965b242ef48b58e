"""The speed setting of the bench and its two sections; what every section shares.

The speed sections run many simulations on one loaded, partitioned dataset and one model
(:class:`Bench`), each in both training modes of :data:`MODES` (full-batch gradient descent, the
PFLEGO paper's setting, and minibatch SGD with batch size 10) for each of :data:`ALGORITHMS`:

1. per-round wall clock of every algorithm on the vectorized (``vmap``), ``fused`` and ``loop``
   backends, with the backend ``auto`` picks and its speed-up over the loop;
2. client FLOPs (the matrix products of the cohort's client updates as
   ``torch.utils.flop_counter`` counts them, on the vmap backend) and wall clock per round as the
   local steps tau grow, each relative to the smallest tau.

Every section also uses the dataset choice, the timing and the Markdown tables here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from torch.utils.flop_counter import FlopCounterMode

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


BACKEND_NAMES = ("vmap", "fused", "loop")


def median_round(sim: Simulation, rounds: int) -> float:
    """Median wall clock of ``rounds`` rounds after one warm-up round."""
    sim.run_round(0)
    return float(np.median([time_round(sim, t) for t in range(1, rounds + 1)]))


def backend_section(bench: Bench, rounds: int, tau: int) -> list[str]:
    """The section's Markdown lines: a row per training mode and algorithm, milliseconds per
    round on each backend (full batch: ``tau`` local steps; minibatch: one epoch)."""
    rows = []
    for mode, settings in MODES.items():
        steps = {"inner_steps": tau} if not settings else {"local_epochs": 1.0}
        for name in ALGORITHMS:
            times = {
                b: median_round(bench.simulation(name, b, **settings, **steps), rounds)
                for b in BACKEND_NAMES
            }
            auto = bench.simulation(name, "auto", **settings, **steps).backend_name
            rows.append(
                [mode, name]
                + [f"{times[b] * 1e3:.0f}" for b in BACKEND_NAMES]
                + [auto, f"{times['loop'] / times[auto]:.1f}x"]
            )
    return [
        "",
        f"## 1. Per-round wall clock by backend (full batch: tau={tau}; "
        "minibatch: one local epoch)",
        "",
        markdown(
            ["setting", "algorithm", *(f"{b} ms" for b in BACKEND_NAMES), "auto", "vs loop"], rows
        ),
    ]


def client_flops(sim: Simulation, t: int) -> int:
    """FLOPs of the cohort's client updates in round ``t`` (matrix products, as counted by torch)."""
    ctx, cohort = sim.context(t), sim.cohort(t)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    states, inputs = sim.states(cohort, downlink, ctx), sim.round_inputs(t, cohort)
    with FlopCounterMode(display=False) as counter:
        sim.backend(sim.algorithm, downlink, states, inputs, ctx)
    return counter.get_total_flops()


def tau_section(bench: Bench, rounds: int, taus: Sequence[int]) -> list[str]:
    """The section's Markdown lines: a row per training mode, algorithm and tau, GFLOP and
    milliseconds per round."""
    rows = []
    for mode, settings in MODES.items():
        for name in ALGORITHMS:
            first = None
            for tau in taus:
                sim = bench.simulation(name, "vmap", inner_steps=tau, **settings)
                flops = client_flops(sim, 0)  # also the warm-up
                seconds = float(np.median([time_round(sim, t) for t in range(rounds)]))
                first = first or (flops, seconds)
                rows.append(
                    [
                        mode,
                        name,
                        str(tau),
                        f"{flops / 1e9:.2f}",
                        f"{flops / first[0]:.2f}x",
                        f"{seconds * 1e3:.0f}",
                        f"{seconds / first[1]:.2f}x",
                    ]
                )
    return [
        "",
        "## 2. Client FLOPs and wall clock per round against tau (vmap backend)",
        "",
        markdown(
            ["setting", "algorithm", "tau", "GFLOP", "vs first", "round ms", "vs first"], rows
        ),
    ]
