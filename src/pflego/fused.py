"""Fused SGD steps: local training on a declared loss without autograd.

For a :class:`~pflego.local.ModelLoss` whose model is a sequence of ``Linear``, ``Conv2d``,
``ReLU``, ``MaxPool2d`` and ``Flatten`` layers with a linear head, and for plain SGD (optionally
with weight decay), every local step is one forward pass that keeps the activations it needs and
one backward pass that applies each layer's update as soon as the gradient below it is taken:

    W <- (1 - lr (strength + weight_decay)) W + lr strength anchor + lr linear - lr g^T a

with the last product folded into the weight-gradient GEMM (``W.addmm_(g^T, a, alpha=-lr)``), so
no gradient tensor is materialized and no graph is built. The minibatches of all steps are
gathered in one indexing operation. The result equals ``train_steps``'s autograd path up to
floating-point rounding (the tests check float64 runs to 1e-10).

A step whose batch is empty is skipped, as the autograd path's masked update does. Anything else
(another optimizer, another layer, an input that requires grad or runs under a ``torch.func``
transform) returns ``None`` from :func:`fused_sgd_steps`, and the caller uses autograd.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from pflego.loss import ModelLoss
from pflego.models import Layer
from pflego.optim import SGD, Optimizer
from pflego.tree import Params
from pflego.types import ClientData

HEAD = (Layer("linear", "head"),)


def layer_plan(loss: ModelLoss) -> tuple[Layer, ...] | None:
    """The model's plain layers in forward order with its head, or ``None`` if it has others."""
    if loss.model is None:
        return HEAD
    body = loss.model.layers
    return None if body is None else body + HEAD


def _plain(tensors: Sequence[Tensor]) -> bool:
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
    """``train_steps`` for plain SGD on a :class:`ModelLoss`, or ``None`` when it does not apply.

    Returns:
        The trained parameters (new tensors) and the mean loss over the real steps.
    """
    if not isinstance(loss, ModelLoss) or type(optimizer) is not SGD:
        return None
    plan = layer_plan(loss)
    if plan is None:
        return None
    full = {**loss.fixed, **params}
    names = {
        name for layer in plan if layer.kind in ("linear", "conv") for name in _keys(layer, full)
    }
    regularizers = [t for t in (loss.anchor, loss.linear) if t is not None]
    weights = {layer.weight for layer in plan if layer.kind in ("linear", "conv")}
    if (
        set(full) != names
        or not weights <= names
        or not params
        or any(not set(params) <= set(t) for t in regularizers)
        or not _plain([*full.values(), data.x, data.batches, data.batch_mask])
        or not _plain([v for t in regularizers for v in t.values()])
        or not _plain([] if loss.sample_weights is None else [loss.sample_weights])
        or not _fits(plan, data.x.shape[1:])
        or "head.weight" not in full
    ):
        return None
    return _run(plan, loss, params, data, optimizer.weight_decay, float(lr), steps)


def _keys(layer: Layer, params: Params) -> list[str]:
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


def _run(
    plan: tuple[Layer, ...],
    loss: ModelLoss,
    params: Params,
    data: ClientData,
    weight_decay: float,
    lr: float,
    steps: slice,
) -> tuple[Params, Tensor]:
    trained = {k: v.clone() for k, v in params.items()}
    full = {**loss.fixed, **trained}
    batches, batch_mask = data.batches[steps], data.batch_mask[steps]
    real = torch.nonzero(batch_mask.sum(1) > 0).flatten()  # empty steps change nothing
    total, count = torch.zeros(()), torch.zeros(())
    if len(real) == 0:
        return trained, total / count.clamp(min=1)
    batches, batch_mask = batches[real], batch_mask[real]
    weights = batch_mask / batch_mask.sum(1, keepdim=True).clamp(min=1)  # [S, B]: mask / n_s
    if loss.sample_weights is not None:  # [S, B]: w_idx * mask / n_s
        weights = weights * loss.sample_weights[batches]
    first = _first_linear(plan)
    if batches.shape[-1] == data.x.shape[0]:  # full batch: every step is the whole local set
        inputs = [data.x] * len(batches)
        inputs_t = [data.x.flatten(1).t().contiguous()] * len(batches) if first >= 0 else []
        labels = data.y.expand(len(batches), -1)
    else:  # every step's minibatch, gathered once
        gathered = data.x[batches]
        inputs = list(gathered.unbind(0))
        inputs_t = (
            list(gathered.flatten(2).transpose(1, 2).contiguous().unbind(0)) if first >= 0 else []
        )
        labels = data.y[batches]
    # the head works on transposed logits [K, B]: products with a few outputs run fastest so
    target = F.one_hot(labels, full["head.weight"].shape[0]).to(weights.dtype).transpose(1, 2)
    target = target * weights.unsqueeze(1)  # [S, K, B]: onehot(y) * mask / n_s
    label_mask = loss.label_mask > 0
    empty = data.x.new_empty(0)

    def coefficients(table: Params | None) -> list[Tensor]:
        """A regularizer's coefficients per layer (weight, bias), in the kernel's layout."""
        table = table or {}
        out = []
        for layer in plan:
            w = table.get(layer.weight, empty)
            transposed = layer.kind == "linear" and layer.key != "head" and w.numel()
            out += [w.t() if transposed else w, table.get(layer.bias, empty)]
        return out

    strength = float(loss.strength) if loss.anchor is not None else 0.0
    with torch.jit.optimized_execution(False):  # the same plain interpreter for every call
        log_probs, regularizers = _compiled()(
            [layer.kind for layer in plan],
            [_settings(layer) for layer in plan],
            [full.get(layer.weight, empty) for layer in plan],
            [full.get(layer.bias, empty) for layer in plan],
            [
                [layer.bias in full, layer.weight in trained, layer.bias in trained]
                for layer in plan
            ],
            coefficients(loss.anchor),
            coefficients(loss.linear),
            inputs,
            inputs_t,
            first,
            list((-target).unbind(0)),
            list(weights.unsqueeze(1).unbind(0)),
            weights.new_ones(weights.shape[1]),
            label_mask.unsqueeze(1),
            not bool(label_mask.all()),
            torch.finfo(target.dtype).min,
            lr,
            1 - lr * (strength + weight_decay),
            strength,
            loss.anchor is not None,
            loss.linear is not None,
            min(i for i, layer in enumerate(plan) if set(_keys(layer, trained))),
        )
    values = -(torch.stack(log_probs) * target).sum((1, 2))  # each step's cross-entropy
    if regularizers:
        values = values + torch.stack(regularizers)
    return trained, (total + values.sum()) / (count + len(values))


def _first_linear(plan: tuple[Layer, ...]) -> int:
    """The linear layer that reads the (flattened) input directly, or -1."""
    for i, layer in enumerate(plan):
        if layer.kind == "linear":
            return i
        if layer.kind not in ("flatten", "identity"):
            return -1
    return -1


def _settings(layer: Layer) -> list[int]:
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


_scripted: list = []


def _compiled():
    """The step loop compiled with TorchScript (its interpreter releases the GIL and has little
    per-operation overhead), or the same Python function when TorchScript is unavailable."""
    if not _scripted:
        try:
            with warnings.catch_warnings():  # deprecated in favour of torch.compile, whose
                warnings.simplefilter("ignore", DeprecationWarning)  # calls cost far more here
                _scripted.append(torch.jit.script(_steps))
        except Exception:  # noqa: BLE001  (any failure to compile falls back to eager Python)
            _scripted.append(_steps)
    return _scripted[0]


def _steps(
    kinds: list[str],
    settings: list[list[int]],
    weights: list[Tensor],
    biases: list[Tensor],
    flags: list[list[bool]],
    anchors: list[Tensor],
    linears: list[Tensor],
    inputs: list[Tensor],
    inputs_t: list[Tensor],
    first: int,
    negative_target: list[Tensor],
    weight_rows: list[Tensor],
    ones: Tensor,
    label_mask: Tensor,
    masked: bool,
    lowest_logit: float,
    lr: float,
    shrink: float,
    strength: float,
    use_anchor: bool,
    use_linear: bool,
    lowest: int,
) -> tuple[list[Tensor], list[Tensor]]:
    """SGD steps of a plain-layer model whose last layer is a linear head, updating ``weights``
    and ``biases`` in place.

    TorchScript-compatible. Per layer ``i``: ``kinds[i]``, integer ``settings[i]``,
    ``weights[i]`` / ``biases[i]`` (empty when absent), ``flags[i] = [has bias, weight trained,
    bias trained]`` and, at ``2 i`` and ``2 i + 1``, the anchor and linear coefficients of its
    weight (transposed for linear body layers) and bias. Per step: its input (and, for the
    linear layer ``first`` that reads it, its transpose), ``-onehot(y)^T * mask / n`` and
    ``mask / n``. Linear body layers are trained transposed (``W^T``, contiguous) and copied back
    at the end; the head computes transposed logits ``W a^T``. With 10-row minibatches and
    10-class heads, these are the layouts whose matrix products run fastest. Returns each step's
    log-probabilities ``[K, B]`` and the proximal and linear terms' value before the step.
    """
    layers = len(kinds)
    head = layers - 1
    params: list[Tensor] = []
    for i in range(layers):
        body_linear = kinds[i] == "linear" and i < head
        params.append(weights[i].t().contiguous() if body_linear else weights[i])
    log_probs: list[Tensor] = []
    regularizers: list[Tensor] = []
    for s in range(len(inputs)):
        if use_anchor or use_linear:
            value = torch.zeros((), dtype=inputs[s].dtype)
            for i in range(layers):
                for j in range(2):
                    p = params[i] if j == 0 else biases[i]
                    if flags[i][1 + j] and use_anchor:
                        value = value + strength / 2 * ((p - anchors[2 * i + j]) ** 2).sum()
                    if flags[i][1 + j] and use_linear:
                        value = value - (linears[2 * i + j] * p).sum()
            regularizers.append(value)
        saved: list[Tensor] = []
        indices: list[Tensor] = []
        shapes: list[list[int]] = []
        a = inputs[s]
        for i in range(head):
            kind, setting = kinds[i], settings[i]
            saved.append(a)
            indices.append(a)
            shapes.append(a.size())
            if kind == "linear":
                a = torch.addmm(biases[i], a, params[i]) if flags[i][0] else torch.mm(a, params[i])
            elif kind == "conv":
                bias: Tensor | None = None
                if flags[i][0]:
                    bias = biases[i]
                a = torch.conv2d(a, params[i], bias, setting[0:2], setting[2:4], setting[4:6], 1)
            elif kind == "relu":
                a = torch.relu(a)
                saved[i] = a  # its backward reads the output
            elif kind == "maxpool":
                a, where = torch.ops.aten.max_pool2d_with_indices(
                    a, setting[0:2], setting[2:4], setting[4:6], setting[6:8], setting[8] == 1
                )
                indices[i] = where
            elif kind == "flatten":
                a = a.flatten(setting[0], setting[1])
        logits = torch.mm(params[head], a.t())  # [K, B]
        if flags[head][0]:
            logits = logits + biases[head].unsqueeze(1)
        if masked:
            logits = logits.masked_fill(~label_mask, lowest_logit)
        log_p = torch.log_softmax(logits, 0)
        log_probs.append(log_p)
        grad_t = torch.addcmul(negative_target[s], log_p.exp(), weight_rows[s])  # dL/dlogits^T
        grad = grad_t
        if head > lowest:
            grad = torch.mm(grad_t.t(), params[head])  # before this step's update
        if flags[head][1]:
            p = _regularize(params[head], anchors[2 * head], linears[2 * head], lr, shrink, strength, use_anchor, use_linear)  # fmt: skip
            p.addmm_(grad_t, a, beta=1.0, alpha=-lr)
        if flags[head][2]:
            p = _regularize(biases[head], anchors[2 * head + 1], linears[2 * head + 1], lr, shrink, strength, use_anchor, use_linear)  # fmt: skip
            p.addmv_(grad_t, ones, beta=1.0, alpha=-lr)
        for i in range(head - 1, lowest - 1, -1):
            kind, setting, keep, below = kinds[i], settings[i], saved[i], i > lowest
            if kind == "linear":
                grad_in = grad
                if below:
                    grad_in = torch.mm(grad, params[i].t())  # before this step's update
                if flags[i][1]:
                    left = inputs_t[s] if i == first else keep.t()
                    p = _regularize(params[i], anchors[2 * i], linears[2 * i], lr, shrink, strength, use_anchor, use_linear)  # fmt: skip
                    p.addmm_(left, grad, beta=1.0, alpha=-lr)
                if flags[i][2]:
                    p = _regularize(biases[i], anchors[2 * i + 1], linears[2 * i + 1], lr, shrink, strength, use_anchor, use_linear)  # fmt: skip
                    p.addmv_(grad.t(), ones, beta=1.0, alpha=-lr)
                grad = grad_in
            elif kind == "conv":
                bias_sizes: list[int] | None = None
                if flags[i][0]:
                    bias_sizes = [params[i].size(0)]
                grad_in, grad_w, grad_b = torch.ops.aten.convolution_backward(
                    grad,
                    keep,
                    params[i],
                    bias_sizes,
                    setting[0:2],
                    setting[2:4],
                    setting[4:6],
                    False,
                    [0, 0],
                    1,
                    [below, flags[i][1], flags[i][2]],
                )
                if flags[i][1]:
                    p = _regularize(params[i], anchors[2 * i], linears[2 * i], lr, shrink, strength, use_anchor, use_linear)  # fmt: skip
                    p.add_(grad_w, alpha=-lr)
                if flags[i][2]:
                    p = _regularize(biases[i], anchors[2 * i + 1], linears[2 * i + 1], lr, shrink, strength, use_anchor, use_linear)  # fmt: skip
                    p.add_(grad_b, alpha=-lr)
                grad = grad_in
            elif kind == "relu":
                grad = torch.ops.aten.threshold_backward(grad, keep, 0.0)
            elif kind == "maxpool":
                grad = torch.ops.aten.max_pool2d_with_indices_backward(
                    grad, keep, setting[0:2], setting[2:4], setting[4:6], setting[6:8], setting[8] == 1, indices[i]
                )  # fmt: skip
            elif kind == "flatten":
                grad = grad.reshape(shapes[i])
    for i in range(head):
        if kinds[i] == "linear" and flags[i][1]:
            weights[i].copy_(params[i].t())
    return log_probs, regularizers


def _regularize(
    p: Tensor,
    anchor: Tensor,
    linear: Tensor,
    lr: float,
    shrink: float,
    strength: float,
    use_anchor: bool,
    use_linear: bool,
) -> Tensor:
    """``p`` after this step's weight decay, proximal pull and linear push (in place)."""
    if shrink != 1.0:
        p.mul_(shrink)
    if use_anchor and strength != 0.0:
        p.add_(anchor, alpha=lr * strength)
    if use_linear:
        p.add_(linear, alpha=lr)
    return p
