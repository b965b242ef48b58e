"""Fused steps: local training on a declared loss without autograd, by one TorchScript kernel.

For a :class:`~pflego.loss.Objective` whose terms all have fused forms and whose model is a sequence of ``Linear``, ``Conv2d``,
``ReLU``, ``MaxPool2d`` and ``Flatten`` layers with a linear head, and for plain SGD (optionally
with weight decay), every local step is one forward pass that keeps the activations it needs and
one backward pass that applies each layer's update as soon as the gradient below it is taken:

    W <- (1 - lr (strength + weight_decay)) W - lr g^T a + lr (strength anchor + linear)

with the shrinkage and the product folded into the weight-gradient GEMM (``W.addmm_(g^T, a,
beta=1 - lr (strength + weight_decay), alpha=-lr)``), so no gradient tensor is materialized and
no graph is built. The trained tensors are views of one flat vector, so the last term, constant
over the steps, is one addition per step for the whole model, and the proximal term's value one
subtraction into a kept buffer and one dot product. The minibatches of all steps are
gathered in one indexing operation; for a convolutional model, stored channels-last
(:func:`~pflego.models.channels_last`), so that the activations of its convolutions are too and
max-pooling runs an order of magnitude faster on them than on ``NCHW`` (the whole step 1.26x on
the PGFed CNN: ``benchmarks/cnn_speed.py``). The result equals ``train_steps``'s autograd path up
to floating-point rounding (the tests check float64 runs to 1e-10).

The kernel, :func:`_program`, runs the steps of a step program (:mod:`pflego.program`, whose
gradients may be taken at one point and update another; :mod:`pflego.fused_bilevel`) on points
held as flat vectors, all in one call, so a client's steps cost no Python per step; plain SGD
steps (:func:`fused_sgd_steps`) are a program of one point.

A step whose batch is empty is skipped, as the autograd path's masked update does. Anything else
(another optimizer, another layer, an input that requires grad or runs under a ``torch.func``
transform) returns ``None``, and the caller uses autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from pflego.fused_passes import backward_pass, compiled, forward_pass
from pflego.loss import FusedForm, Objective
from pflego.models import Layer, channels_last
from pflego.optim import SGD, Optimizer, Proximal
from pflego.program import Mix, Step
from pflego.tree import Params
from pflego.types import ClientData

HEAD = (Layer("linear", "head"),)


def all_plain(tensors: Sequence[Tensor]) -> bool:
    """Tensors that are neither tracked by autograd nor wrapped by a ``torch.func`` transform."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(not t.requires_grad and not wrapped(t) for t in tensors)


def fused_sgd_steps(
    loss: object,
    params: Params,
    data: ClientData,
    optimizer: Optimizer,
    lr: float | Tensor,
    steps: slice = slice(None),
) -> tuple[Params, Tensor] | None:
    """``train_steps`` for plain SGD on an :class:`~pflego.loss.Objective`, or ``None`` when it
    does not apply.

    SGD inside a :class:`~pflego.optim.Proximal` optimizer is SGD on the loss with that proximal
    (and linear) term, whose value is left out of the logged loss.

    Returns:
        The trained parameters (new tensors) and the mean loss over the real steps.
    """
    prox = optimizer if type(optimizer) is Proximal else None
    form = kernel_form(loss, prox)
    sgd = optimizer if prox is None else prox.inner
    if form is None or type(sgd) is not SGD:
        return None
    plan = plain_plan(loss, form, params, data)
    regularizers = [t for t in (form.anchor, form.linear) if t is not None]
    if plan is None or not all(set(params) <= set(t) for t in regularizers):
        return None
    if not all_plain([v for t in regularizers for v in t.values()]):
        return None
    return _sgd(plan, loss, form, params, data, sgd.weight_decay, float(lr), steps, prox is None)


def kernel_form(loss: object, prox: Proximal | None) -> FusedForm | None:
    """What the kernel runs: the fused forms of ``loss``'s terms and, for SGD inside a
    :class:`~pflego.optim.Proximal` optimizer, the optimizer's proximal and linear terms (for a
    loss without its own), or ``None`` where a term has no fused form."""
    form = loss.fused_form() if isinstance(loss, Objective) else None
    if form is None or (form.centroids is not None and loss.model is None):
        return None  # (aligning a bare head's input features: autograd)
    if prox is None:
        return form
    if form.anchor is not None or form.linear is not None:
        return None
    return form._replace(anchor=prox.anchor, strength=prox.lam, linear=prox.linear)


def plain_plan(
    loss: Objective, form: FusedForm, params: Params, data: ClientData
) -> tuple[Layer, ...] | None:
    """The layers the kernel runs ``loss`` on (the model's plain layers in forward order, then
    its head unless the loss has no cross-entropy), when every parameter is a plain layer's,
    untracked by autograd and outside ``torch.func`` transforms (``form``'s tensors too, its
    regularizers aside), and ``data``'s inputs reach each layer in its shape; else ``None``."""
    body = () if loss.model is None else loss.model.layers
    if body is None:
        return None
    plan = body + (HEAD if loss.cross_entropy else ())
    full = {**loss.fixed, **params}
    names = {
        name
        for layer in plan
        if layer.kind in ("linear", "conv")
        for name in layer_keys(layer, full)
    }
    weights = {layer.weight for layer in plan if layer.kind in ("linear", "conv")}
    if (
        set(full) != names
        or not weights <= names
        or not params
        or not all_plain([*full.values(), data.x, data.batches, data.batch_mask])
        or not all_plain([] if form.sample_weights is None else [form.sample_weights])
        or not all_plain([] if form.centroids is None else [form.centroids, form.centroid_weights])
        or not _fits(plan, data.x.shape[1:])
        or ("head.weight" not in full and loss.cross_entropy)
    ):
        return None
    return plan


def layer_keys(layer: Layer, params: Params) -> list[str]:
    """The parameter names of ``layer`` (weight, bias) that ``params`` holds."""
    return [k for k in (layer.weight, layer.bias) if k in params]


def _fits(plan: tuple[Layer, ...], sample_shape: torch.Size) -> bool:
    """Whether inputs of ``sample_shape`` reach every linear layer as ``[batch, features]``."""
    dims = 1 + len(sample_shape)
    for layer in plan:
        if layer.kind == "linear" and dims != 2:
            return False
        if layer.kind == "conv" and dims != 4:
            return False
        if layer.kind == "maxpool" and dims not in (3, 4):
            return False
        if layer.kind == "flatten":
            start, end = layer.module.start_dim % dims, layer.module.end_dim % dims
            dims -= end - start
    return True


def _sgd(
    plan: tuple[Layer, ...],
    loss: Objective,
    form: FusedForm,
    params: Params,
    data: ClientData,
    weight_decay: float,
    lr: float,
    steps: slice,
    log_proximal: bool,
) -> tuple[Params, Tensor]:
    """The steps as a program of one point, the regularizers' constant pull added after each
    update: the trained parameters and the mean loss over the real steps."""
    active = (data.batch_mask[steps].sum(1) > 0).tolist()  # empty steps change nothing
    real = [row for row, on in zip(range(len(data.batches))[steps], active, strict=True) if on]
    if not real:
        return {k: v.clone() for k, v in params.items()}, torch.zeros(())
    pulls = None
    if form.anchor is not None or form.linear is not None:
        order = [k for layer in plan for k in layer_keys(layer, params)]
        pulls = _pulls(plan, order, form, next(iter(params.values())), lr, log_proximal)
    strength = float(form.strength) if form.anchor is not None else 0.0
    shrink = 1 - lr * (strength + weight_decay)
    pull = pulls is not None and pulls.pull.numel() > 0
    arguments = _sgd_arguments(len(real), lr, shrink, pull)
    points, values, _ = run_kernel(plan, loss, form, [params], data, real, arguments, {0}, pulls)
    return points[0], values.sum() / len(values)


@lru_cache(maxsize=64)
def _sgd_arguments(count: int, lr: float, shrink: float, pull: bool) -> StepArguments:
    """The kernel's arguments of ``count`` SGD steps of point 0, one per gathered minibatch, each
    followed by the pull (the kernel's flat 1) when there is one: made once per setting, since
    a run's calls repeat them."""
    after = ((0, 1, 1.0),) if pull else ()
    steps = [Step(0, 0, lr, shrink, j, after=after) for j in range(count)]
    return step_arguments(steps, {j: j for j in range(count)})


class Pulls(NamedTuple):
    """The kernel's regularizer arguments (see :func:`_program`), each empty when absent."""

    anchor: Tensor
    linear: Tensor
    pull: Tensor


def _pulls(
    plan: tuple[Layer, ...],
    order: list[str],
    form: FusedForm,
    like: Tensor,
    lr: float,
    log_proximal: bool,
) -> Pulls:
    """The regularizers laid out like the flat parameters (of ``like``'s dtype): the anchor (for
    the logged distance), the linear term's coefficients (for the logged dot product) and the
    pull ``lr (strength anchor + linear)`` each step adds."""
    empty = like.new_empty(0)

    def flattened(table: Params | None) -> Tensor:
        if table is None:
            return empty
        return torch.cat([_kernel_layout(plan, k, table[k]).reshape(-1) for k in order])

    strength = float(form.strength) if form.anchor is not None else 0.0
    anchor = flattened(form.anchor if strength != 0.0 else None)
    linear = flattened(form.linear)
    pull = anchor * (lr * strength) if anchor.numel() else empty
    if linear.numel():
        pull = linear * lr if not pull.numel() else pull.add_(linear, alpha=lr)
    return Pulls(
        anchor if log_proximal else empty,  # only the logged distance reads it
        linear if log_proximal else empty,  # only the logged dot product reads it
        pull,
    )


def layer_arguments(
    plan: tuple[Layer, ...], full: Params, trained: set[str]
) -> tuple[list[str], list[list[int]], list[Tensor], list[Tensor], list[list[bool]]]:
    """The kernel's per-layer arguments: kinds, integer settings, weights and biases (empty
    where absent) and ``[has bias, weight trained, bias trained]``."""
    empty = next(iter(full.values())).new_empty(0)
    return (
        [layer.kind for layer in plan],
        [layer_settings(layer) for layer in plan],
        [full.get(layer.weight, empty) for layer in plan],
        [full.get(layer.bias, empty) for layer in plan],
        [[layer.bias in full, layer.weight in trained, layer.bias in trained] for layer in plan],
    )


def kernel_feed(feed: StepInputs, label_mask: Tensor) -> dict[str, object]:
    """The kernel's per-minibatch inputs and label arguments (see :func:`_program`)."""
    mask = label_mask > 0
    return {
        "inputs": feed.inputs,
        "negative_target": list((-feed.target).unbind(0)),
        "weight_rows": list(feed.weights.unsqueeze(1).unbind(0)),
        "centroid_targets": list(feed.centroid_targets.unbind(0)),
        "centroid_rows": list(feed.centroid_rows.unbind(0)),
        "ones": feed.weights.new_ones(feed.weights.shape[1]),
        "label_mask": mask.unsqueeze(1),
        "masked": not bool(mask.all()),
        "lowest_logit": torch.finfo(feed.target.dtype).min,
    }


def lowest_trained(plan: tuple[Layer, ...], params: Params) -> int:
    """The first layer with a trained parameter (the backward pass stops there)."""
    return min(i for i, layer in enumerate(plan) if set(layer_keys(layer, params)))


class StepInputs(NamedTuple):
    """What the kernel reads of each step's minibatch (see :func:`_program`)."""

    inputs: list[Tensor]
    target: Tensor
    weights: Tensor
    centroid_targets: Tensor
    centroid_rows: Tensor


def step_inputs(
    plan: tuple[Layer, ...],
    loss: Objective,
    form: FusedForm,
    data: ClientData,
    batches: Tensor,
    batch_mask: Tensor,
) -> StepInputs:
    """The inputs of the steps ``batches`` / ``batch_mask`` (``[S, B]``, every step real),
    gathered once: each step's input, ``onehot(y)^T * mask / n`` ``[S, K, B]`` and ``mask / n``
    ``[S, B]`` (times the samples' weights when the loss has them); with the loss's centroids,
    each row's centroid ``[S, B, M]`` and ``2 centroid_weights[y] mask / n`` ``[S, B, 1]`` (else
    empty; with ``class_means``, ``n`` is the number of the row's class in its minibatch)."""
    plain_weights = batch_mask / batch_mask.sum(1, keepdim=True).clamp(min=1)  # [S, B]: mask / n_s
    weights = plain_weights
    if form.sample_weights is not None:  # [S, B]: w_idx * mask / n_s
        weights = weights * form.sample_weights[batches]
    convolutional = any(layer.kind == "conv" for layer in plan) and data.x.dim() == 4
    if batches.shape[-1] == data.x.shape[0]:  # full batch: every step is the whole local set
        inputs = [channels_last(data.x) if convolutional else data.x] * len(batches)
        labels = data.y.expand(len(batches), -1)
    else:  # every step's minibatch, gathered once
        gathered = data.x[batches]
        inputs = list((channels_last(gathered) if convolutional else gathered).unbind(0))
        labels = data.y[batches]
    classes = loss.label_mask.shape[-1]
    # the head works on transposed logits [K, B]: products with a few outputs run fastest so
    target = F.one_hot(labels, classes).to(weights.dtype).transpose(1, 2)
    target = target * weights.unsqueeze(1)  # [S, K, B]: onehot(y) * mask / n_s
    centroid_targets = centroid_rows = weights.new_empty((len(batches), 0))
    if form.centroids is not None:
        centroid_targets = form.centroids[labels]  # [S, B, M]
        if form.class_means:  # [S, B]: mask / (rows of the row's class in its minibatch)
            classes = torch.arange(len(form.centroids), device=labels.device)
            rows = ((labels[..., None] == classes) * batch_mask[..., None]).sum(1).clamp(min=1)
            plain_weights = batch_mask / rows.gather(1, labels)
        centroid_rows = (2 * form.centroid_weights[labels] * plain_weights).unsqueeze(2)
    return StepInputs(inputs, target, weights, centroid_targets, centroid_rows)


def flat_views(
    plan: tuple[Layer, ...], order: list[str], params: Params, fill: bool = True
) -> tuple[Tensor, dict[str, Tensor]]:
    """``params[order]`` in the kernel's layout as one flat vector, and each as a view of it
    (each tensor copied once, straight into its place; without ``fill``, left uninitialized)."""
    laid_out = [_kernel_layout(plan, k, params[k]) for k in order]
    first = laid_out[0]
    flat = first.new_empty(sum(v.numel() for v in laid_out))
    views, offset = {}, 0
    for k, value in zip(order, laid_out, strict=True):
        views[k] = flat[offset : offset + value.numel()].view(value.shape)
        if fill:
            views[k].copy_(value)
        offset += value.numel()
    return flat, views


def unflatten(plan: tuple[Layer, ...], vector: Tensor, views: Params) -> Params:
    """``vector``, laid out like the flat parameters whose views are ``views``, as a parameter
    dict in the model's layout."""
    out, offset = {}, 0
    for k, v in views.items():
        part = vector[offset : offset + v.numel()].view(v.shape)
        out[k] = _kernel_layout(plan, k, part).contiguous()
        offset += v.numel()
    return out


def _kernel_layout(plan: tuple[Layer, ...], key: str, value: Tensor) -> Tensor:
    """A parameter as the kernel holds it: body linear weights transposed (``W^T``); the same
    function turns it back."""
    body_linear = any(
        layer.kind == "linear" and layer.key != "head" and layer.weight == key for layer in plan
    )
    return value.t() if body_linear else value


def layer_settings(layer: Layer) -> list[int]:
    """A layer's settings as integers: conv stride, padding, dilation; pool kernel, stride,
    padding, dilation, ceil mode; flatten start and end dimensions."""
    m = layer.module
    if layer.kind == "conv":
        return [*m.stride, *m.padding, *m.dilation]
    if layer.kind == "maxpool":
        kernel, stride, padding, dilation, ceil_mode = layer.pool_settings()
        return [*kernel, *stride, *padding, *dilation, int(ceil_mode)]
    if layer.kind == "flatten":
        return [m.start_dim, m.end_dim]
    return []


def run_kernel(
    plan: tuple[Layer, ...],
    loss: Objective,
    form: FusedForm,
    points: Sequence[Params | None],
    data: ClientData,
    rows: list[int],
    arguments: StepArguments,
    written: set[int],
    pulls: Pulls | None = None,
) -> tuple[list[Params | None], Tensor, list[Tensor]]:
    """The kernel's call on the steps that run, on the schedule's ``rows`` (of ``loss``'s terms'
    fused ``form``, with the regularizers ``pulls``, whose pull is the kernel's last flat): the
    points after them (the ``written`` ones new), each step's loss before its update and the
    recorded squared norms."""
    index = torch.tensor(rows, dtype=torch.long)
    feed = step_inputs(plan, loss, form, data, data.batches[index], data.batch_mask[index])
    order = [k for layer in plan for k in layer_keys(layer, points[0])]
    # a scratch point is written before it is read: laid out like the first, left unfilled
    laid_out = [
        flat_views(plan, order, points[0] if p is None else p, p is not None) for p in points
    ]
    flats, views = zip(*laid_out, strict=True)
    empty = flats[0].new_empty(0)
    anchor, linear, pull = (empty, empty, empty) if pulls is None else pulls
    held = {k: _kernel_layout(plan, k, v).contiguous() for k, v in loss.fixed.items()}
    layers = [layer_arguments(plan, {**held, **v}, set(points[0])) for v in views]
    with torch.jit.optimized_execution(False):  # the same plain interpreter for every call
        log_probs, norms, *logged = compiled(_program)(
            form.cross_entropy,
            *layers[0][:2],
            [arguments[2] for arguments in layers],
            [arguments[3] for arguments in layers],
            layers[0][4],
            [*flats, pull] if pull.numel() else list(flats),
            *arguments,
            **kernel_feed(feed, loss.label_mask),
            anchor=anchor,
            linear=linear,
            lowest=lowest_trained(plan, points[0]),
        )
    targets = feed.target  # each step's, where steps and minibatches differ
    if arguments.feed != list(range(len(rows))):
        targets = targets.index_select(0, torch.tensor(arguments.feed))
    values = _values(form, targets, log_probs, *logged)
    trained = [None if point is None else dict(point) for point in points]
    for p in written:
        if trained[p] is not None:  # a scratch point is never read back
            trained[p] = unflatten(plan, flats[p], views[p])
    return trained, values, norms


def _values(
    form: FusedForm,
    targets: Tensor,
    log_probs: list[Tensor],
    distances: list[Tensor],
    dots: list[Tensor],
    alignments: list[Tensor],
) -> Tensor:
    """Each step's loss from the kernel's logged parts: the cross-entropy (``targets``:
    ``onehot(y)^T * mask / n`` ``[S, K, B]``), ``strength / 2`` times the squared distance to the
    anchor, minus the linear term's dot product, half the alignment's sum."""
    if form.cross_entropy:
        values = -(torch.stack(log_probs) * targets).sum((1, 2))
    else:
        values = targets.new_zeros(len(targets))
    if distances:
        values = values + float(form.strength) / 2 * torch.stack(distances)
    if dots:
        values = values - torch.stack(dots)
    if alignments:
        values = values + torch.stack(alignments) / 2  # each the sum of 2 w_s ||gap_s||^2
    return values


class StepArguments(NamedTuple):
    """The kernel's per-step arguments (see :func:`_program`): the mixes before and after the
    update (``[dst, start, end]`` each, ``end`` -1 for a sum, and weights), then each step's
    ``at``, ``into``, step size, shrinkage, row of the gathered minibatches and ``record``."""

    mixes: list[list[list[int]]]
    mix_weights: list[list[float]]
    after: list[list[list[int]]]
    after_weights: list[list[float]]
    at: list[int]
    into: list[int]
    lrs: list[float]
    shrinks: list[float]
    feed: list[int]
    record: list[bool]


def step_arguments(steps: Sequence[Step], position: dict[int, int]) -> StepArguments:
    """The kernel's arguments of ``steps``, whose rows are the gathered minibatches
    ``position``."""

    def encoded(mixes: tuple[Mix, ...]) -> tuple[list[list[int]], list[float]]:
        ends = [m[:3] if len(m) == 4 else (m[0], m[1], -1) for m in mixes]
        return [list(e) for e in ends], [float(m[-1]) for m in mixes]

    before, after = zip(*(encoded(s.mixes) for s in steps), strict=True)
    later, later_weights = zip(*(encoded(s.after) for s in steps), strict=True)
    return StepArguments(
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
    )


def _program(
    has_head: bool,
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
    centroid_targets: list[Tensor],
    centroid_rows: list[Tensor],
    anchor: Tensor,
    linear: Tensor,
    ones: Tensor,
    label_mask: Tensor,
    masked: bool,
    lowest_logit: float,
    lowest: int,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """The steps of a plain-layer model whose last layer is a linear head (TorchScript-compatible).

    Without ``has_head``, the last layer is the body's and the loss has no cross-entropy. Per
    layer ``i``: ``kinds[i]``, integer ``settings[i]``, and ``flags[i] = [has bias, weight
    trained, bias trained]``; point ``p``'s layers are ``weights[p][i]`` / ``biases[p][i]``
    (empty when absent; linear body layers' weights transposed, ``W^T``, contiguous), its trained
    tensors views of ``flats[p]`` (flats past the points: vectors that only mixes read). Step
    ``j`` mixes the flats (:func:`_mix`), runs :func:`~pflego.fused_passes.forward_pass` at point
    ``at[j]`` on minibatch ``feed[j]`` and :func:`~pflego.fused_passes.backward_pass` into point
    ``into[j]`` (``t <- shrinks[j] t - lrs[j] g``), then mixes the flats again. Per minibatch: its
    input, ``-onehot(y)^T * mask / n``, ``mask / n`` and, for the alignment term (empty without
    one), its rows' centroids ``c`` ``[B, M]`` and ``2 w = 2 centroid_weights[y] mask / n``
    ``[B, 1]``: the term adds ``2 w (a - c)`` to the gradient in the head's input ``a``. The head
    computes transposed logits ``W a^T``: with 10-row minibatches and 10-class heads, these are
    the layouts whose matrix products run fastest. Returns each step's log-probabilities ``[K,
    B]``; for the steps with ``record``, the squared norm of point ``into[j]`` after the update;
    and, at point ``at[j]`` before the step, ``||flat - anchor||^2``, ``<linear, flat>`` (each
    empty, with ``anchor`` / ``linear`` laid out like the flats, when absent) and ``sum 2 w ||a -
    c||^2`` (empty without an alignment term).
    """
    log_probs: list[Tensor] = []
    norms: list[Tensor] = []
    distances: list[Tensor] = []
    dots: list[Tensor] = []
    alignments: list[Tensor] = []
    scratch = torch.empty_like(anchor)
    for j in range(len(at)):
        _mix(flats, mixes[j], mix_weights[j])
        r, p, q = feed[j], at[j], into[j]
        if anchor.numel() > 0:  # into a buffer kept across steps: no allocation per step
            difference = torch.sub(flats[p], anchor, out=scratch)
            distances.append(torch.dot(difference, difference))
        if linear.numel() > 0:
            dots.append(torch.dot(linear, flats[p]))
        a, log_p, grad_t, saved, indices, shapes = forward_pass(
            has_head, kinds, settings, weights[p], biases[p], flags, inputs[r],
            negative_target[r], weight_rows[r], label_mask, masked, lowest_logit,
        )  # fmt: skip
        log_probs.append(log_p)
        feature_grad = centroid_rows[r]  # empty without an alignment term
        if feature_grad.numel() > 0:
            gap = a - centroid_targets[r]
            feature_grad = gap * feature_grad
            alignments.append(torch.dot(gap.flatten(), feature_grad.flatten()))
        backward_pass(
            has_head, kinds, settings, weights[p], biases[p], weights[q], biases[q], flags, saved,
            indices, shapes, a, grad_t, feature_grad, ones, lrs[j], shrinks[j], lowest,
        )  # fmt: skip
        _mix(flats, after[j], after_weights[j])
        if record[j]:
            norms.append(torch.dot(flats[q], flats[q]))
    return log_probs, norms, distances, dots, alignments


def _mix(flats: list[Tensor], mixes: list[list[int]], weights: list[float]) -> None:
    """The mixes ``[dst, start, end]`` (``end`` -1: ``dst += weight start``) with their
    ``weights`` on the flats, in place (TorchScript-compatible)."""
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
