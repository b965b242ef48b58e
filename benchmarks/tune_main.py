"""Learning-rate grid for the main experiment, the same effort for every method.

Each method gets one step-size knob over the same grid (FedAvg / FedPer: the client step; PFLEGO:
beta = rho tied). Tuned on seed 1, so the reported numbers (seed 0) are not selected on their own
test data. Usage: python benchmarks/tune_main.py [--rounds 100] [--out runs/tune]
"""

from __future__ import annotations

import argparse

from pflego.experiments.presets import load_preset
from pflego.sim import run

GRID = [0.01, 0.03, 0.1, 0.3, 1.0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--out", default="runs/tune")
    parser.add_argument("--algorithms", default="pflego,fedavg,fedper")
    parser.add_argument(
        "--grid", default=",".join(map(str, GRID)), help="comma-separated step sizes"
    )
    args = parser.parse_args()
    settings = {**load_preset("main").settings, "seed": 1, "rounds": args.rounds}
    print("| algorithm | step size | test acc (%) | training loss |")
    print("|---|---:|---:|---:|")
    for name in args.algorithms.split(","):
        for lr in [float(v) for v in args.grid.split(",")]:
            lrs = {"client_lr": lr, "server_lr": lr if name == "pflego" else None}
            h = run(
                {**settings, "algorithm": name, **lrs},
                out=f"{args.out}/{name}-{lr}",
                progress=False,
            )
            m = h.final(settings["average_last"])
            print(
                f"| {name} | {lr} | {100 * m['test_acc']:.2f} | {m['train_loss']:.4f} |", flush=True
            )


if __name__ == "__main__":
    main()
