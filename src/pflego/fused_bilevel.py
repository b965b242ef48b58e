"""Step programs (:mod:`pflego.program`: APFL's, Per-FedAvg's, pFedMe's, PGFed's local steps)
run by the fused kernel of :mod:`pflego.fused`: gradients taken at one point update another,
without autograd.

:func:`fused_program` runs a program's :class:`~pflego.program.Step` (for plain SGD, with or
without weight decay) on several points held as flat vectors in one TorchScript call. The steps
whose rows are empty are left out before the call. The loss must be an
:class:`~pflego.loss.Objective` of the cross-entropy alone; anything else returns ``None``, and
the caller runs the program with autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

import torch
from torch import Tensor

from pflego.fused import StepArguments, all_plain, plain_plan, run_kernel, step_arguments
from pflego.loss import CrossEntropy, FusedForm, Objective
from pflego.models import Layer
from pflego.optim import SGD, Optimizer, OptState
from pflego.program import Outcome, Step, Weight, active_steps
from pflego.tree import Params
from pflego.types import ClientData

FORM = FusedForm(cross_entropy=True)


def fused_program(
    loss: object,
    points: Sequence[Params | None],
    data: ClientData,
    steps: Sequence[Step],
    optimizer: Optimizer | None = None,
    opt_state: OptState | None = None,
) -> Outcome | None:
    """The steps on the points, or ``None`` when they do not fuse.

    Every point is keyed like the first (or scratch, ``None``), every key a trained parameter of
    ``loss``'s model.
    ``optimizer`` (``None``: the steps' own ``shrink``) must be plain :class:`~pflego.optim.SGD`,
    whose state ``opt_state`` is empty.

    Returns:
        An :class:`~pflego.program.Outcome`.
    """
    if optimizer is not None and type(optimizer) is not SGD:
        return None
    tensors = [w for w in step_weights(steps) if isinstance(w, Tensor)]
    plan = program_plan(loss, points, data, steps, tensors)
    if plan is None:
        return None
    runs = active_steps(data, steps).tolist()
    values = data.batch_mask.new_zeros(len(steps))
    norms = values.clone()
    if not any(runs):
        points = [None if p is None else {k: v.clone() for k, v in p.items()} for p in points]
        return Outcome(points, values, values.new_tensor(runs), norms, {})
    encode = kernel_steps.__wrapped__ if tensors else kernel_steps  # tensors: never kept
    decay = 0.0 if optimizer is None else optimizer.weight_decay
    kept, rows, arguments, written = encode(tuple(steps), decay, tuple(runs))
    points, kept_values, recorded = run_kernel(
        plan, loss, FORM, points, data, rows, arguments, written
    )
    where = [j for j, on in enumerate(runs) if on]
    values[where] = kept_values.to(values.dtype)
    recording = [j for j, s in zip(where, kept, strict=True) if s.record]
    if recording:
        norms[recording] = torch.stack(recorded).to(norms.dtype)
    return Outcome(points, values, values.new_tensor(runs), norms, {})


@lru_cache(maxsize=64)
def kernel_steps(
    steps: tuple[Step, ...], decay: float, runs: tuple[bool, ...]
) -> tuple[list[Step], list[int], StepArguments, set[int]]:
    """The steps that run (``runs``) as plain SGD with weight decay ``decay`` runs them
    (:func:`sgd_steps`), the schedule rows they read, the kernel's arguments and the points
    they write: made once per program of numbers, since a run's calls repeat them (clients of a
    size run the same program)."""
    kept = [s for s, on in zip(sgd_steps(steps, decay), runs, strict=True) if on]
    rows = sorted({s.row for s in kept})
    arguments = step_arguments(kept, {row: j for j, row in enumerate(rows)})
    written = {s.into for s in kept} | {m[0] for s in kept for m in s.mixes + s.after}
    return kept, rows, arguments, written


def step_weights(steps: Sequence[Step]) -> list[Weight]:
    """The steps' step sizes, shrinkages, scales, pulls' coefficients and mixing weights."""
    return [
        w
        for s in steps
        for w in (
            s.lr,
            s.shrink,
            s.scale,
            *(c for _, c in s.pulls),
            *(m[-1] for m in s.mixes + s.after),
        )
    ]


def sgd_steps(steps: Sequence[Step], decay: float) -> list[Step]:
    """The steps as plain SGD with weight decay ``decay`` runs them in the kernel: the
    gradient's scale folded into ``lr``, the weight decay and a pull on the updated point itself
    into ``shrink``, the other pulls added after the update (they read points the update leaves
    alone)."""
    return [
        replace(
            s,
            lr=s.lr * s.scale,
            scale=1.0,
            shrink=s.shrink - s.lr * (decay + sum(c for k, c in s.pulls if k == s.into)),
            after=tuple((s.into, k, -s.lr * c) for k, c in s.pulls if k != s.into) + s.after,
            pulls=(),
        )
        for s in steps
    ]


def program_plan(
    loss: object,
    points: Sequence[Params | None],
    data: ClientData,
    steps: Sequence[Step],
    tensors: list[Tensor],
) -> tuple[Layer, ...] | None:
    """The layers the kernel runs the program on, or ``None`` where it does not fuse: no
    steps, another loss than the plain cross-entropy, other layers, points keyed unlike the
    first, or tensors (of the points, or ``tensors``, the steps' weights that are tensors)
    tracked by autograd or wrapped by a ``torch.func`` transform."""
    if not isinstance(loss, Objective) or loss.terms != (CrossEntropy(),) or not steps:
        return None
    plan = plain_plan(loss, FORM, dict(points[0]), data)
    points = [p for p in points if p is not None]
    if plan is None or any(set(p) != set(points[0]) for p in points):
        return None
    if not all_plain([v for p in points for v in p.values()] + tensors):
        return None
    return plan
