"""Section ``parallel``: runs spread over processes, measured in one bench run.

- ``--jobs``: ``pflego reproduce main`` (two seeds, so six runs) timed as a whole command in a
  fresh process with ``--jobs 1`` and ``--jobs 2``, one torch thread per run either way.
- ``--nproc``: one run across 1 and 2 processes (one thread each), on the main experiment's
  setting and on a CNN (FedAvg, the PGFed CNN): the training seconds per round that the run
  records (``metrics.jsonl``), and the whole command's wall clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pflego.bench.fresh_process import child_env
from pflego.history import History

#: The settings of the ``--nproc`` rows (``pflego run`` flags).
NPROC_SETTINGS = {
    "main (PFLEGO, mnist5k, 50 clients, tau 50, 20%)": "--dataset mnist5k --partition classes "
    "--classes-per-client high --clients 50 --participation 0.2 --inner-steps 50 --algorithm "
    "pflego --client-lr 1.0 --server-lr 1.0",
    "CNN (FedAvg, pgfed-cnn, mnist5k, 20 clients, 50%, 10 steps of 32)": "--dataset mnist5k "
    "--model pgfed-cnn --algorithm fedavg --clients 20 --participation 0.5 --inner-steps 10 "
    "--batch-size 32",
}


def timed_command(argv: list[str]) -> float:
    """Wall-clock seconds of ``python -m pflego.cli ARGV`` in a fresh process (this pflego)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pflego.cli", *argv], capture_output=True, text=True, env=child_env()
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pflego {' '.join(argv)} failed: {last}")
    return time.perf_counter() - start


def parallel_section(rounds: int = 20, jobs: tuple[int, ...] = (1, 2)) -> list[str]:
    """The ``reproduce main`` wall clock with each number of worker processes in ``jobs``."""
    seconds = {}
    for count in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            seconds[count] = timed_command(
                ["reproduce", "main", "--seeds", "0,1", "--rounds", str(rounds), "--jobs",
                 str(count), "--threads", "1", "--quiet", "--out", f"{tmp}/main"]
            )  # fmt: skip
    base = seconds[jobs[0]]
    lines = [
        "## Parallel runs",
        "",
        f"`pflego reproduce main --seeds 0,1 --rounds {rounds} --threads 1 --jobs N` (6 runs), "
        f"whole command in a fresh process, on {os.cpu_count()} CPU cores.",
        "",
        "| --jobs | seconds | speed-up |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {s:.1f} | {base / s:.2f}x |" for n, s in seconds.items()]
    return lines + nproc_rows(rounds)


def nproc_rows(rounds: int) -> list[str]:
    """One run of each :data:`NPROC_SETTINGS` on 1 and 2 processes (one thread each)."""
    lines = [
        "",
        f"`pflego run SETTINGS --rounds {rounds} --threads 1 --nproc N`: training seconds per "
        "round (from the run's metrics.jsonl) and the whole command (startup included).",
        "",
        "| setting | s/round, 1 process | s/round, 2 processes | speed-up | command, 1 / 2 (s) |",
        "|---|---|---|---|---|",
    ]
    for name, flags in NPROC_SETTINGS.items():
        per_round, whole = {}, {}
        for nproc in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                argv = ["run", *flags.split(), "--rounds", str(rounds), "--eval-every",
                        str(rounds), "--set", "average_last=0", "--threads", "1", "--nproc",
                        str(nproc), "--quiet", "--out", f"{tmp}/run"]  # fmt: skip
                whole[nproc] = timed_command(argv)
                per_round[nproc] = History.load(Path(tmp) / "run").records[-1]["seconds"] / rounds
        lines.append(
            f"| {name} | {per_round[1]:.3f} | {per_round[2]:.3f} | "
            f"{per_round[1] / per_round[2]:.2f}x | {whole[1]:.1f} / {whole[2]:.1f} |"
        )
    return lines + [""]
