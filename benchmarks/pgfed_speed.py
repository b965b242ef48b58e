"""PGFed paper, Table 7: local training speed (images per second) of each method relative to FedAvg,
measured here, with the bytes per round each method's sampled client receives and sends.

The paper's setting (Appendix C): CIFAR-10, 50 clients, batch 128, its CNN, SGD with momentum, on a
V100 GPU, 5 local epochs as in training (PGFed's one extra full-batch gradient per round costs
about one epoch: the fewer the epochs, the larger its share). Each method trains ``--warmup``
rounds untimed, then ``--rounds`` timed rounds; only the cohort's client updates are timed (the
backend call of the round loop), and the images are those the clients really processed (local
epochs x samples; on a GPU after waiting for its kernels). Methods whose local steps are plain
gradient steps (Per-FedAvg) take them without momentum. Traffic comes from
:func:`pflego.comm.round_traffic`.
Methods that are not registered are skipped and listed. Timings on a shared CPU are noisy: compare
the relative column, and rerun on an idle machine for absolute numbers.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/pgfed_speed.py --data-dir /work/shared/data
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from pflego.algorithms import ALGORITHMS
from pflego.bench.shared import timed
from pflego.comm import round_traffic
from pflego.config import load_config
from pflego.sim import Simulation, build_experiment

#: Table 7 (CIFAR-10, 50 clients, batch 128): images/s and accuracy on the authors' hardware.
PAPER = {
    "fedavg": (6917.1, 64.41),
    "apfl": (3389.8, 77.36),
    "perfedavg": (3464.5, 76.27),
    "fedrod": (6682.4, 79.61),
    "pgfed": (6120.0, 81.42),
    "pgfedmo": (6032.8, 81.48),
    "pgfed-ce": (6175.5, 81.16),
}


@dataclass
class TimedBackend:
    """Wraps a backend and adds up the seconds and images of the calls it times."""

    backend: object
    seconds: float = 0.0
    images: int = 0
    timing: bool = field(default=False)

    def __call__(self, algorithm, downlink, states, cohort, ctx):
        result, seconds = timed(lambda: self.backend(algorithm, downlink, states, cohort, ctx))
        if self.timing:
            self.seconds += seconds
            # Each real step sees its real batch entries: all the images the client processed.
            self.images += int(cohort.data.batch_mask.sum())
        return result


def measure(name: str, settings: dict, rounds: int, warmup: int = 1) -> dict:
    """Images per second of ``name``'s client updates and its traffic per sampled client."""
    if ALGORITHMS[name].client_step != "optimizer":  # Per-FedAvg: plain gradient steps
        settings = {**settings, "client_optimizer": "sgd"}
    sim = Simulation(build_experiment(load_config({**settings, "algorithm": name})), None)
    timed = TimedBackend(sim.backend)
    sim.backend = timed
    for t in range(warmup + rounds):
        timed.timing = t >= warmup
        sim.run_round(t)
    traffic = round_traffic(sim)
    return {
        "images_per_s": timed.images / timed.seconds,
        "down": traffic.down,
        "up": traffic.up,
    }


def table(results: dict[str, dict], baseline: str = "fedavg") -> str:
    """Markdown: ours beside the paper's, speeds and traffic relative to ``baseline`` (if measured)."""
    base = results.get(baseline)
    lines = [
        "| method | images/s (ours) | relative (ours) | relative (paper) | MB down | MB up "
        "| traffic vs FedAvg |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        paper = f"{100 * PAPER[name][0] / PAPER[baseline][0]:.2f}%" if name in PAPER else "—"
        speed, traffic = "—", "—"
        if base is not None:
            speed = f"{100 * r['images_per_s'] / base['images_per_s']:.2f}%"
            traffic = f"{(r['down'] + r['up']) / (base['down'] + base['up']):.2f}x"
        lines.append(
            f"| {name} | {r['images_per_s']:.1f} | {speed} | {paper} "
            f"| {r['down'] / 1e6:.3f} | {r['up'] / 1e6:.3f} | {traffic} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--model", default="pgfed-cnn")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--participation", type=float, default=0.25)
    parser.add_argument("--local-epochs", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds after the warm-up")
    parser.add_argument("--backend", default="loop", help="loop: one client at a time, as Table 7")
    parser.add_argument("--methods", default=",".join(PAPER))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    args = parser.parse_args(argv)

    from pflego.config import parse_overrides

    settings = {
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "model": args.model,
        "clients": args.clients,
        "partition": "dirichlet",
        "alpha": 0.3,
        "pool_test": True,
        "participation": args.participation,
        "batch_size": args.batch_size,
        "local_epochs": args.local_epochs,
        "client_optimizer": "momentum",
        "client_lr": 0.01,
        "backend": args.backend,
        **parse_overrides(args.overrides),
    }
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    missing = [m for m in methods if m not in ALGORITHMS]
    results = {
        m: measure(m, settings, args.rounds, args.warmup) for m in methods if m not in missing
    }
    report = table(results)
    if missing:
        report += f"\n\nnot registered, skipped: {', '.join(missing)}"
    print(report)
    return report


if __name__ == "__main__":
    main()
