"""``run_bench``: run the chosen sections of ``pflego bench`` and assemble their Markdown report.

The speed sections (backends, tau, memory) share one setting, stated once above them; the
``scale`` and ``against`` sections state their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pflego.bench.against import AGAINST_ALGORITHMS, AGAINST_MODELS, against_section
from pflego.bench.fresh_process import memory_section, scale_section
from pflego.bench.parallel import parallel_section
from pflego.bench.shared import Bench, backend_section, pick_dataset, tau_section
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
    """Run the benchmark's ``sections`` and return (and optionally write to ``out``) its Markdown.

    The arguments are ``pflego bench``'s flags (``--help`` says what each means); ``threads``
    ``None`` leaves torch's threads as they are, ``out`` ``None`` writes no file.

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
