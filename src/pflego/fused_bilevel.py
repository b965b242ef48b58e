"""The fused interpreter of step programs (:mod:`pflego.program`): gradients taken at one point
update another, without autograd.

A plain SGD step takes the gradient where it updates. APFL's step takes two gradients on the same
minibatch, at the global copy w (updating w) and at the mixture ``alpha v + (1 - alpha) w``
(updating v); Per-FedAvg's meta-step takes a gradient at w, steps to w', and updates w with the
gradient at w'; pFedMe's and PGFed's steps add closed-form terms and sums of points.
:func:`fused_program` runs such a program's :class:`~pflego.program.Step` (for plain SGD, with or
without weight decay) on several points held as flat vectors, with the forward and backward passes of
:mod:`pflego.fused_passes` (the update folded into the weight-gradient GEMM, no autograd, no
graph), all in one TorchScript call, so a client's steps cost no Python per step. The steps whose
rows are empty are left out before the call. The loss must be an
:class:`~pflego.loss.Objective` of the cross-entropy alone; anything else returns ``None``, and
the caller runs the program with autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from pflego.fused import (
    all_plain,
    flat_views,
    kernel_feed,
    layer_arguments,
    layer_keys,
    lowest_trained,
    plain_plan,
    step_inputs,
    unflatten,
)
from pflego.fused_passes import backward_pass, compiled, forward_pass
from pflego.loss import CrossEntropy, FusedForm, Objective
from pflego.models import Layer
from pflego.optim import SGD, Optimizer, OptState
from pflego.program import Mix, Outcome, Step, active_steps
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
    points, kept_values, recorded = _run(plan, loss, points, data, kept)
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


def _run(
    plan: tuple[Layer, ...],
    loss: Objective,
    points: Sequence[Params | None],
    data: ClientData,
    steps: Sequence[Step],
) -> tuple[list[Params | None], Tensor, list[Tensor]]:
    """The kernel's call on the steps that run: the points after them, each step's
    cross-entropy before its update and the recorded squared norms."""
    rows = sorted({s.row for s in steps})
    position = {row: j for j, row in enumerate(rows)}
    index = torch.tensor(rows, dtype=torch.long)
    feed = step_inputs(plan, loss, FORM, data, data.batches[index], data.batch_mask[index])
    order = [k for layer in plan for k in layer_keys(layer, points[0])]
    # a scratch point is written before it is read: laid out like the first, left unfilled
    laid_out = [
        flat_views(plan, order, points[0] if p is None else p, p is not None) for p in points
    ]
    flats, views = zip(*laid_out, strict=True)
    layers = [layer_arguments(plan, {**loss.fixed, **v}, set(points[0])) for v in views]
    with torch.jit.optimized_execution(False):  # the same plain interpreter for every call
        log_probs, norms = compiled(_program)(
            *layers[0][:2],
            [arguments[2] for arguments in layers],
            [arguments[3] for arguments in layers],
            layers[0][4],
            list(flats),
            *step_arguments(steps, position),
            **kernel_feed(feed, loss.label_mask),
            lowest=lowest_trained(plan, points[0]),
        )
    targets = feed.target[[position[s.row] for s in steps]]
    values = -(torch.stack(log_probs) * targets).sum((1, 2))
    written = {s.into for s in steps} | {m[0] for s in steps for m in s.mixes + s.after}
    trained = [None if point is None else dict(point) for point in points]
    for p in written:
        if trained[p] is not None:  # a scratch point is never read back
            trained[p] = unflatten(plan, flats[p], views[p])
    return trained, values, norms


def step_arguments(steps: Sequence[Step], position: dict[int, int]) -> list[list]:
    """The kernel's per-step arguments (see :func:`_program`): the mixes before and after the
    update (``[dst, start, end]`` each, ``end`` -1 for a sum, and weights), then each step's
    ``at``, ``into``, step size, shrinkage, row of the gathered minibatches and ``record``."""

    def encoded(mixes: tuple[Mix, ...]) -> tuple[list[list[int]], list[float]]:
        ends = [m[:3] if len(m) == 4 else (m[0], m[1], -1) for m in mixes]
        return [list(e) for e in ends], [float(m[-1]) for m in mixes]

    before, after = zip(*(encoded(s.mixes) for s in steps), strict=True)
    later, later_weights = zip(*(encoded(s.after) for s in steps), strict=True)
    return [
        list(before),
        list(after),
        list(later),
        list(later_weights),
        [s.at for s in steps],
        [s.into for s in steps],
        [float(s.lr) for s in steps],
        [float(s.shrink) for s in steps],
        [position[s.row] for s in steps],
        [s.record for s in steps],
    ]


def _program(
    kinds: list[str],
    settings: list[list[int]],
    weights: list[list[Tensor]],
    biases: list[list[Tensor]],
    flags: list[list[bool]],
    flats: list[Tensor],
    mixes: list[list[list[int]]],
    mix_weights: list[list[float]],
    after: list[list[list[int]]],
    after_weights: list[list[float]],
    at: list[int],
    into: list[int],
    lrs: list[float],
    shrinks: list[float],
    feed: list[int],
    record: list[bool],
    inputs: list[Tensor],
    negative_target: list[Tensor],
    weight_rows: list[Tensor],
    ones: Tensor,
    label_mask: Tensor,
    masked: bool,
    lowest_logit: float,
    lowest: int,
) -> tuple[list[Tensor], list[Tensor]]:
    """The substeps (TorchScript-compatible). Point ``p``'s layers are ``weights[p]`` /
    ``biases[p]``, its trained tensors views of ``flats[p]``; substep ``j`` mixes the points
    (:func:`_mix`), runs :func:`~pflego.fused_passes.forward_pass` at point ``at[j]`` on
    minibatch ``feed[j]`` and :func:`~pflego.fused_passes.backward_pass` into point ``into[j]``,
    then mixes the points again. Returns
    each substep's log-probabilities ``[K, B]`` and, for the substeps with ``record``, the
    squared norm of point ``into[j]`` after the update."""
    log_probs: list[Tensor] = []
    norms: list[Tensor] = []
    no_feature_grad = ones[:0]
    for j in range(len(at)):
        _mix(flats, mixes[j], mix_weights[j])
        r, p, q = feed[j], at[j], into[j]
        a_, log_p, grad_t, saved, indices, shapes = forward_pass(
            True, kinds, settings, weights[p], biases[p], flags, inputs[r], negative_target[r],
            weight_rows[r], label_mask, masked, lowest_logit,
        )  # fmt: skip
        log_probs.append(log_p)
        backward_pass(
            True, kinds, settings, weights[p], biases[p], weights[q], biases[q], flags, saved,
            indices, shapes, a_, grad_t, no_feature_grad, ones,
            lrs[j], shrinks[j], lowest,
        )  # fmt: skip
        _mix(flats, after[j], after_weights[j])
        if record[j]:
            norms.append(torch.dot(flats[q], flats[q]))
    return log_probs, norms


def _mix(flats: list[Tensor], mixes: list[list[int]], weights: list[float]) -> None:
    """The mixes ``[dst, start, end]`` (``end`` -1: ``dst += weight start``) with their
    ``weights`` on the flat points, in place (TorchScript-compatible)."""
    for m in range(len(mixes)):
        dst, start, end = flats[mixes[m][0]], flats[mixes[m][1]], mixes[m][2]
        if end < 0:
            dst.add_(start, alpha=weights[m])
        elif weights[m] == 0.0:
            dst.copy_(start)
        elif mixes[m][0] == mixes[m][1]:
            dst.lerp_(flats[end], weights[m])
        else:
            torch.lerp(start, flats[end], weights[m], out=dst)
