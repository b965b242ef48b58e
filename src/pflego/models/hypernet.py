"""A server-side hypernetwork as pure functions of a flat parameter dict (pFedHN, pFedLA).

An embedding v ``[..., e]`` goes through a trunk, ``Linear(e, h)`` then ``hidden_layers`` blocks
``ReLU -> Linear(h, h)``, to features f ``[..., h]``; one linear output layer per named target maps
f to that target. Parameters are ``<prefix>in.*``, ``<prefix>hidden.<j>.*`` and
``<prefix>out.<name>.*``, initialized as ``nn.Linear`` is (U(-1/sqrt(fan_in), 1/sqrt(fan_in))
weights and biases) from a seeded generator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pflego import tree
from pflego.models.split import SplitModel
from pflego.tree import Params


def init_hypernetwork(
    prefix: str,
    embedding_dim: int,
    hidden_dim: int,
    hidden_layers: int,
    outputs: dict[str, int],
    gen: torch.Generator,
    like: Tensor,
) -> Params:
    """The trunk and one output layer of ``outputs[name]`` units per target, drawn from ``gen``
    in that order (weight, then bias, of each layer) in float32 and cast to ``like``'s dtype."""
    layers = [("in", hidden_dim, embedding_dim)]
    layers += [(f"hidden.{j}", hidden_dim, hidden_dim) for j in range(hidden_layers)]
    layers += [(f"out.{name}", units, hidden_dim) for name, units in outputs.items()]
    return init_linear([(prefix + name, *sizes) for name, *sizes in layers], gen, like)


def init_linear(layers: list[tuple[str, int, int]], gen: torch.Generator, like: Tensor) -> Params:
    """``nn.Linear``'s initialization of each ``(name, fan_out, fan_in)``, in order: weights and
    biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn in float32 from ``gen``, cast as ``like``."""
    params = {}
    for name, fan_out, fan_in in layers:
        bound = 1 / math.sqrt(fan_in)
        for part, shape in (("weight", (fan_out, fan_in)), ("bias", (fan_out,))):
            draw = torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1
            params[f"{name}.{part}"] = (bound * draw).to(like)
    return params


def target_shapes(model: SplitModel) -> dict[str, tuple[int, ...]]:
    """The entries of ``model``'s body and of a C-way head, with their shapes: what a
    hypernetwork generates (pFedHN, PeFLL)."""
    body = {f"body.{k}": tuple(v.shape) for k, v in model.body.named_parameters()}
    return {
        **body,
        "head.weight": (model.num_classes, model.feature_dim),
        "head.bias": (model.num_classes,),
    }


def generate(
    hyper: Params,
    prefix: str,
    embeddings: Tensor,
    shapes: dict[str, tuple[int, ...]],
    hidden_layers: int,
) -> Params:
    """theta = h(v; phi) for embeddings ``[..., e]``: the trunk's features through the output
    layer of each target entry, reshaped to ``[..., *shape]``."""
    f = trunk(hyper, prefix, embeddings, hidden_layers)
    out = {
        k: f @ hyper[f"{prefix}out.{k}.weight"].T + hyper[f"{prefix}out.{k}.bias"] for k in shapes
    }
    return {k: out[k].reshape(*embeddings.shape[:-1], *shape) for k, shape in shapes.items()}


def trunk(hyper: Params, prefix: str, embeddings: Tensor, hidden_layers: int) -> Tensor:
    """The features f ``[..., h]`` of embeddings ``[..., e]`` (no ReLU after the last layer)."""
    f = embeddings @ hyper[prefix + "in.weight"].T + hyper[prefix + "in.bias"]
    for j in range(hidden_layers):
        w, b = hyper[f"{prefix}hidden.{j}.weight"], hyper[f"{prefix}hidden.{j}.bias"]
        f = torch.relu(f) @ w.T + b
    return f


def momentum_step(
    params: Params,
    grads: Params,
    momentum: Params,
    lr: float,
    beta: float,
    weight_decay: float = 0.0,
    max_grad_norm: float = math.inf,
) -> tuple[Params, Params]:
    """One step of ``torch.optim.SGD`` (momentum ``beta``, ``weight_decay``) on the gradient
    clipped to ``max_grad_norm`` as ``clip_grad_norm_`` does; returns the parameters and the
    momentum buffers."""
    norm = tree.sq_norm(grads).sqrt()
    grads = tree.scale(grads, (max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
    steps = {k: g + weight_decay * params[k] for k, g in grads.items()}
    buffers = {k: beta * momentum[k] + s for k, s in steps.items()}
    return {k: params[k] - lr * b for k, b in buffers.items()}, buffers
