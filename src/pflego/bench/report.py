"""``run_bench``: run the chosen sections of ``pflego bench`` and assemble their Markdown report.

The speed sections (backends, tau, memory) share one setting, stated once above them; the
``scale`` and ``against`` sections state their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pflego.bench.against import AGAINST_ALGORITHMS, AGAINST_MODELS, against_section
from pflego.bench.backends import backend_section
from pflego.bench.memory import memory_section
from pflego.bench.parallel import parallel_section
from pflego.bench.scale import scale_section
from pflego.bench.shared import Bench, pick_dataset
from pflego.bench.tau import tau_section
from pflego.config import load_config
from pflego.errors import ConfigError

SPEED_SECTIONS = ("backends", "tau", "memory")


def run_bench(
    data_dir: str | None = None,
    clients: int = 100,
    participation: float = 0.2,
    taus: Sequence[int] = (5, 25, 50, 100),
    backend_tau: int = 50,
    rounds: int = 2,
    memory_clients: int = 10_000,
    threads: int | None = None,
    out: str | Path | None = "bench.md",
    sections: Sequence[str] = SPEED_SECTIONS,
    against_rounds: int = 4,
    models: Sequence[str] = AGAINST_MODELS,
    algorithms: Sequence[str] = AGAINST_ALGORITHMS,
    parallel_rounds: int = 20,
    device: str = "cpu",
) -> str:
    """Run the benchmark and return (and optionally write) its Markdown report.

    Args:
        data_dir: Where ``mnist/`` lives; without it the embedded ``mnist5k`` is used.
        clients: Population for the speed and FLOP measurements.
        participation: Fraction of clients per round.
        taus: Local step counts for the FLOP / wall-clock sweep.
        backend_tau: Full-batch local steps in the backend comparison (minibatch runs run
            one local epoch).
        rounds: Timed rounds per cell (the median is reported).
        memory_clients: Population of the peak-memory run.
        threads: ``torch.set_num_threads`` (default: leave as is).
        out: Markdown file to write, or ``None``.
        sections: Which of ``backends``, ``tau``, ``memory``, ``against`` (the comparison with
            the conventional way), ``scale`` (``clients`` generated clients) and ``parallel``
            (whole commands on 1 and 2 worker processes) to run.
        against_rounds: Rounds each side of the comparison runs (the first is a warm-up).
        models: The comparison's models.
        algorithms: The comparison's algorithms.
        parallel_rounds: Rounds of every run of the ``parallel`` section.
        device: Where the ``against`` section runs both sides (``cuda``: a GPU); the other
            sections run on the CPU.

    Raises:
        ConfigError: ``device`` is not the CPU and a section other than ``against`` is asked
            for, or the device is not there.
    """
    if device != "cpu":
        others = [s for s in sections if s != "against"]
        if others:
            raise ConfigError(
                f"--device {device} applies to the against section only (--against "
                f"conventional); the {', '.join(others)} section(s) run on the CPU: drop --device "
                "for them"
            )
        try:
            load_config({"device": device})
        except ConfigError as error:  # the setting's message, in the flag's words
            reason = str(error).split("; use ")[0]
            raise ConfigError(
                f"--device {device}: {reason}; drop --device to run on the CPU"
            ) from None
    if threads:
        torch.set_num_threads(threads)
    dataset = pick_dataset(data_dir)
    parts = ["# pflego bench", ""]
    if "parallel" in sections:
        parts += parallel_section(parallel_rounds)
    if "scale" in sections:
        parts += scale_section(clients, rounds, torch.get_num_threads())
    if "against" in sections:
        parts += against_section(
            data_dir, clients, participation, against_rounds, models, algorithms, device
        )
    if any(s in SPEED_SECTIONS for s in sections):
        bench = Bench(dataset, data_dir, clients, participation)
        parts += [
            f"{dataset} ({bench.base.data.total_train} training images), MLP 784-200 + linear "
            f"head, {clients} clients, {participation:.0%} participation, "
            f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, "
            f"device cpu. Median of {rounds} round(s) after a warm-up.",
        ]
    if "backends" in sections:
        parts += backend_section(bench, rounds, backend_tau)
    if "tau" in sections:
        parts += tau_section(bench, rounds, taus)
    if "memory" in sections:
        parts += memory_section(dataset, data_dir, memory_clients, rounds, torch.get_num_threads())
    report = "\n".join(parts) + "\n"
    print(report)
    if out:
        Path(out).write_text(report)
    return report
