"""Multi-stage local steps as one step program: the declaration and its autograd interpreter.

Some methods' local step is more than one gradient step on one point: APFL steps the global copy w
at w and its own model v at the mixture ``w + alpha (v - w)``; Per-FedAvg's meta-step steps a
copy w' of w and then w with the gradient at w'; FedAS records the squared norm of each batch's
gradient; pFedMe's personal steps pull theta toward an anchor that itself moves after every K of
them; PGFed sums the points its steps start from. Such a step is written once, as a sequence of
:class:`Step` on a few *points* (parameter dicts keyed alike), and run by an interpreter:
:func:`autograd_program` here (the reference, ``torch.func`` gradients, vmappable) or the fused
CPU kernel (:func:`pflego.fused_bilevel.fused_program`); :func:`pflego.local.run_program` picks
one.

A step first applies its ``mixes``, then takes the loss's gradient ``g`` at point ``at`` on the
minibatch of schedule row ``row``, adds its ``pulls`` in closed form (``g += c point[k]``: a
proximal term's ``lam (theta - anchor)``, a linear term) and updates point ``into`` by ``into <-
shrink into - lr g`` or, with an optimizer, by the optimizer's update (momentum, Adam: a state
per updated point, carried from step to step), then applies its ``after`` mixes. A mix is
``(dst, start, end, weight)``, ``point[dst] <- point[start] + weight (point[end] -
point[start])`` (mixtures of points, and copies with weight 0), or ``(dst, src, weight)``,
``point[dst] <- point[dst] + weight point[src]`` (sums). A point given as ``None`` is scratch (APFL's mixture): a mix writes it
before a step reads it, and it comes back as ``None``. The schedule is the client's whole
one (static shapes, no host synchronization in the reference): a step whose row, or one of its
``gate`` rows, is empty changes nothing (its mixes included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego import tree
from pflego.optim import Optimizer, OptState
from pflego.tree import Params
from pflego.types import ClientData

#: A step size or mixing weight: a number, or a scalar tensor (per client under vmap).
Weight = float | Tensor

#: ``(dst, start, end, weight)``: ``point[dst] <- point[start] + weight (point[end] -
#: point[start])`` (weight 0: a copy of ``point[start]``); or ``(dst, src, weight)``:
#: ``point[dst] <- point[dst] + weight point[src]``.
Mix = tuple[int, int, int, Weight] | tuple[int, int, Weight]


@dataclass(frozen=True)
class Step:
    """One gradient step of a program (see the module's docstring).

    Attributes:
        at: The point the gradient is taken at.
        into: The point it updates, ``into <- shrink into - lr g`` (or the optimizer's update).
        lr: The step size.
        shrink: The factor on ``into`` (weight decay: ``1 - lr decay``; 1 with an optimizer,
            whose own weight decay applies).
        row: The row of the client's schedule (``data.batches``) whose minibatch it uses.
        mixes: What happens to the points before the gradient is taken.
        record: Whether to record ``||into||^2`` after the update (with ``shrink`` 0 and ``lr``
            -1, the squared norm of the gradient: FedAS's Fisher trace).
        gate: Other rows that must hold samples for the step to run (a meta-step's group).
        after: What happens to the points after the update.
        pulls: ``(k, c)``: ``c point[k]`` added to the gradient before the update.
        scale: The factor on the loss's gradient (APFL: v's gradient at the mixture
            ``w + alpha (v - w)`` is ``alpha`` times the gradient there).
    """

    at: int
    into: int
    lr: Weight
    shrink: Weight
    row: int
    mixes: tuple[Mix, ...] = ()
    record: bool = False
    gate: tuple[int, ...] = ()
    after: tuple[Mix, ...] = ()
    pulls: tuple[tuple[int, Weight], ...] = ()
    scale: Weight = 1.0


class Outcome(NamedTuple):
    """A program's result: the points after its steps (new tensors where a step wrote them)
    and, per step ``[S]``, the loss at its point ``at`` on its minibatch before its update,
    whether it ran (1 or 0) and, for the steps with ``record``, the squared norm it recorded (0
    for the others and where a step did not run); and the optimizer's state after the steps, of the
    point the first step updates (``{}`` without an optimizer)."""

    points: list[Params]
    values: Tensor
    active: Tensor
    norms: Tensor
    opt_state: OptState

    def mean_value(self, stride: int = 1, summed: bool = True) -> Tensor:
        """The mean, over the local steps that ran (``stride`` program steps each, the first of
        which says whether it ran), of the local step's values summed (``summed``) or of its
        first step's value."""
        values = self.values if summed else self.values[::stride]
        return values.sum() / self.active[::stride].sum().clamp(min=1)


def active_steps(data: ClientData, steps: Sequence[Step]) -> Tensor:
    """``[S]`` booleans: whether each step runs (its row and its gate rows hold samples)."""
    real = data.batch_mask.sum(-1) > 0
    width = 1 + max((len(s.gate) for s in steps), default=0)
    rows = tuple((s.row, *s.gate, *[s.row] * (width - 1 - len(s.gate))) for s in steps)
    return real[step_rows(rows, real.device).reshape(len(steps), width)].all(-1)


@cache
def step_rows(rows: tuple[tuple[int, ...], ...], device: torch.device) -> Tensor:
    """The schedule rows of a program's steps as an index on ``device``, made once per program
    and device: an upload to a GPU is made before a CUDA graph's capture, never inside it (and
    never freed, since a captured graph may read it)."""
    return torch.tensor(rows, dtype=torch.long, device=device)


def mixed(start: Params, end: Params, weight: Weight) -> Params:
    """``start + weight (end - start)`` leaf by leaf (``start`` itself for a weight 0)."""
    if isinstance(weight, float | int) and weight == 0:
        return dict(start)
    return {k: torch.lerp(v, end[k], weight) for k, v in start.items()}


def apply_mixes(points: list[Params], mixes: Sequence[Mix], on: Tensor) -> None:
    """``mixes`` on ``points`` in place where ``on`` holds (see :data:`Mix`)."""
    for mix in mixes:
        dst, *rest = mix
        if len(rest) == 3:
            new = mixed(points[rest[0]], points[rest[1]], rest[2])
        else:
            new = {k: v + rest[1] * points[rest[0]][k] for k, v in points[dst].items()}
        points[dst] = new if points[dst] is None else tree.where(on, new, points[dst])


def step_gradient(
    loss: Callable[[Params, Tensor, Tensor, Tensor], Tensor],
    points: Sequence[Params],
    data: ClientData,
    step: Step,
) -> tuple[Params, Tensor]:
    """The step's gradient (scaled, its pulls added) at its point on its minibatch, and the loss
    there."""
    whole_set = data.batches.shape[-1] == data.x.shape[0]  # a row of every sample, as is
    idx, mask = data.batches[step.row], data.batch_mask[step.row]
    x, y = (data.x, data.y) if whole_set else (data.x[idx], data.y[idx])
    g, value = grad_and_value(loss)(points[step.at], x, y, mask)
    if isinstance(step.scale, Tensor) or step.scale != 1:
        g = tree.scale(g, step.scale)
    for k, c in step.pulls:
        g = tree.axpy(c, points[k], g)
    return g, value


def autograd_program(
    loss: Callable[[Params, Tensor, Tensor, Tensor], Tensor],
    points: Sequence[Params | None],
    data: ClientData,
    steps: Sequence[Step],
    optimizer: Optimizer | None = None,
    opt_state: OptState | None = None,
) -> Outcome:
    """The steps with ``torch.func`` gradients of ``loss(params, x, y, mask)`` (the reference:
    any loss, under vmap too); with an ``optimizer``, its updates from ``opt_state`` (a fresh
    state when ``None``) on the point the first step updates, and from a fresh state on any
    other point a step updates."""
    scratch = [p is None for p in points]
    points = [None if p is None else dict(p) for p in points]
    states = {} if opt_state is None or not steps else {steps[0].into: opt_state}
    runs = active_steps(data, steps)
    values, norms = [], []
    for step, on in zip(steps, runs, strict=True):
        apply_mixes(points, step.mixes, on)
        g, value = step_gradient(loss, points, data, step)
        old = points[step.into]
        if optimizer is None:
            new = {k: step.shrink * v - step.lr * g[k] for k, v in old.items()}
            points[step.into] = tree.where(on, new, old)
        else:
            state = states[step.into] if step.into in states else optimizer.init(old)
            points[step.into], states[step.into] = optimizer.masked_update(
                old, g, state, step.lr, on
            )
        apply_mixes(points, step.after, on)
        values.append(torch.where(on, value.detach(), 0.0))
        norm = tree.sq_norm(points[step.into]) if step.record else torch.zeros_like(value)
        norms.append(torch.where(on, norm.detach(), 0.0))
    dtype = values[0].dtype if values else data.batch_mask.dtype
    return Outcome(
        [None if s else p for s, p in zip(scratch, points, strict=True)],
        torch.stack(values) if values else data.batch_mask.new_zeros(0),
        runs.to(dtype),
        torch.stack(norms) if norms else data.batch_mask.new_zeros(0),
        states.get(steps[0].into, {}) if steps else {},
    )
