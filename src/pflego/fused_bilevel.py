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

import torch
from torch import Tensor

from pflego.fused import all_plain, plain_plan, run_kernel, step_arguments
from pflego.loss import CrossEntropy, FusedForm, Objective
from pflego.models import Layer
from pflego.optim import SGD, Optimizer, OptState
from pflego.program import Outcome, Step, active_steps
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
    steps = sgd_steps(steps, optimizer)
    plan = program_plan(loss, points, data, steps)
    if plan is None:
        return None
    runs = active_steps(data, steps).tolist()
    kept = [s for s, on in zip(steps, runs, strict=True) if on]
    values = data.batch_mask.new_zeros(len(steps))
    norms = values.clone()
    if not kept:
        points = [None if p is None else {k: v.clone() for k, v in p.items()} for p in points]
        return Outcome(points, values, values.new_tensor(runs), norms, {})
    rows = sorted({s.row for s in kept})
    arguments = step_arguments(kept, {row: j for j, row in enumerate(rows)})
    written = {s.into for s in kept} | {m[0] for s in kept for m in s.mixes + s.after}
    points, kept_values, recorded = run_kernel(
        plan, loss, FORM, points, data, rows, arguments, written
    )
    where = [j for j, on in enumerate(runs) if on]
    values[where] = kept_values.to(values.dtype)
    recording = [j for j, s in zip(where, kept, strict=True) if s.record]
    if recording:
        norms[recording] = torch.stack(recorded).to(norms.dtype)
    return Outcome(points, values, values.new_tensor(runs), norms, {})


def sgd_steps(steps: Sequence[Step], optimizer: Optimizer | None) -> list[Step] | None:
    """The steps as plain SGD runs them in the kernel: the gradient's scale folded into ``lr``,
    the optimizer's weight decay and a pull on the updated point itself into ``shrink``, the
    other pulls added after the update (they read points the update leaves alone); ``None`` for
    another optimizer."""
    if optimizer is not None and type(optimizer) is not SGD:
        return None
    decay = 0.0 if optimizer is None else optimizer.weight_decay
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
    loss: object, points: Sequence[Params | None], data: ClientData, steps: Sequence[Step] | None
) -> tuple[Layer, ...] | None:
    """The layers the kernel runs the program on, or ``None`` where it does not fuse: no
    steps (another optimizer than SGD), another loss than the plain cross-entropy, other layers, points keyed unlike the first, or tensors
    tracked by autograd or wrapped by a ``torch.func`` transform."""
    if (
        steps is None
        or not isinstance(loss, Objective)
        or loss.terms != (CrossEntropy(),)
        or not steps
    ):
        return None
    plan = plain_plan(loss, FORM, dict(points[0]), data)
    points = [p for p in points if p is not None]
    if plan is None or any(set(p) != set(points[0]) for p in points):
        return None
    weights = [w for s in steps for w in (s.lr, s.shrink, *(m[-1] for m in s.mixes + s.after))]
    tensors = [w for w in weights if isinstance(w, Tensor)]
    if not all_plain([v for p in points for v in p.values()] + tensors):
        return None
    return plan
