"""A conditional generator on the server, and the bank of its samples a downlink carries.

The contract's form of a server-side generator (docs/design.md): its parameters are server state,
trained in ``server_round``; clients draw no random numbers, so the server draws the noise from
the run's seed and the round and sends the generated samples (:meth:`Generator.bank`) in the
shared downlink. Used by FedGen (``algorithms/fedgen.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pflego.models.hypernet import init_linear
from pflego.tree import Params


@dataclass(frozen=True)
class Generator:
    """G(z, y) = W2 relu(W1 [z, onehot(y)] + b1) + b2: noise z ``[.., noise_dim]`` and a label y to
    a sample of ``output_dim`` features."""

    noise_dim: int
    hidden_dim: int
    num_classes: int

    def init(self, output_dim: int, gen: torch.Generator, like: Tensor) -> Params:
        """``nn.Linear``'s initialization of both layers, drawn from ``gen``, cast as ``like``."""
        inputs = self.noise_dim + self.num_classes
        layers = [
            ("generator.0", self.hidden_dim, inputs),
            ("generator.1", output_dim, self.hidden_dim),
        ]
        return init_linear(layers, gen, like)

    def forward(self, w: Params, z: Tensor, y: Tensor) -> Tensor:
        """G(z, y) for noise ``[..., noise_dim]`` and labels ``[...]``."""
        onehot = (y[..., None] == torch.arange(self.num_classes, device=y.device)).to(z)
        h = torch.cat([z, onehot], -1) @ w["generator.0.weight"].T + w["generator.0.bias"]
        return torch.relu(h) @ w["generator.1.weight"].T + w["generator.1.bias"]

    def bank(self, w: Params, per_class: int, gen: torch.Generator) -> Tensor:
        """``per_class`` samples of every class, ``[C, per_class, output_dim]``, from N(0, I)
        noise drawn (in float32) from ``gen``."""
        like = w["generator.0.weight"]
        z = torch.randn((self.num_classes, per_class, self.noise_dim), generator=gen)
        y = torch.arange(self.num_classes, device=like.device)[:, None].expand(-1, per_class)
        return self.forward(w, z.to(like), y)
