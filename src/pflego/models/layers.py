"""A body of plain layers run as pure functions of a flat parameter dict.

A body made only of ``nn.Sequential`` containers around linear, 2-D convolution, ReLU, 2-D
max-pooling, flatten, identity and batch-norm layers parses into a tuple of :class:`Layer`; its
forward pass then runs as plain ``torch.nn.functional`` calls on the ``body.*`` parameters, without
touching the modules' own tensors (thread-safe, vmappable), with exact or near-exact shortcuts for
evaluation.

Batch norm is functional too: its running statistics are entries of the parameter dict
(``<layer>.running_mean`` / ``<layer>.running_var``, never the module's buffers). With them a
batch-norm layer normalizes as in evaluation mode; without them, by the statistics of the batch,
over the rows where ``mask`` is 1 (padding rows of ragged clients left out), as in training mode,
and records those statistics in ``stats`` when given (how FedBN tracks its running statistics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pflego.tree import Params


@dataclass(frozen=True)
class Layer:
    """One plain layer of a body: its kind, parameter prefix and module (for its settings).

    Kinds: ``linear``, ``conv`` (2-D, one group, zero padding), ``relu``, ``maxpool`` (2-D),
    ``flatten``, ``identity`` and ``batchnorm`` (1-D or 2-D, affine).
    """

    kind: str
    key: str
    module: nn.Module | None = None

    @property
    def weight(self) -> str:
        return f"{self.key}.weight"

    @property
    def bias(self) -> str:
        return f"{self.key}.bias"

    def pool_settings(self) -> tuple:
        """A max-pool's kernel, stride, padding, dilation (pairs) and ceil mode."""
        m = self.module
        pair = lambda v: list(v) if isinstance(v, tuple) else [v, v]  # noqa: E731
        stride = m.stride if m.stride is not None else m.kernel_size
        return pair(m.kernel_size), pair(stride), pair(m.padding), pair(m.dilation), m.ceil_mode


LAYER_KINDS = {
    nn.Linear: "linear",
    nn.Conv2d: "conv",
    nn.ReLU: "relu",
    nn.MaxPool2d: "maxpool",
    nn.Flatten: "flatten",
    nn.Identity: "identity",
    nn.BatchNorm1d: "batchnorm",
    nn.BatchNorm2d: "batchnorm",
}

#: A batch-norm layer's statistics of one batch: mean and biased variance per channel ``[C]``, and
#: the number of elements per channel they were taken over (real rows times spatial positions).
BatchStats = tuple[Tensor, Tensor, Tensor]


def parse_layers(body: nn.Module) -> tuple[Layer, ...] | None:
    """``body`` (nested ``nn.Sequential`` of plain layers) in forward order, else ``None``."""
    layers = []
    for name, module in body.named_modules(remove_duplicate=False):  # a lone layer: ("", body)
        if type(module) is nn.Sequential:
            continue
        kind = LAYER_KINDS.get(type(module))
        if kind is None or not _plain_settings(module):
            return None
        layers.append(Layer(kind, f"body.{name}" if name else "body", module))
    return tuple(layers)


def _plain_settings(module: nn.Module) -> bool:
    if isinstance(module, nn.Conv2d):
        return (
            module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
    if isinstance(module, nn.MaxPool2d):
        return not module.return_indices
    if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
        return module.affine
    return True


def apply_layers(
    layers: tuple[Layer, ...],
    params: Params,
    x: Tensor,
    mask: Tensor | None = None,
    stats: dict[str, BatchStats] | None = None,
) -> Tensor:
    """The body's forward pass as pure functions of ``params`` (what the modules compute).

    ``mask`` (``[batch]``, 1 for real rows) and ``stats`` concern batch-norm layers only (see the
    module's docstring); other layers ignore them.

    Without autograd (evaluation), four exact or near-exact shortcuts apply: ReLU in place on
    intermediate results, max-pooling without padding as maxima of strided slices (the same
    values, up to ten times faster than ``max_pool2d`` on CPU), a convolution over very few
    input elements per output (a grayscale first layer: ``C_in * k_h * k_w <= 16``) as one
    product of unfolded patches, which runs several times faster than oneDNN's kernel for it (the
    same sums in another order), and other convolutions on :func:`channels_last` inputs (outside
    ``torch.func`` transforms), which oneDNN runs faster (a 5x5 grayscale first layer over
    hundreds of rows: seven times).
    """
    inference = not torch.is_grad_enabled()
    if inference and _per_element(layers, params, x):
        keys = [k for layer in layers for k in (layer.weight, layer.bias) if k in params]
        return _plain_layers(_plan_id(layers, keys), x, [params[k] for k in keys])
    return _forward(layers, params, x, mask, stats, inference)


def _forward(
    layers: tuple[Layer, ...],
    params: Params,
    x: Tensor,
    mask: Tensor | None,
    stats: dict[str, BatchStats] | None,
    inference: bool,
) -> Tensor:
    """:func:`apply_layers`'s layers, one after another."""
    owned = False  # whether x is an intermediate result this function may overwrite
    for layer in layers:
        m = layer.module
        if layer.kind == "linear":
            x, owned = F.linear(x, params[layer.weight], params.get(layer.bias)), True
        elif layer.kind == "conv":
            weight, bias = params[layer.weight], params.get(layer.bias)
            if inference and weight[0].numel() <= 16 and x.dim() == 4:
                x = _conv_by_unfold(x, weight, bias, m)
            elif inference and x.dim() == 4 and not _wrapped(x):
                x = F.conv2d(_as_channels_last(x), weight, bias, m.stride, m.padding, m.dilation)
            else:
                x = F.conv2d(x, weight, bias, m.stride, m.padding, m.dilation)
            owned = True
        elif layer.kind == "relu":
            x = x.relu_() if inference and owned else torch.relu(x)
            owned = True
        elif layer.kind == "maxpool":
            kernel, stride, padding, dilation, ceil_mode = layer.pool_settings()
            plain = padding == [0, 0] and dilation == [1, 1] and not ceil_mode
            if inference and plain:
                x = _strided_max(x, kernel, stride)
            else:
                x = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
            owned = True
        elif layer.kind == "flatten":
            x = x.flatten(m.start_dim, m.end_dim)
        elif layer.kind == "batchnorm":
            x, owned = _batch_norm(layer, params, x, mask, stats), True
    return x


def _per_element(layers: tuple[Layer, ...], params: Params, x: Tensor) -> bool:
    """Whether a convolutional body without batch norm runs on CPU under ``torch.func.vmap``
    (its inputs wrapped): then :func:`_plain_layers` runs it one batch element at a time."""
    kinds = {layer.kind for layer in layers}
    return (
        x.device.type == "cpu"
        and "conv" in kinds
        and "batchnorm" not in kinds
        and (_wrapped(x) or any(_wrapped(v) for v in params.values()))
    )


#: The bodies :func:`_plain_layers` has run: each one's layers and parameter names, by number.
_plans: list[tuple[tuple[Layer, ...], tuple[str, ...]]] = []
_plan_ids: dict[tuple[tuple[Layer, ...], tuple[str, ...]], int] = {}


def _plan_id(layers: tuple[Layer, ...], keys: list[str]) -> int:
    plan = (layers, tuple(keys))
    if plan not in _plan_ids:
        _plan_ids[plan] = len(_plans)
        _plans.append(plan)
    return _plan_ids[plan]


@torch.library.custom_op("pflego::plain_layers", mutates_args=())
def _plain_layers(plan: int, x: Tensor, tensors: list[Tensor]) -> Tensor:
    """:func:`apply_layers` in evaluation, as an operator whose ``vmap`` rule loops over the
    batch: each element's convolutions then run on channels-last inputs, over activations that
    stay in cache, where vmap's own rule (grouped convolutions over ``NCHW`` activations of the
    whole batch) runs the PGFed CNN's per-client evaluation 2.5 times slower."""
    layers, keys = _plans[plan]
    with torch.no_grad():
        return _forward(layers, dict(zip(keys, tensors)), x, None, None, inference=True)


@_plain_layers.register_vmap
def _plain_layers_per_element(
    info: object, in_dims: tuple, plan: int, x: Tensor, tensors: list[Tensor]
) -> tuple[Tensor, int]:
    _, x_dim, dims = in_dims
    if all(d is None for d in dims):  # a shared body: the batch's rows as one batch
        rows = x.movedim(x_dim, 0)
        out = _plain_layers(plan, rows.flatten(0, 1), tensors)
        return out.unflatten(0, rows.shape[:2]), 0
    pick = lambda t, d, i: t if d is None else t.select(d, i)  # noqa: E731
    outs = [
        _plain_layers(plan, pick(x, x_dim, i), [pick(t, d, i) for t, d in zip(tensors, dims)])
        for i in range(info.batch_size)
    ]
    return torch.stack(outs), 0


def _wrapped(x: Tensor) -> bool:
    """Whether ``x`` is wrapped by a ``torch.func`` transform (whose layouts are its own)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


def _as_channels_last(x: Tensor) -> Tensor:
    """``x`` stored channels-last (itself when it is, strides included)."""
    stored = x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last)
    return x if stored else channels_last(x)


def _batch_norm(
    layer: Layer,
    params: Params,
    x: Tensor,
    mask: Tensor | None,
    stats: dict[str, BatchStats] | None,
) -> Tensor:
    """Batch norm over channel dim 1: by the running statistics in ``params``, else by the
    masked batch's (biased variance, as ``nn.BatchNorm`` in training mode)."""
    channel = (1, -1) + (1,) * (x.dim() - 2)
    mean_key, var_key = f"{layer.key}.running_mean", f"{layer.key}.running_var"
    if mean_key in params:
        mean, var = params[mean_key], params[var_key]
    else:
        dims = [0, *range(2, x.dim())]
        rows = torch.ones_like(x[:, 0]) if mask is None else mask.to(x.dtype)
        rows = rows.reshape(x.shape[0], *(1,) * (x.dim() - 1))
        count = (rows.sum() * x[0, 0].numel()).clamp(min=1)  # an all-padding batch: no NaN
        mean = (x * rows).sum(dims) / count
        var = ((x - mean.reshape(channel)) ** 2 * rows).sum(dims) / count
        if stats is not None:
            stats[layer.key] = (mean, var, count)
    x = (x - mean.reshape(channel)) * torch.rsqrt(var.reshape(channel) + layer.module.eps)
    return x * params[layer.weight].reshape(channel) + params[layer.bias].reshape(channel)


def channels_last(x: Tensor) -> Tensor:
    """``x`` (``[..., C, H, W]``) with its channels stored last, its strides saying so even for
    one channel (where both layouts are the same memory, and oneDNN would take ``NCHW``).

    On CPU, convolutions of channels-last inputs return channels-last outputs, on which
    max-pooling runs an order of magnitude faster than on ``NCHW`` (and with indices), and a
    one-channel first convolution over more than a few dozen rows several times faster.
    """
    channels, width = x.shape[-3], x.shape[-1]
    stored = x.movedim(-3, -1).contiguous()  # [..., H, W, C]
    lead = list(stored.stride()[:-3])
    return stored.as_strided(x.shape, [*lead, 1, width * channels, channels])


def _conv_by_unfold(x: Tensor, weight: Tensor, bias: Tensor | None, m: nn.Conv2d) -> Tensor:
    batch, (height, width) = x.shape[0], x.shape[-2:]
    cols = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)  # [B, C k k, L]
    kernel = weight.reshape(1, weight.shape[0], -1).expand(batch, -1, -1)
    if bias is None:
        out = torch.bmm(kernel, cols)  # [B, C_out, L]
    else:
        out = torch.baddbmm(bias.reshape(1, -1, 1), kernel, cols)
    sizes = [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, p, d, k, s in zip((height, width), m.padding, m.dilation, m.kernel_size, m.stride)
    ]
    return out.reshape(batch, weight.shape[0], *sizes)


def _strided_max(x: Tensor, kernel: list[int], stride: list[int]) -> Tensor:
    """Max-pooling without padding or dilation, as maxima of strided slices."""
    for dim, k, s in ((x.dim() - 2, kernel[0], stride[0]), (x.dim() - 1, kernel[1], stride[1])):
        span = s * ((x.shape[dim] - k) // s) + 1  # from the first to the last window's start
        every = (slice(None),) * dim
        pooled = x[(*every, slice(0, span, s))]
        for offset in range(1, k):
            pooled = torch.maximum(pooled, x[(*every, slice(offset, offset + span, s))])
        x = pooled
    return x
