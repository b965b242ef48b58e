"""The CNN's local update and evaluation, each way, timed interleaved in one process.

Training: one client's local epoch (batch 10) of a CNN three ways: the conventional loop
(``benchmarks/conventional.py``'s: a deep-copied module, a ``DataLoader``, ``torch.optim.SGD``
and ``loss.backward()``), pflego's fused steps as they run (activations channels-last), and the
same fused steps with the inputs left ``NCHW`` (what they did before). Evaluation: the body's
forward pass over a pool's rows in one pass, channels-last (as ``apply_layers`` now runs it) and
``NCHW``; and per-client bodies over their clients' rows under ``vmap`` (Ditto's, pFedMe's
personal models), client by client (as ``apply_layers`` now runs them) and by vmap's own rule. Each timing is this thread's CPU time (``time.thread_time``, one torch thread), so
other processes on a shared machine preempting this one do not count; the table gives medians
over the repetitions and the ratios.

Usage (from a source checkout):

    PYTHONPATH=src python benchmarks/cnn_speed.py --model pgfed-cnn --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.func import vmap
from torch.utils.data import DataLoader, TensorDataset

import pflego.fused
import pflego.models.layers
from pflego.fused import fused_sgd_steps
from pflego.loss import Objective
from pflego.models import apply_layers, build_model, init_head
from pflego.optim import SGD
from pflego.sim.clients import schedule
from pflego.types import ClientData

INPUT_SHAPES = {"pgfed-cnn": (1, 28, 28), "femnist-cnn": (1, 28, 28), "cifar-cnn": (3, 32, 32)}


def cpu_seconds(work: Callable[[], object]) -> float:
    start = time.thread_time()
    work()
    return time.thread_time() - start


def conventional_epoch(net: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    """One client's epoch as ``benchmarks/conventional.py`` runs it."""
    local = copy.deepcopy(net)
    optimizer = torch.optim.SGD(local.parameters(), lr=lr)
    loss = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(0)
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True, generator=generator):
        optimizer.zero_grad()
        loss(local(xb), yb).backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pgfed-cnn", choices=sorted(INPUT_SHAPES))
    parser.add_argument("--samples", type=int, default=300, help="one client's training samples")
    parser.add_argument("--eval-rows", type=int, default=320, help="about one evaluation pass")
    parser.add_argument("--clients", type=int, default=8, help="per-client bodies under vmap")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = INPUT_SHAPES[args.model]
    model = build_model(args.model, shape, 10, 10)
    params = model.init_body(0) | init_head(10, model.feature_dim, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    n = args.samples
    x, y = torch.randn((n, *shape), generator=gen), torch.randint(0, 10, (n,), generator=gen)
    batches, mask = schedule(n, n // 10, 10, 1.0, np.random.default_rng(0))
    data = ClientData(x, y, torch.ones(n), batches, mask.float(), torch.ones(10), torch.tensor(n))
    loss = Objective(model, data.label_mask)
    head = nn.Linear(model.feature_dim, 10)
    net = nn.Sequential(OrderedDict(body=copy.deepcopy(model.body), head=head))
    net.load_state_dict(params)
    net.requires_grad_(True)
    rows = torch.randn((args.eval_rows, *shape), generator=gen)
    body = {k: v for k, v in params.items() if k.startswith("body.")}
    keep_layout, keep_stored = pflego.fused.channels_last, pflego.models.layers._as_channels_last
    keep_per_element = pflego.models.layers._per_element
    bodies = [model.init_body(seed) for seed in range(args.clients)]
    stacked = {k: torch.stack([b[k] for b in bodies]) for k in body}
    client_rows = rows[: len(rows) // args.clients * args.clients].unflatten(0, (args.clients, -1))

    def nchw(work: Callable[[], object]) -> Callable[[], object]:
        """``work`` with the channels-last conversions switched off."""

        def run() -> object:
            pflego.fused.channels_last = lambda t: t
            pflego.models.layers._as_channels_last = lambda t: t
            try:
                return work()
            finally:
                pflego.fused.channels_last = keep_layout
                pflego.models.layers._as_channels_last = keep_stored

        return run

    @torch.no_grad()
    def per_client() -> torch.Tensor:
        return vmap(lambda p, xb: apply_layers(model.layers, p, xb))(stacked, client_rows)

    def vmap_rule() -> torch.Tensor:
        pflego.models.layers._per_element = lambda *a: False
        try:
            return per_client()
        finally:
            pflego.models.layers._per_element = keep_per_element

    fused = lambda: fused_sgd_steps(loss, params, data, SGD(), 0.01)  # noqa: E731

    @torch.no_grad()
    def evaluate() -> torch.Tensor:
        return apply_layers(model.layers, body, rows)

    cases = {
        "train: conventional": lambda: conventional_epoch(net, x, y, 0.01),
        "train: fused, NCHW": nchw(fused),
        "train: fused, channels-last": fused,
        "evaluate: NCHW": nchw(evaluate),
        "evaluate: channels-last": evaluate,
        "evaluate per client: vmap rule": vmap_rule,
        "evaluate per client: one by one": per_client,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, work in cases.items():
            times[name].append(cpu_seconds(work))
    median = {name: float(np.median(t[1:])) for name, t in times.items()}
    print(f"{args.model}, {n} samples, batch 10; {args.eval_rows} evaluation rows; CPU s")
    for name, value in median.items():
        print(f"  {name:34s} {value:8.3f}")
    ratios = {
        "fused NCHW / fused channels-last": ("train: fused, NCHW", "train: fused, channels-last"),
        "conventional / fused channels-last": (
            "train: conventional",
            "train: fused, channels-last",
        ),
        "evaluation NCHW / channels-last": ("evaluate: NCHW", "evaluate: channels-last"),
        "per-client evaluation vmap rule / one by one": (
            "evaluate per client: vmap rule",
            "evaluate per client: one by one",
        ),
    }
    for label, (slow, fast) in ratios.items():
        print(f"  {label}: {median[slow] / median[fast]:.2f}x")


if __name__ == "__main__":
    main()
