"""How fast the matrix products of one batch-10 MLP SGD step run on this machine.

One step of the bench's MLP (784 -> 200 -> 10) at batch 10 costs two large products, the forward
``[10, 784] x [784, 200]`` and the weight gradient ``[784, 10] x [10, 200]``; this times only
those, in a TorchScript loop over a round's worth of steps (1,200: 20 clients of about 60 steps),
beside the 2048 x 2048 product that ``pflego bench`` takes as the machine's peak, in the same
process. A fused round slower than these products alone is held back by everything else a step
does (the other operations and their dispatch), not by small products.

Usage::

    python benchmarks/small_products.py [--steps 1200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


@torch.jit.script
def products(x: torch.Tensor, w: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` times: the forward product and the weight update's product of one SGD step
    (the update in place, as a fused step does: it also keeps the compiler from hoisting the
    forward product out of the loop, which it does for a loop-invariant one)."""
    for _ in range(steps):
        h = torch.mm(x, w)
        w.addmm_(x.t(), h, alpha=-1e-6)
    return w


def fastest(work: Callable[[], object], tries: int = 5) -> float:
    """The least wall-clock seconds of ``tries`` calls."""
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(10, 784), torch.randn(784, 200)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    products(x, w, 10)  # compiles
    for _ in range(args.repeats):
        seconds = fastest(lambda: products(x, w, args.steps))
        small = args.steps * 2 * (2 * 10 * 784 * 200) / seconds / 1e9
        big = 2 * 2048**3 / fastest(lambda: a @ b) / 1e9
        print(
            f"{args.steps} steps' products: {seconds:.3f} s, {small:.1f} GFLOP/s; "
            f"2048^2 product: {big:.1f} GFLOP/s ({100 * small / big:.0f}% of it)"
        )


if __name__ == "__main__":
    main()
