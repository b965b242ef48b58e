"""The one local training loop, shared by every algorithm.

A loss is any function ``loss_fn(params, x, y, mask)``; ``train_steps`` differentiates it with
``torch.func``. An :class:`~pflego.loss.Objective` is such a function that also says what it
computes (a model's terms, each with its fused form), so that outside vmap, inside
:func:`fused_steps`, plain SGD on it runs as fused steps without autograd
(:mod:`pflego.fused`): the same numbers up to rounding, several times faster for small batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego.fused import fused_sgd_steps
from pflego.fused_bilevel import fused_program
from pflego.loss import Objective
from pflego.optim import Optimizer, OptState
from pflego.program import Outcome, Step, autograd_program
from pflego.tree import Params
from pflego.types import ClientData

T = TypeVar("T")

LossFn = Callable[[Params, Tensor, Tensor, Tensor], Tensor]


@dataclass
class StepCounts:
    """How many ``train_steps`` calls inside :func:`fused_steps` ran fused, and how many not."""

    fused: int = 0
    autograd: int = 0


_fusion = threading.local()


@contextmanager
def fused_steps(enabled: bool = True) -> Iterator[StepCounts]:
    """Within the block (this thread only), SGD on an :class:`~pflego.loss.Objective` runs as fused steps.

    Yields the block's :class:`StepCounts`.
    """
    previous = getattr(_fusion, "counts", None)
    counts = StepCounts()
    _fusion.counts = counts if enabled else None
    try:
        yield counts
    finally:
        _fusion.counts = previous


def fused_or_none(run: Callable[[], T | None]) -> T | None:
    """``run()`` (a fused computation, ``None`` where it does not apply) inside
    :func:`fused_steps`, counted there as fused or, on ``None``, as autograd; outside the block,
    ``None`` without running it."""
    counts = getattr(_fusion, "counts", None)
    if counts is None:
        return None
    result = run()
    if result is None:
        counts.autograd += 1
    else:
        counts.fused += 1
    return result


def unfused() -> None:
    """Inside :func:`fused_steps`, count a computation that has no fused form as autograd."""
    fused_or_none(lambda: None)


def run_program(
    loss_fn: LossFn,
    points: Sequence[Params],
    data: ClientData,
    steps: Sequence[Step],
    optimizer: Optimizer | None = None,
    opt_state: OptState | None = None,
) -> Outcome:
    """A step program (:mod:`pflego.program`) on ``points`` (with ``optimizer``'s updates from
    ``opt_state``, see :func:`~pflego.program.autograd_program`): inside :func:`fused_steps`, by
    the fused kernel where it applies (:func:`~pflego.fused_bilevel.fused_program`), else by
    autograd (:func:`~pflego.program.autograd_program`, the reference)."""
    fused = fused_or_none(lambda: fused_program(loss_fn, points, data, steps, optimizer, opt_state))
    if fused is not None:
        return fused
    return autograd_program(loss_fn, points, data, steps, optimizer, opt_state)


def train_steps(
    loss_fn: LossFn,
    params: Params,
    data: ClientData,
    optimizer: Optimizer,
    opt_state: OptState,
    lr: float | Tensor,
    steps: slice = slice(None),
) -> tuple[Params, OptState, Tensor]:
    """Run the local steps ``data.batches[steps]``, one optimizer update per step.

    A step whose batch is all padding leaves parameters and optimizer state unchanged, which makes
    ragged clients exact under vmap.

    Args:
        loss_fn: ``loss_fn(params, x, y, mask)`` for one minibatch (an :class:`~pflego.loss.Objective` may run
            as fused steps, see :func:`fused_steps`).
        params: The parameters being trained; anything fixed is closed over by ``loss_fn``.
        data: The client's data and minibatch schedule.
        optimizer: A functional optimizer.
        opt_state: Its state.
        lr: Step size.
        steps: Which rows of the schedule to run.

    Returns:
        Trained parameters, optimizer state, and the mean loss over the real steps.
    """
    fused = fused_or_none(lambda: fused_sgd_steps(loss_fn, params, data, optimizer, lr, steps))
    if fused is not None:
        return fused[0], opt_state, fused[1]
    step_and_loss = grad_and_value(loss_fn)
    # A schedule as wide as the local set is full batch: its rows are arange(n) wherever the mask
    # is 1, so the whole (padded) set is used as is instead of being gathered every step.
    whole_set = data.batches.shape[-1] == data.x.shape[0]
    per_sample = isinstance(loss_fn, Objective) and loss_fn.per_sample
    total, count = torch.zeros(()), torch.zeros(())
    for idx, bmask in zip(data.batches[steps], data.batch_mask[steps]):
        x, y = (data.x, data.y) if whole_set else (data.x[idx], data.y[idx])
        if per_sample and not whole_set:  # the batch's own sample weights
            step_and_loss = grad_and_value(loss_fn.on_samples(idx))
        active = bmask.sum() > 0
        grads, loss = step_and_loss(params, x, y, bmask)
        params, opt_state = optimizer.masked_update(params, grads, opt_state, lr, active)
        total = total + torch.where(active, loss.detach(), 0.0)
        count = count + active.to(count.dtype)
    return params, opt_state, total / count.clamp(min=1)
