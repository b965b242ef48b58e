"""The forward and backward passes of a fused step (TorchScript-compatible).

:func:`forward_pass` runs a plain-layer model with a linear head on one minibatch, keeping what the
backward pass reads; :func:`backward_pass` takes the loss's gradient back through the layers and
applies each layer's SGD update as soon as the gradient below it is taken, folded into the
weight-gradient GEMM. The kernel of :mod:`pflego.fused` (a step program's steps, whose gradients
may be taken at one point and update another) loops over them, and :func:`compiled` compiles it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

_scripted: dict[Callable, Callable] = {}


def compiled(loop: Callable) -> Callable:
    """``loop`` compiled with TorchScript, once (its interpreter releases the GIL and has little
    per-operation overhead), or ``loop`` itself when TorchScript is unavailable."""
    if loop not in _scripted:
        try:
            with warnings.catch_warnings():  # deprecated in favour of torch.compile, whose
                warnings.simplefilter("ignore", DeprecationWarning)  # calls cost far more here
                _scripted[loop] = torch.jit.script(loop)
        except Exception:  # noqa: BLE001  (any failure to compile falls back to eager Python)
            _scripted[loop] = loop
    return _scripted[loop]


def forward_pass(
    has_head: bool,
    kinds: list[str],
    settings: list[list[int]],
    params: list[Tensor],
    biases: list[Tensor],
    flags: list[list[bool]],
    a: Tensor,
    negative_target: Tensor,
    weight_row: Tensor,
    label_mask: Tensor,
    masked: bool,
    lowest_logit: float,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor], list[list[int]]]:
    """One step's forward pass (the arguments as in :func:`pflego.fused._program`): the head's
    input, the log-probabilities ``[K, B]``, the loss's gradient in the transposed logits, and
    what the backward pass reads (each layer's kept input or output, pooling indices and input
    shapes). Without ``has_head``, every layer is the body's, and the log-probabilities and
    their gradient are empty."""
    head = len(kinds) - 1 if has_head else len(kinds)
    saved: list[Tensor] = []
    indices: list[Tensor] = []
    shapes: list[list[int]] = []
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
    if not has_head:
        return a, a[:0], a[:0], saved, indices, shapes
    logits = torch.mm(params[head], a.t())  # [K, B]
    if flags[head][0]:
        logits = logits + biases[head].unsqueeze(1)
    if masked:
        logits = logits.masked_fill(~label_mask, lowest_logit)
    log_p = torch.log_softmax(logits, 0)
    grad_t = torch.addcmul(negative_target, log_p.exp(), weight_row)  # dL/dlogits^T
    return a, log_p, grad_t, saved, indices, shapes


def backward_pass(
    has_head: bool,
    kinds: list[str],
    settings: list[list[int]],
    params: list[Tensor],
    biases: list[Tensor],
    targets: list[Tensor],
    target_biases: list[Tensor],
    flags: list[list[bool]],
    saved: list[Tensor],
    indices: list[Tensor],
    shapes: list[list[int]],
    a: Tensor,
    grad_t: Tensor,
    feature_grad: Tensor,
    ones: Tensor,
    lr: float,
    shrink: float,
    lowest: int,
) -> None:
    """One step's backward pass from :func:`forward_pass`'s results: the
    gradient taken at ``params`` / ``biases`` updates ``targets`` / ``target_biases`` in place,
    ``t <- shrink t - lr g`` (the same lists for a plain SGD step; another point's for a step
    whose gradient is taken elsewhere). ``feature_grad``: the gradient of the loss's other terms
    in the head's input ``a`` (empty: none), added to the head's; without ``has_head``, the
    only gradient in the body's output ``a``."""
    head = len(kinds) - 1 if has_head else len(kinds)
    grad = feature_grad
    if has_head:
        grad = _head_backward(
            params[head], targets[head], target_biases[head], flags[head], a, grad_t,
            feature_grad, ones, lr, shrink, head > lowest,
        )  # fmt: skip
    for i in range(head - 1, lowest - 1, -1):
        kind, setting, keep, below = kinds[i], settings[i], saved[i], i > lowest
        if kind == "linear":
            grad_in = grad
            if below:
                grad_in = torch.mm(grad, params[i].t())  # before this step's update
            if flags[i][1]:
                targets[i].addmm_(keep.t(), grad, beta=shrink, alpha=-lr)
            if flags[i][2]:
                target_biases[i].addmv_(grad.t(), ones, beta=shrink, alpha=-lr)
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
                _shrunk(targets[i], shrink).add_(grad_w, alpha=-lr)
            if flags[i][2]:
                _shrunk(target_biases[i], shrink).add_(grad_b, alpha=-lr)
            grad = grad_in
        elif kind == "relu":
            grad = torch.ops.aten.threshold_backward(grad, keep, 0.0)
        elif kind == "maxpool":
            grad = torch.ops.aten.max_pool2d_with_indices_backward(
                grad, keep, setting[0:2], setting[2:4], setting[4:6], setting[6:8], setting[8] == 1, indices[i]
            )  # fmt: skip
        elif kind == "flatten":
            grad = grad.reshape(shapes[i])
            if keep.dim() == 4 and keep.is_contiguous(memory_format=torch.channels_last):
                grad = grad.contiguous(memory_format=torch.channels_last)  # as its input


def _head_backward(
    weight: Tensor,
    target: Tensor,
    target_bias: Tensor,
    flags: list[bool],
    a: Tensor,
    grad_t: Tensor,
    feature_grad: Tensor,
    ones: Tensor,
    lr: float,
    shrink: float,
    below: bool,
) -> Tensor:
    """The head's part of :func:`backward_pass`: its update from the gradient in the
    transposed logits ``grad_t``, and the gradient in its input ``a`` (with ``feature_grad``
    added) when a trained layer lies ``below``."""
    grad = grad_t
    if below:
        grad = torch.mm(grad_t.t(), weight)  # before this step's update
        if feature_grad.numel() > 0:
            grad.add_(feature_grad)
    if flags[1]:
        target.addmm_(grad_t, a, beta=shrink, alpha=-lr)
    if flags[2]:
        target_bias.addmv_(grad_t, ones, beta=shrink, alpha=-lr)
    return grad


def _shrunk(p: Tensor, shrink: float) -> Tensor:
    """``p`` scaled by ``shrink`` in place (weight decay and the proximal pull's shrinkage)."""
    if shrink != 1.0:
        p.mul_(shrink)
    return p
