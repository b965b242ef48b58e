"""The architectures by name, and :func:`build_model`, which builds one as a split model.

An architecture is a builder: it takes the input shape and returns the body (an ``nn.Module``) and
its feature width M. Each family lives in its own module; this one only names them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

from torch import nn

from pflego.errors import ConfigError
from pflego.models.cnn import cifar_cnn, conv4, two_conv_body
from pflego.models.lstm import char_lstm
from pflego.models.mlp import linear, mlp, mlp_bn
from pflego.models.mobilenet import mobilenet_v2
from pflego.models.split import SplitModel

#: Input shape -> (body, feature width M).
Builder = Callable[[tuple[int, ...]], tuple[nn.Module, int]]

ARCHITECTURES: dict[str, Builder] = {
    "mlp": mlp,
    "mlp-bn": mlp_bn,
    "linear": linear,
    "cnn": cifar_cnn,
    "pgfed-cnn": partial(two_conv_body, width=512),
    "conv4": conv4,
    "lstm": char_lstm,
    "femnist-cnn": partial(two_conv_body, width=2048),
    "mobilenet-v2": mobilenet_v2,
}


def architecture(name: str) -> Builder:
    """A registered architecture, or ``mlp<N>``: the ``mlp`` body with N hidden units.

    ``mlp`` has the PFLEGO paper's 200 units; the pFedMe paper's two-layer DNN is ``mlp100``
    (MNIST) and ``mlp20`` (Synthetic).
    """
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    width = re.fullmatch(r"mlp([1-9][0-9]*)", name)
    if width is None:
        raise ConfigError(
            f"unknown model {name!r}; choose one of {', '.join(sorted(ARCHITECTURES))} "
            "or mlp<N> (N hidden units)"
        )
    return lambda shape: mlp(shape, int(width.group(1)))


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, max_local_classes: int
) -> SplitModel:
    """Build a registered architecture (or ``mlp<N>``) for inputs of ``input_shape``."""
    build = architecture(name)
    try:
        body, dim = build(tuple(input_shape))
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"model {name!r} does not fit inputs of shape {tuple(input_shape)} ({exc})"
        ) from None
    for p in body.parameters():
        p.requires_grad_(False)
    return SplitModel(body, dim, num_classes, max_local_classes, name, tuple(input_shape))
