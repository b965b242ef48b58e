"""A round of the regularized methods beside FedAvg's (issue 26: within 1.3x of FedAvg's round).

Every algorithm gets its own simulation of the same setting (MNIST's MLP, 20 clients, all in every
round, batch 10, one local epoch, one torch thread); after one untimed round each, the rounds are
timed interleaved (FedAvg's round 1, FedProx's round 1, ..., then round 2), so that a change in
the machine's load falls on every algorithm alike. Prints each one's median seconds per round and
its ratio to the first algorithm's.

Usage::

    PYTHONPATH=src python benchmarks/regularized_rounds.py --data-dir ../shared/data \\
        fedavg fedprox feddyn ditto
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pflego.config import load_config
from pflego.sim import Simulation, build_experiment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algorithms", nargs="+", help="the first is the baseline of the ratios")
    parser.add_argument("--data-dir", default=None, help="folder with mnist/ (official files)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per algorithm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = {
        "dataset": "mnist" if args.data_dir else "mnist5k",
        "data_dir": args.data_dir,
        "clients": 20,
        "participation": 1.0,
        "batch_size": 10,
        "local_epochs": 1.0,
        "rounds": args.rounds + 1,
        "seed": 0,
    }
    sims = {}
    for name in args.algorithms:
        sims[name] = Simulation(
            build_experiment(load_config({**settings, "algorithm": name})), None
        )
        sims[name].run_round(0)  # one-time costs: the backend's choice, compiling the kernels
    seconds: dict[str, list[float]] = {name: [] for name in sims}
    for t in range(1, args.rounds + 1):
        for name, sim in sims.items():
            start = time.perf_counter()
            sim.run_round(t)
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds[args.algorithms[0]])
    print(
        f"{settings['dataset']}, 20 clients, batch 10, one epoch, one thread, torch {torch.__version__}"
    )
    print("| algorithm | backend | median s/round | x first | rounds (s) |")
    print("|---|---|---:|---:|---|")
    for name, values in seconds.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(
            f"| {name} | {sims[name].backend_name} | {median:.3f} | {median / base:.2f} | {rounds} |"
        )


if __name__ == "__main__":
    main()
