"""The papers' small convolutional bodies: PFLEGO's CIFAR CNN, FedAvg's two-conv CNN (PGFed's and
FedEM's FEMNIST model, at two widths) and the four-block Conv-4 of few-shot Omniglot.

Each builder takes the input shape ``[channels, height, width]`` and returns the body and its
feature width M; the linear head on top is the classifier.
"""

from __future__ import annotations

import torch
from torch import nn


def cifar_cnn(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """The PFLEGO paper's CIFAR-10 CNN (M = 192)."""
    channels, height, width = input_shape
    conv = nn.Sequential(
        nn.Conv2d(channels, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, 2),
        nn.Flatten(),
    )
    flat = conv(torch.zeros(1, *input_shape)).shape[1]
    return nn.Sequential(conv, nn.Linear(flat, 384), nn.ReLU(), nn.Linear(384, 192), nn.ReLU()), 192


def two_conv_body(input_shape: tuple[int, ...], width: int) -> tuple[nn.Module, int]:
    """Conv5x5 32 -> ReLU -> MaxPool 2x2 -> Conv5x5 64 -> ReLU -> MaxPool 2x2 -> Dense ``width``
    -> ReLU (M = ``width``): the body of FedAvg's CNN, whose last layer (Dense C) is the head. The
    PGFed paper's CNN has 512 units (``pgfed-cnn``); FedEM's FEMNIST / EMNIST model (LEAF's CNN)
    2048 (``femnist-cnn``)."""
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = conv(torch.zeros(1, *input_shape)).shape[1]
    return nn.Sequential(conv, nn.Linear(flat, width), nn.ReLU()), width


def conv4(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """Four [Conv3x3 64, ReLU, MaxPool 2x2] blocks, no batch norm (Omniglot, M = 64 on 28x28)."""
    layers: list[nn.Module] = []
    in_ch = input_shape[0]
    for _ in range(4):
        layers += [nn.Conv2d(in_ch, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        in_ch = 64
    body = nn.Sequential(*layers, nn.Flatten())
    return body, body(torch.zeros(1, *input_shape)).shape[1]
