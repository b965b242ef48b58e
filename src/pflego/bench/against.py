"""``pflego bench --against conventional``: pflego beside the conventional way of running rounds,
``benchmarks/conventional.py`` of a source checkout (the section's text says what each side does
and how it is measured).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from pflego import tree
from pflego.algorithms import ALGORITHMS as REGISTRY
from pflego.bench.fresh_process import PACKAGE_PARENT
from pflego.bench.shared import markdown, pick_dataset, time_round, timed
from pflego.config import load_config
from pflego.data import load_dataset
from pflego.errors import ConfigError
from pflego.models import ARCHITECTURES
from pflego.sim import Experiment, Simulation, experiment_on, partition

AGAINST_MODELS = ("mlp", "pgfed-cnn")
AGAINST_ALGORITHMS = ("fedavg", "fedper", "ditto", "pfedme", "apfl", "pgfed")

#: Issue 26's targets: training speed-up by model and algorithm (``None``: any algorithm).
TRAIN_TARGETS = {
    ("mlp", "fedavg"): 5.0,
    ("mlp", "fedper"): 5.0,
    **{("mlp", name): 3.0 for name in ("ditto", "apfl", "pfedme", "pgfed")},
    ("pgfed-cnn", None): 2.0,
}
EVAL_TARGET = 5.0
PEAK_TARGETS = {("mlp", "fedavg"): 40.0, ("mlp", "fedper"): 40.0}


def targets(
    model: str, algorithm: str, measured: dict[str, float], ceilings: dict[str, float]
) -> str:
    """The row's targets beside what it measured, each ✓ or ✗ (NaN, not measured: ✗); a missed
    speed-up target above its ceiling (the conventional run's FLOPs at the matmul peak) says so:
    by that estimate, no implementation of the same arithmetic would meet it on this machine."""
    train_goal = TRAIN_TARGETS.get((model, algorithm), TRAIN_TARGETS.get((model, None), 1.0))
    checks = [("train", train_goal, "x"), ("eval", EVAL_TARGET, "x")]
    if (model, algorithm) in PEAK_TARGETS:
        checks.append(("peak", PEAK_TARGETS[model, algorithm], "%"))
    marks = []
    for what, goal, unit in checks:
        mark = "✓" if measured[what] >= goal else "✗"
        if mark == "✗" and ceilings.get(what, math.inf) < goal:
            mark += " (ceiling)"
        marks.append(f"{what} ≥{goal:g}{unit} {mark}")
    return ", ".join(marks)


AGAINST_HEADER = [
    "model",
    "algorithm",
    "backend",
    "train s/round conv.",
    "pflego",
    "speed-up",
    "ceiling",
    "eval s conv.",
    "pflego",
    "speed-up",
    "ceiling",
    "test acc conv.",
    "pflego",
    "GFLOP train/eval",
    "peak GFLOP/s",
    "% of peak conv./pflego",
    "targets (issue 26)",
]


def conventional_module() -> Any:
    """``benchmarks/conventional.py`` of the source checkout this pflego runs from."""
    path = PACKAGE_PARENT.parent / "benchmarks" / "conventional.py"
    if not path.is_file():
        raise ConfigError(
            f"--against conventional needs {path} (benchmarks/ of a source checkout; it is not "
            "installed with the package): run pflego from a clone of the repository"
        )
    spec = importlib.util.spec_from_file_location("pflego_conventional_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def matmul_peak(device: str = "cpu", repeats: int = 5) -> float:
    """GFLOP/s of the best of ``repeats`` float32 square matrix products on ``device`` (2048 x
    2048 on a CPU, 8192 x 8192 on a GPU)."""
    size = 2048 if torch.device(device).type == "cpu" else 8192
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    best = min(timed(lambda: a @ b)[1] for _ in range(repeats + 1))  # the first: a warm-up
    return 2 * size**3 / best / 1e9


def conventional_model(conventional: Any, sim: Simulation) -> torch.nn.Module:
    """The conventional model, starting from the pflego run's initial shared parameters; what
    those lack (FedPer's head, which pflego keeps per client) is initialized from the run's seed,
    not from wherever the global generator stands after the rows before."""
    model = sim.algorithm.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sim.cfg.seed)
        net = conventional.split_module(model.body, model.feature_dim, model.num_classes)
    start = tree.to(sim.server["params"], "cpu")
    state = net.state_dict()
    state.update({k: v for k, v in start.items() if k in state and v.shape == state[k].shape})
    net.load_state_dict(state)
    return net.to(sim.exp.dtype)


def against_row(
    conventional: Any, base: Experiment, model: str, algorithm: str, rounds: int
) -> list[str]:
    """One comparison: both run ``rounds`` rounds of the same cohorts, then evaluate (pflego
    alone where ``benchmarks/conventional.py`` has no such algorithm). The matmul peak is the
    better of one measured before and one after the row: on a shared machine the load, and so
    what one thread gets, changes between rows."""
    device = base.config.device
    before = matmul_peak(device)
    cfg = base.config.replace(algorithm=algorithm, model=model)
    sim = Simulation(experiment_on(cfg, base.data), None)
    runner = None
    if algorithm in conventional.ALGORITHMS:
        options = {k: getattr(sim.algorithm, k) for k in conventional.DEFAULTS.get(algorithm, {})}
        runner = conventional.ConventionalFL(
            algorithm,
            conventional_model(conventional, sim),
            conventional.client_splits(base.data),
            batch_size=cfg.batch_size,
            epochs=math.ceil(cfg.local_epochs or 1),
            lr=cfg.client_lr,
            options=options,
            seed=cfg.seed,
            device=cfg.device,
        )
    cohorts = [sim.cohort(t) for t in range(rounds)]
    with FlopCounterMode(display=False) as counter:  # round 0 also warms both up (and probes)
        if runner is not None:
            runner.train_round(0, cohorts[0])
        else:
            sim.run_round(0)
    if runner is not None:
        sim.run_round(0)
    conv_s, ours = [], []
    for t in range(1, rounds):  # interleaved: a change in the machine's load falls on both sides
        if runner is not None:
            conv_s += conventional.time_rounds(runner, cohorts[t : t + 1], first_round=t)
        ours.append(time_round(sim, t))
    # pflego's own round 0 would count its probe and vmap's padding: no FLOPs without the other
    train_conv = conv_eval_s = conv_acc = flops = eval_flops = math.nan
    if runner is not None:
        conv_eval, conv_eval_s = timed(runner.evaluate)
    record, eval_s = timed(lambda: sim.evaluate(rounds))
    if runner is not None:
        with FlopCounterMode(display=False) as eval_counter:  # counted apart from its timing
            runner.evaluate()
        train_conv, conv_acc = float(np.median(conv_s)), 100 * conv_eval["test_acc"]
        flops, eval_flops = counter.get_total_flops(), eval_counter.get_total_flops()
    peak = max(before, matmul_peak(device))
    train_ours = float(np.median(ours))
    at_peak = lambda count: count / 1e9 / peak if count else math.nan  # noqa: E731  seconds
    percent = 100 * at_peak(flops) / train_ours
    measured = {
        "train": train_conv / train_ours,
        "eval": conv_eval_s / eval_s,
        "peak": percent,
    }
    ceilings = {"train": train_conv / at_peak(flops), "eval": conv_eval_s / at_peak(eval_flops)}
    cell = lambda value, fmt: "—" if math.isnan(value) else format(value, fmt)  # noqa: E731
    ratio = lambda value: cell(value, ".1f") + ("" if math.isnan(value) else "x")  # noqa: E731
    share = lambda value: cell(value, ".0f") + ("" if math.isnan(value) else "%")  # noqa: E731
    return [
        model,
        algorithm,
        sim.backend_name,
        cell(train_conv, ".3f"),
        f"{train_ours:.3f}",
        ratio(measured["train"]),
        ratio(ceilings["train"]),
        cell(conv_eval_s, ".2f"),
        f"{eval_s:.2f}",
        ratio(measured["eval"]),
        ratio(ceilings["eval"]),
        cell(conv_acc, ".2f"),
        f"{100 * record['test_acc']:.2f}",
        f"{cell(flops / 1e9, '.1f')}/{cell(eval_flops / 1e9, '.1f')}",
        f"{peak:.0f}",
        f"{share(100 * at_peak(flops) / train_conv)}/{share(percent)}",
        targets(model, algorithm, measured, ceilings),
    ]


def against_section(
    data_dir: str | None,
    clients: int,
    participation: float,
    rounds: int,
    models: Sequence[str] = AGAINST_MODELS,
    algorithms: Sequence[str] = AGAINST_ALGORITHMS,
    device: str = "cpu",
) -> list[str]:
    """The Markdown of the comparison with the conventional way (batch 10, one local epoch, lr
    0.01, seed 0), run on ``device``; a model or algorithm not registered here is skipped."""
    conventional = conventional_module()
    # float32 everywhere, as the peak: cuDNN would run the convolutions in TF32 by default
    torch.backends.cudnn.allow_tf32 = False
    settings = {
        "dataset": pick_dataset(data_dir),
        "data_dir": data_dir,
        "clients": clients,
        "participation": participation,
        "classes_per_client": 2,
        "batch_size": 10,
        "local_epochs": 1.0,
        "client_lr": 0.01,
        "rounds": rounds,
        "seed": 0,
        "algorithm": "fedavg",
        "device": device,
    }
    cfg = load_config(settings)
    raw = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    base = Experiment(cfg, partition(raw, cfg), None)
    rows, notes = [], []
    for model in models:
        if model not in ARCHITECTURES:
            notes.append(f"model {model} is not registered here: skipped")
            continue
        for name in algorithms:
            if name not in REGISTRY:
                notes.append(f"{name} is not registered here: skipped")
                continue
            row, seconds = timed(partial(against_row, conventional, base, model, name, rounds))
            rows.append(row)
            # the table comes at the end: each row as it finishes shows where a long run is
            print(
                f"pflego: bench against: {model} {name} in {seconds:.0f} s (train s/round "
                f"conventional {row[3]}, pflego {row[4]}, {row[5]})",
                file=sys.stderr,
                flush=True,
            )
    where = f"{torch.get_num_threads()} thread(s)"
    if torch.device(device).type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} ({device})"
    return [
        "## pflego against the conventional way (benchmarks/conventional.py)",
        "",
        f"{cfg.dataset}, {clients} clients with 2 classes each, {participation:.0%} "
        "per round, batch 10, one local epoch, lr 0.01, the same split, seed, cohorts and initial "
        f"model on both sides; {where}, torch {torch.__version__}. "
        f"Training: median of {rounds - 1} round(s) after a warm-up round, the two sides' rounds "
        "taken in turn; evaluation: every client's training and test splits, one side's right "
        f"after the other's; accuracy after {rounds} rounds. GFLOP: the "
        "conventional round's and evaluation's matrix products and convolutions (torch's FLOP "
        "counter; — where benchmarks/conventional.py lacks the algorithm); peak: the float32 "
        "matmul peak of this machine during the row (the better of a 2048² product's speed, "
        "8192² on a GPU, before and after it); % of peak: those FLOPs over each side's seconds "
        "and that peak; ceiling: the speed-up of doing the conventional FLOPs at that peak, an "
        "estimate of the most an implementation of the same arithmetic reaches here (a "
        "convolution or a small product may run faster or slower than the square product, and "
        "a side that does less arithmetic can pass it); a target marked (ceiling) lies above "
        "it. backend: what "
        "`--backend auto` picked (measured on the first round, src/pflego/sim/backends_auto.py).",
        "",
        markdown(AGAINST_HEADER, rows),
        *(["", *(f"- {n}" for n in notes)] if notes else []),
        "",
    ]
