"""Issue 37's round targets in one call: pflego's training round by backend (``graph``: CUDA
graphs of static shapes; ``vmap``: the eager vectorized round) in the ``pgfed-cifar10`` preset's
block 25 (6 clients a round, 5 epochs of batch 10, the PGFed CNN, momentum SGD), with its speed
against the float32 matmul peak measured in the same call, and the whole block's hours.

Each algorithm and backend builds the same run (seed, split, cohorts), trains round 0 untimed
(the graph backend captures there) and then ``--rounds`` timed rounds (whole rounds: client
updates, server step and store, after waiting for the GPU), then one evaluation. FLOPs: one local
step of every cohort client counted by torch's FLOP counter (the loop backend on one step each),
times the real steps of the round (PGFed's full-batch gradient is left out: its FLOPs are a
lower bound). The block estimate takes the mean of the measured methods' rounds for each of its
15 rows, 300 rounds, an evaluation every 5.

Usage (from the repository root; CIFAR-10's python files under DIR/cifar-10-batches-py)::

    PYTHONPATH=src python benchmarks/graph_round.py --data-dir DIR --device cuda --out targets.md
    PYTHONPATH=src python benchmarks/graph_round.py --device cpu --set dataset=mnist5k \\
        --set local_epochs=0.1 --rounds 1       # the same table, small, on a CPU
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from pflego.bench.against import matmul_peak
from pflego.bench.shared import markdown, timed
from pflego.config import load_config
from pflego.experiments.presets import load_preset
from pflego.sim import Simulation, build_experiment
from pflego.sim.backends import loop_backend
from pflego.sim.backends_auto import truncated

#: Issue 37's targets: seconds a training round, and FedAvg's share of the fp32 peak.
ROUND_TARGETS = {"fedavg": 0.5, "pgfed": 0.8}
PEAK_TARGET = 10.0
BLOCK_TARGET_MINUTES = 30.0


def round_flops(sim: Simulation) -> float:
    """FLOPs of round 1's local steps: one step of each cohort client, counted, times its steps."""
    ctx, cohort = sim.context(1), sim.cohort(1)
    downlink = sim.downlink(ctx, cohort)
    states = sim.states(cohort, downlink, ctx)
    inputs = sim.round_inputs(1, cohort)
    with FlopCounterMode(display=False) as counter:
        loop_backend(sim.algorithm, downlink, states, truncated(inputs, 1), ctx)
    return counter.get_total_flops() / len(cohort) * float(inputs.steps.mean() * len(cohort))


def measure(settings: dict, rounds: int) -> dict[str, float]:
    """One run's seconds a round (median of ``rounds`` after round 0), its first round (the
    capture) and one evaluation's seconds."""
    sim = Simulation(build_experiment(load_config(settings)), None)
    _, first = timed(lambda: sim.run_round(0))
    seconds = [timed(lambda t=t: sim.run_round(t))[1] for t in range(1, rounds + 1)]
    _, evaluation = timed(lambda: sim.evaluate(rounds + 1))
    fallbacks = getattr(getattr(sim.backend, "graphs", None), "fallbacks", {})
    return {
        "round": float(np.median(seconds)),
        "first": first,
        "evaluation": evaluation,
        "backend": sim.backend_name + (" (fell back to vmap)" if fallbacks else ""),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "pgfed"])
    parser.add_argument("--backends", nargs="+", default=["graph", "vmap"])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after round 0")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE setting override")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    overrides = {"device": args.device, "data_dir": args.data_dir, "eval_every": 1}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    preset = load_preset("pgfed-cifar10")
    peak = matmul_peak(args.device) / 1e3  # TFLOP/s
    rows, rounds_by_backend, evals = [], {}, []
    for name in args.algorithms:
        base = preset.run_settings("25", name, overrides=overrides)
        flops = round_flops(Simulation(build_experiment(load_config(base)), None))
        for backend in args.backends:
            got = measure(base | {"backend": backend}, args.rounds)
            speed = flops / got["round"] / 1e12
            target = ROUND_TARGETS.get(name)
            mark = "" if target is None else (" ✓" if got["round"] <= target else " ✗")
            rows.append(
                [
                    name,
                    got["backend"],
                    f"{got['round']:.3f}" + (f" (≤{target}{mark})" if target else ""),
                    f"{got['first']:.1f}",
                    f"{flops / 1e9:.1f}",
                    f"{speed:.3f}",
                    f"{100 * speed / peak:.1f}",
                    f"{got['evaluation']:.2f}",
                ]
            )
            rounds_by_backend.setdefault(backend, []).append(got["round"])
            evals.append(got["evaluation"])
            print(f"graph_round: {name} {backend}: {got}", file=sys.stderr, flush=True)
    header = [
        "algorithm",
        "backend",
        "train s/round",
        "round 0 s (capture)",
        "GFLOP a round",
        "TFLOP/s",
        "% fp32 peak",
        "eval s",
    ]
    evaluations = 15 * math.ceil(300 / 5) * float(np.mean(evals))
    block = {
        b: (15 * 300 * float(np.mean(s)) + evaluations) / 60 for b, s in rounds_by_backend.items()
    }
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    text = "\n".join(
        [
            f"## pgfed-cifar10 block 25, by backend ({device}, torch {torch.__version__}, "
            f"fp32 matmul peak {peak:.2f} TFLOP/s; settings {overrides})",
            "",
            markdown(header, rows),
            "",
            f"Targets: FedAvg ≤ {ROUND_TARGETS['fedavg']} s a round at ≥ {PEAK_TARGET:g}% of the "
            f"peak, PGFed ≤ {ROUND_TARGETS['pgfed']} s; the block (15 rows × 300 rounds, an "
            f"evaluation every 5) ≤ {BLOCK_TARGET_MINUTES:g} min: estimated "
            + ", ".join(f"{b} {m:.0f} min" for b, m in block.items())
            + ".",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
