"""The bench's sections measured in a fresh Python interpreter that imports this very pflego.

Peak resident memory is only reported honestly by a fresh process, so each measurement of the
``memory`` section (PFLEGO with 10,000 clients, each training mode, with the client state store's
size) and of the ``scale`` section (``pflego bench --clients N`` with N above
:data:`SCALE_CLIENTS`: PFLEGO and FedAvg on ``synthetic-stream``, whose clients are generated on
demand: setup, seconds per round, evaluation on a fixed sample of clients, peak memory) runs
:data:`SCRIPT`, which prints one JSON line of results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pflego.bench.shared import markdown

#: The folder holding this ``pflego`` package: ``src/`` of a source checkout.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]

#: The script of every measurement (``{threads}``: torch CPU threads): setup, a warm-up round,
#: the median of ``{rounds}`` timed rounds, an evaluation and the peak resident memory.
SCRIPT = """
import json, resource, time, torch
torch.set_num_threads({threads})
from pflego.config import load_config
from pflego.sim import Simulation, build_experiment
start = time.perf_counter()
cfg = load_config({settings!r})
sim = Simulation(build_experiment(cfg), None)
setup = time.perf_counter() - start
sim.run_round(0)  # warm-up
seconds = []
for t in range(1, {rounds} + 1):
    start = time.perf_counter()
    sim.run_round(t)
    seconds.append(time.perf_counter() - start)
start = time.perf_counter()
record = sim.evaluate({rounds} + 1)
print(json.dumps({{
    "setup_s": setup,
    "round_s": sorted(seconds)[len(seconds) // 2],
    "eval_s": time.perf_counter() - start,
    "eval_clients": record.get("eval_clients", cfg.clients),
    "test_acc": record["test_acc"],
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "store_mb": sim.store.nbytes() / 2**20,
    "backend": sim.backend_name,
    "cohort": len(sim.cohort(0)),
}}))
"""


def child_env() -> dict[str, str]:
    """This process's environment, with which a child interpreter imports this very pflego."""
    paths = [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def in_fresh_process(settings: dict[str, Any], rounds: int, threads: int) -> dict[str, Any] | str:
    """Run :data:`SCRIPT` on ``settings`` in a fresh interpreter that imports this pflego; what
    it measured, or the last line of its error."""
    script = SCRIPT.format(threads=threads, settings=settings, rounds=rounds)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, env=child_env()
    )
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines()[-1:] or ["no output"])[0]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_section(
    dataset: str, data_dir: str | None, clients: int, rounds: int, threads: int
) -> list[str]:
    """The section's Markdown lines: peak RSS of a fresh process running PFLEGO with ``clients``
    clients, full-batch GD and minibatch SGD (B=10), tau=50."""
    rows = []
    for batch in (None, 10):
        settings = {
            "dataset": dataset,
            "data_dir": data_dir,
            "clients": clients,
            "participation": 0.2,
            "algorithm": "pflego",
            "inner_steps": 50,
            "batch_size": batch,
            "min_client_size": 2,
        }
        result = in_fresh_process(settings, rounds, threads)
        if isinstance(result, str):
            rows.append([str(clients), "failed", result, "", "", ""])
            continue
        rows.append(
            [
                str(clients),
                "full-batch GD" if batch is None else f"minibatch SGD (B={batch})",
                str(result["cohort"]),
                f"{result['peak_rss_mb']:.0f}",
                f"{result['store_mb']:.1f}",
                f"{result['round_s'] * 1e3:.0f}",
            ]
        )
    return [
        "",
        f"## 3. Peak memory, PFLEGO with {clients} clients (tau=50, fresh process)",
        "",
        markdown(
            ["clients", "setting", "cohort", "peak RSS MB", "state store MB", "round ms"], rows
        ),
    ]


#: ``pflego bench --clients N`` with N above this measures scale on a generated population.
SCALE_CLIENTS = 10_000

SCALE_HEADER = [
    "algorithm",
    "clients",
    "per round",
    "backend",
    "s/round",
    "ms/client",
    "eval s (clients)",
    "peak RSS MB",
    "store MB",
    "setup s",
]


def scale_row(
    algorithm: str, clients: int, cohort: int, rounds: int, threads: int, eval_clients: int
) -> list[str]:
    """Seconds per round and peak memory of ``algorithm`` on ``clients`` generated clients."""
    settings = {
        "dataset": "synthetic-stream",
        "clients": clients,
        "participation": cohort / clients,
        "algorithm": algorithm,
        "inner_steps": 10,
        "client_lr": 0.05,
        "eval_clients": eval_clients,
    }
    result = in_fresh_process(settings, rounds, threads)
    if isinstance(result, str):
        return [algorithm, str(clients), str(cohort), "failed", result, "", "", "", "", ""]
    return [
        algorithm,
        f"{clients:,}",
        f"{cohort:,}",
        result["backend"],
        f"{result['round_s']:.2f}",
        f"{1e3 * result['round_s'] / cohort:.2f}",
        f"{result['eval_s']:.2f} ({result['eval_clients']:,})",
        f"{result['peak_rss_mb']:.0f}",
        f"{result['store_mb']:.1f}",
        f"{result['setup_s']:.1f}",
    ]


def scale_section(
    clients: int, rounds: int, threads: int, cohorts: Sequence[int] = (100, 1000)
) -> list[str]:
    """PFLEGO and FedAvg on ``clients`` clients of ``synthetic-stream``, each cohort size."""
    rows = [
        scale_row(name, clients, cohort, rounds, threads, eval_clients=1000)
        for name in ("pflego", "fedavg")
        for cohort in cohorts
    ]
    return [
        f"## {clients:,} clients (synthetic-stream, generated per client; fresh process each)",
        "",
        f"Synthetic(0.5, 0.5) with small clients (about 14 training samples), the MLP, 10 full-batch "
        f"local steps; median of {rounds} round(s) after a warm-up; evaluation on a fixed sample of "
        f"1,000 clients (stated in the record as eval_clients); {threads} thread(s).",
        "",
        markdown(SCALE_HEADER, rows),
        "",
    ]
