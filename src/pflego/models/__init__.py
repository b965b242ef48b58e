"""The split model (body -> M features, linear head -> logits) and the papers' architectures.

:mod:`~pflego.models.split` holds the split model and its head, :mod:`~pflego.models.layers` the
pure-function forward pass of plain bodies, :mod:`~pflego.models.registry` the architectures by
name; each family of architectures has its own module (``mlp``, ``cnn``, ``lstm``, ``mobilenet``).
"""

from pflego.models.layers import Layer, apply_layers, channels_last
from pflego.models.registry import ARCHITECTURES, architecture, build_model
from pflego.models.split import SplitModel, head_logits, init_head

__all__ = [
    "ARCHITECTURES",
    "Layer",
    "SplitModel",
    "apply_layers",
    "architecture",
    "build_model",
    "channels_last",
    "head_logits",
    "init_head",
]
