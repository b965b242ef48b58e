"""What one client's training step can reach on a GPU: eager, channels-last, TF32, a CUDA graph of
the whole step, and ``torch.compile``, for the CNNs of the GPU run-book; and pflego's own round
of client updates through the loop, vmap and graph backends, and the vmap call captured by hand.

Each step variant trains a fresh copy of the same model (body + linear head, cross-entropy, plain
SGD) on a fixed batch: ``--warmup`` steps untimed, then ``--steps`` steps timed by CUDA events. The
table gives milliseconds per step, images per second, and the step's FLOPs (counted once by
``torch.utils.flop_counter``) over the time, against the float32 and TF32 matrix-product peaks
measured in the same run. It tells what the per-client path could gain from each, before any of
them goes into the library (issue 26: "CUDA graphs or torch.compile where they pay"). The round
table says whether a whole vmap round captures (every kernel on the device, no host sync) and
what replaying it saves; with ``--device cpu`` it times the two eager backends alone.

Usage (on a GPU machine, from the repository root)::

    PYTHONPATH=src python benchmarks/cuda_step.py --models pgfed-cnn mobilenet-v2 --batch 128
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pflego.config import load_config
from pflego.models import build_model
from pflego.sim import Simulation, build_experiment
from pflego.sim.backends import make_backend


def network(name: str, shape: tuple[int, ...], classes: int) -> nn.Module:
    """The architecture's body with a trainable linear head, as a plain module."""
    model = build_model(name, shape, classes, classes)
    body = copy.deepcopy(model.body)
    for p in body.parameters():
        p.requires_grad_(True)
    return nn.Sequential(body, nn.Linear(model.feature_dim, classes))


def step_function(net: nn.Module, lr: float) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One SGD step on (x, y), gradients set to None first, as a training loop does."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        optimizer.step()

    return step


def graphed(run: Callable[[], object]) -> Callable[[], None]:
    """``run`` captured once as a CUDA graph (on the tensors it closes over) and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def time_steps(run: Callable[[], object], warmup: int, steps: int, device: str = "cuda") -> float:
    """Milliseconds per call of ``run`` after ``warmup`` untimed calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        run()
    if device == "cpu":
        began = time.perf_counter()
        for _ in range(steps):
            run()
        return (time.perf_counter() - began) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def matmul_peak(tf32: bool, size: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of a float32 square product (TF32 tensor cores if ``tf32``)."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a, b = torch.randn(size, size, device="cuda"), torch.randn(size, size, device="cuda")
    ms = time_steps(lambda: a @ b, 3, repeats)
    torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * size**3 / ms / 1e9


def model_rows(
    name: str, batch: int, warmup: int, steps: int, compile_too: bool
) -> Iterator[tuple[str, float, float, str]]:
    """(variant, milliseconds per step, the step's FLOPs, note) for one architecture on
    CIFAR-sized inputs; a variant that fails gives NaN and the reason."""
    shape, classes = (3, 32, 32), 10
    torch.manual_seed(0)
    base = network(name, shape, classes).cuda()
    x = torch.randn(batch, *shape, device="cuda")
    y = torch.randint(classes, (batch,), device="cuda")
    x_cl = x.contiguous(memory_format=torch.channels_last)
    with FlopCounterMode(display=False) as counter:
        step_function(copy.deepcopy(base), 0.01)(x, y)
    flops = counter.get_total_flops()

    def eager(net: nn.Module, xs: torch.Tensor) -> Callable[[], None]:
        step = step_function(net, 0.01)
        return lambda: step(xs, y)

    variants = [
        ("eager", False, lambda: eager(copy.deepcopy(base), x)),
        ("eager + TF32", True, lambda: eager(copy.deepcopy(base), x)),
        (
            "channels-last + TF32",
            True,
            lambda: eager(copy.deepcopy(base).to(memory_format=torch.channels_last), x_cl),
        ),
        (
            "CUDA graph + TF32",
            True,
            lambda: graphed(partial(step_function(copy.deepcopy(base), 0.01), x, y)),
        ),
    ]
    if compile_too:
        variants.append(
            ("torch.compile + TF32", True, lambda: eager(torch.compile(copy.deepcopy(base)), x))
        )
    defaults = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    for label, allow_tf32, build in variants:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32
        try:
            began = time.perf_counter()
            run = build()
            run()  # the first step compiles or captures
            torch.cuda.synchronize()
            setup = time.perf_counter() - began
            ms = time_steps(run, warmup, steps)
        except Exception as exc:  # a variant that fails is reported, not fatal
            ms, note = math.nan, f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        else:
            note = f"first step {setup:.0f} s" if setup > 2 else ""
        finally:  # pflego's rounds, timed next, run with torch's own settings
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = defaults
        yield label, ms, flops, note


def round_rows(
    algorithm: str, model: str, clients: int, batch: int, device: str, warmup: int, steps: int
) -> Iterator[tuple[str, float, str]]:
    """(variant, milliseconds, note) of one round's client updates in pflego itself: ``clients``
    clients of the built-in mnist5k, all in the cohort, one local epoch of batch ``batch``,
    through the loop, vmap and graph backends (the library's CUDA graphs on a GPU, static shapes
    run eagerly on a CPU), and (on a GPU) the vmap call captured as a CUDA graph by hand.
    The same round's inputs are trained again at every call: only its speed is measured."""
    settings = {
        "dataset": "mnist5k",
        "clients": clients,
        "participation": 1.0,
        "classes_per_client": 2,
        "model": model,
        "algorithm": algorithm,
        "batch_size": batch,
        "local_epochs": 1.0,
        "device": device,
        "backend": "vmap",
    }
    sim = Simulation(build_experiment(load_config(settings)), None)
    ctx = sim.context(0)
    cohort = np.asarray(sim.cohort(0), dtype=np.int64)
    downlink = sim.downlink(ctx, cohort)
    states = sim.states(cohort, downlink, ctx)
    inputs = sim.round_inputs(0, cohort)

    def eager(backend: str) -> Callable[[], object]:
        run = make_backend(backend, sim.algorithm)
        return lambda: run(sim.algorithm, downlink, states, inputs, ctx)

    variants = [
        ("loop", lambda: eager("loop")),
        ("vmap", lambda: eager("vmap")),
        ("graph backend", lambda: eager("graph")),
    ]
    if device != "cpu":
        variants.append(("vmap as a CUDA graph (by hand)", lambda: graphed(eager("vmap"))))
    for label, build in variants:
        try:
            began = time.perf_counter()
            run = build()
            run()  # the first call captures
            if device != "cpu":
                torch.cuda.synchronize()
            setup = time.perf_counter() - began
            ms = time_steps(run, warmup, steps, device)
        except Exception as exc:  # a variant that fails is reported, not fatal
            yield label, math.nan, f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        yield label, ms, (f"first call {setup:.1f} s" if setup > 2 else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["pgfed-cnn", "mobilenet-v2"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument(
        "--rounds-of",
        nargs="*",
        default=["fedavg", "pgfed"],
        help="algorithms whose pflego round (pgfed-cnn, 20 clients, batch 10) is timed too",
    )
    parser.add_argument("--device", default="cuda", help="cuda (all) or cpu (pflego's rounds)")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        one_step_table(args)
    if args.rounds_of:
        print(
            f"\npflego's round, {args.device}: pgfed-cnn on mnist5k, 20 clients (all), batch 10, "
            "one local epoch; ms per round's client updates (3 untimed, then 5 timed)\n"
        )
        print("| algorithm | variant | ms per round | note |")
        print("|---|---|---:|---|")
        for algorithm in args.rounds_of:
            for label, ms, note in round_rows(algorithm, "pgfed-cnn", 20, 10, args.device, 3, 5):
                print(f"| {algorithm} | {label} | {ms:.1f} | {note} |", flush=True)


def one_step_table(args: argparse.Namespace) -> None:
    """The table of one client's step, variant by variant, against the measured peaks."""
    fp32, tf32 = matmul_peak(False), matmul_peak(True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}")
    print(f"matmul peak: float32 {fp32:.1f} TFLOP/s, TF32 {tf32:.1f} TFLOP/s\n")
    print("| model | variant | ms/step | images/s | TFLOP/s | % fp32 peak | % TF32 peak | note |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        rows = model_rows(name, args.batch, args.warmup, args.steps, not args.no_compile)
        for label, ms, flops, note in rows:
            speed = flops / ms / 1e9
            print(
                f"| {name} | {label} | {ms:.2f} | {args.batch / ms * 1e3:,.0f} | {speed:.2f} | "
                f"{100 * speed / fp32:.0f} | {100 * speed / tf32:.0f} | {note} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
