"""The split model: a body mapping inputs to M features, and a linear head mapping them to logits.

Parameters live in one flat dict: ``body.<module path>`` for the body, ``head.weight`` and
``head.bias`` for a linear head (``logits = phi @ W.T + b``, the bias being W's folded-in column).
All functions are stateless (``torch.func.functional_call``) so they vmap over clients.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn
from torch.func import functional_call

from pflego.errors import ConfigError
from pflego.models.layers import BatchStats, Layer, apply_layers, parse_layers
from pflego.tree import Params


@dataclass
class SplitModel:
    """A body network and the size of the features it hands to a linear head.

    Attributes:
        body: Module mapping inputs to ``[batch, feature_dim]`` features; used statelessly.
        feature_dim: M, the width of the features.
        num_classes: C, the width of a head shared by all clients.
        max_local_classes: K_max, the width of a personal head over a client's own classes.
        name: Architecture name.
        input_shape: The shape of one input (without the batch axis); ``()`` where not known.
    """

    body: nn.Module
    feature_dim: int
    num_classes: int
    max_local_classes: int
    name: str = ""
    input_shape: tuple[int, ...] = ()

    def init_body(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """Freshly initialized body parameters (PyTorch's default initializers, seeded)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for module in self.body.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            return {
                f"body.{k}": v.detach().clone().to(dtype) for k, v in self.body.named_parameters()
            }

    @cached_property
    def layers(self) -> tuple[Layer, ...] | None:
        """The body as a sequence of plain layers, or ``None`` if it has other modules."""
        return parse_layers(self.body)

    def features(
        self,
        params: Params,
        x: Tensor,
        mask: Tensor | None = None,
        stats: dict[str, BatchStats] | None = None,
    ) -> Tensor:
        """phi(x; theta) from the ``body.*`` entries of ``params``.

        A body of plain layers runs as pure functions (thread-safe, no module state); any other
        body through ``functional_call``, one thread at a time (it swaps the module's tensors).
        ``mask`` and ``stats`` reach batch-norm layers (see :func:`apply_layers`).
        """
        if self.layers is not None:
            return apply_layers(self.layers, params, x, mask, stats)
        body = {k[5:]: v for k, v in params.items() if k.startswith("body.")}
        with _module_lock:
            return functional_call(self.body, body, (x,))

    def forward(
        self,
        params: Params,
        x: Tensor,
        mask: Tensor | None = None,
        stats: dict[str, BatchStats] | None = None,
    ) -> Tensor:
        """Logits of body and head together."""
        return head_logits(params, self.features(params, x, mask, stats))


_module_lock = threading.RLock()


def head_logits(params: Params, features: Tensor) -> Tensor:
    """A linear head: ``features @ head.weight.T + head.bias``."""
    return features @ params["head.weight"].T + params["head.bias"]


HEAD_INITS = ("linear", "uniform", "zeros")


def init_head(
    out_dim: int,
    feature_dim: int,
    generator: torch.Generator,
    kind: str = "linear",
    dtype: torch.dtype = torch.float32,
) -> Params:
    """A head of ``out_dim`` outputs (C for a shared head, K_max for a personal one) over M =
    ``feature_dim`` features, drawn from the seeded ``generator`` (every backend draws the same):
    ``linear`` (PyTorch's ``nn.Linear`` default, U(-1/sqrt(M), 1/sqrt(M))), ``uniform`` (U(0, 1),
    as the PFLEGO reference code), or ``zeros``."""
    shape_w, shape_b = (out_dim, feature_dim), (out_dim,)
    if kind == "zeros":
        return {
            "head.weight": torch.zeros(shape_w, dtype=dtype),
            "head.bias": torch.zeros(shape_b, dtype=dtype),
        }
    if kind not in HEAD_INITS:
        raise ConfigError(f"unknown head_init {kind!r}; choose one of {', '.join(HEAD_INITS)}")
    bound = 1 / math.sqrt(feature_dim)
    low, high = (0.0, 1.0) if kind == "uniform" else (-bound, bound)
    width = high - low
    weight = torch.rand(shape_w, generator=generator, dtype=torch.float64) * width + low
    bias = torch.rand(shape_b, generator=generator, dtype=torch.float64) * width + low
    return {"head.weight": weight.to(dtype), "head.bias": bias.to(dtype)}
