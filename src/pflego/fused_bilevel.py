"""Fused steps of bi-level local updates: gradients taken at one point update another.

A plain SGD step takes the gradient where it updates. APFL's step takes two gradients on the same
minibatch, at the global copy w (updating w) and at the mixture ``alpha v + (1 - alpha) w``
(updating v); Per-FedAvg's meta-step takes a gradient at w, steps to w', and updates w with the
gradient at w'. :func:`fused_program` runs any sequence of such *substeps* (:class:`Substep`) on
several points held as flat vectors, with the forward and backward passes of :mod:`pflego.fused_passes`
(the update folded into the weight-gradient GEMM, no autograd, no graph), all in one TorchScript
call, so a client's steps cost no Python per step.

A substep first applies its ``mixes`` (``point[dst] <- point[start] + weight (point[end] -
point[start])``, one pass over the parameters: mixtures of points, and copies with weight 0),
then takes the loss's gradient ``g`` at point ``at`` on minibatch ``row`` of
the client's schedule and updates point ``into`` by ``into <- shrink into - lr g``. The loss must
be an :class:`~pflego.loss.Objective` of the cross-entropy alone; anything else returns ``None``, and the
caller runs autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pflego.fused import (
    all_plain,
    flat_views,
    layer_keys,
    layer_settings,
    plain_plan,
    step_inputs,
    unflatten,
)
from pflego.fused_passes import backward_pass, compiled, forward_pass
from pflego.loss import CrossEntropy, FusedForm, Objective
from pflego.tree import Params
from pflego.types import ClientData

#: ``(dst, start, end, weight)``: ``point[dst] <- point[start] + weight (point[end] -
#: point[start])`` (weight 0: a copy of ``point[start]``).
Mix = tuple[int, int, int, float]


@dataclass(frozen=True)
class Substep:
    """One gradient step of a program (see the module's docstring).

    Attributes:
        at: The point the gradient is taken at.
        into: The point it updates, ``into <- shrink into - lr g``.
        lr: The step size.
        shrink: The factor on ``into`` (weight decay: ``1 - lr decay``).
        row: The row of the client's schedule (``data.batches``) whose minibatch it uses.
        mixes: What happens to the points before the gradient is taken.
        record: Whether to record ``||into||^2`` after the update (with ``shrink`` 0 and ``lr``
            -1, the squared norm of the gradient: FedAS's Fisher trace).
    """

    at: int
    into: int
    lr: float
    shrink: float
    row: int
    mixes: tuple[Mix, ...] = ()
    record: bool = False


class Program(NamedTuple):
    """What :func:`fused_program` returns: the points after the substeps (new tensors), each
    substep's cross-entropy at its point ``at`` on its minibatch before its update, and the
    squared norms the substeps with ``record`` recorded, in order."""

    points: list[Params]
    values: Tensor
    norms: list[Tensor]


def fused_program(
    loss: object, points: Sequence[Params], data: ClientData, substeps: Sequence[Substep]
) -> Program | None:
    """The substeps on the points, or ``None`` when they do not fuse.

    Every point is keyed like the first, every key a trained parameter of ``loss``'s model; every
    substep's row must be real (a padding row would change nothing anyway: leave it out).

    Returns:
        A :class:`Program`.
    """
    if not isinstance(loss, Objective) or loss.terms != (CrossEntropy(),):
        return None
    form = FusedForm(cross_entropy=True)
    plan = plain_plan(loss, form, dict(points[0]), data)
    if plan is None or any(set(p) != set(points[0]) for p in points):
        return None
    if not all_plain([v for p in points for v in p.values()]) or not substeps:
        return None
    rows = sorted({s.row for s in substeps})
    position = {row: j for j, row in enumerate(rows)}
    index = torch.tensor(rows, dtype=torch.long)
    feed = step_inputs(plan, loss, form, data, data.batches[index], data.batch_mask[index])
    order = [k for layer in plan for k in layer_keys(layer, points[0])]
    flats, views = zip(*(flat_views(plan, order, p) for p in points), strict=True)
    held = {k: v for k, v in loss.fixed.items()}
    full = [{**held, **v} for v in views]
    empty = data.x.new_empty(0)
    label_mask = loss.label_mask > 0
    trained = set(points[0])
    with torch.jit.optimized_execution(False):  # the same plain interpreter for every call
        log_probs, norms = compiled(_program)(
            [layer.kind for layer in plan],
            [layer_settings(layer) for layer in plan],
            [[f.get(layer.weight, empty) for layer in plan] for f in full],
            [[f.get(layer.bias, empty) for layer in plan] for f in full],
            [
                [layer.bias in full[0], layer.weight in trained, layer.bias in trained]
                for layer in plan
            ],
            list(flats),
            [[m[0] for m in s.mixes] for s in substeps],
            [[m[1] for m in s.mixes] for s in substeps],
            [[m[2] for m in s.mixes] for s in substeps],
            [[float(m[3]) for m in s.mixes] for s in substeps],
            [s.at for s in substeps],
            [s.into for s in substeps],
            [float(s.lr) for s in substeps],
            [float(s.shrink) for s in substeps],
            [position[s.row] for s in substeps],
            [s.record for s in substeps],
            feed.inputs,
            list((-feed.target).unbind(0)),
            list(feed.weights.unsqueeze(1).unbind(0)),
            feed.weights.new_ones(feed.weights.shape[1]),
            label_mask.unsqueeze(1),
            not bool(label_mask.all()),
            torch.finfo(feed.target.dtype).min,
            min(i for i, layer in enumerate(plan) if set(layer_keys(layer, points[0]))),
        )
    targets = feed.target[[position[s.row] for s in substeps]]
    values = -(torch.stack(log_probs) * targets).sum((1, 2))
    points = [unflatten(plan, flat, v) for flat, v in zip(flats, views, strict=True)]
    return Program(points, values, norms)


def real_rows(data: ClientData) -> list[int] | None:
    """The rows of ``data``'s schedule that hold samples, or ``None`` when the schedule is
    tracked by autograd or wrapped by a ``torch.func`` transform (nothing fuses there)."""
    if not all_plain([data.batches, data.batch_mask]):
        return None
    return torch.nonzero(data.batch_mask.sum(-1) > 0).flatten().tolist()


def _program(
    kinds: list[str],
    settings: list[list[int]],
    weights: list[list[Tensor]],
    biases: list[list[Tensor]],
    flags: list[list[bool]],
    flats: list[Tensor],
    mix_dst: list[list[int]],
    mix_start: list[list[int]],
    mix_end: list[list[int]],
    mix_weight: list[list[float]],
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
    ``biases[p]``, its trained tensors views of ``flats[p]``; substep ``j`` mixes the points,
    then runs :func:`~pflego.fused_passes.forward_pass` at point ``at[j]`` on minibatch
    ``feed[j]`` and :func:`~pflego.fused_passes.backward_pass` into point ``into[j]``. Returns
    each substep's log-probabilities ``[K, B]`` and, for the substeps with ``record``, the
    squared norm of point ``into[j]`` after the update."""
    log_probs: list[Tensor] = []
    norms: list[Tensor] = []
    no_feature_grad = ones[:0]
    for j in range(len(at)):
        for m in range(len(mix_dst[j])):
            dst, start, weight = flats[mix_dst[j][m]], flats[mix_start[j][m]], mix_weight[j][m]
            if weight == 0.0:
                dst.copy_(start)
            else:
                torch.lerp(start, flats[mix_end[j][m]], weight, out=dst)
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
        if record[j]:
            norms.append(torch.dot(flats[q], flats[q]))
    return log_probs, norms
