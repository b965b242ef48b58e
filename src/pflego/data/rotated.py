"""Rotated images: a domain-shift federation built from any image dataset (``rotated:mnist``).

The rotated-MNIST benchmark of domain generalization (Ghifary, Kleijn, Zhang, Balduzzi, "Domain
Generalization for Object Recognition with Multi-task Autoencoders", ICCV 2015; DomainBed's
``RotatedMNIST``, Gulrajani and Lopez-Paz, ICLR 2021; the FedSR paper's federation): each split is
cut into D domains of equal size by a fixed draw (whatever the run's seed, like the images of a
dataset on disk), and domain d's images are rotated counter-clockwise by ``angles[d]`` degrees
(0, 15, ..., 75 unless ``rotated:BASE@0,30,60`` names others). Each sample's domain is its natural
group (``0deg``, ``15deg``, ...); docs/datasets.md shows the partitions this gives.

The rotation is bilinear about the image centre with zeros outside, computed with
``torch.nn.functional.grid_sample`` (no torchvision); 8-bit images are rounded back to 8 bits, as
an image library's rotation returns them. DomainBed pools MNIST's training and test images before
cutting domains; here a pooled copy is ``pool_test: true``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pflego.data.datasets import DatasetInfo, dataset_info, register_family
from pflego.data.federated import ArrayDataset
from pflego.errors import ConfigError

#: The domains of the rotated-MNIST benchmark, in degrees.
ANGLES = (0.0, 15.0, 30.0, 45.0, 60.0, 75.0)
#: The seed of the fixed draw that cuts a dataset into domains.
DOMAIN_SEED = 2015


def rotate(images: Tensor, degrees: float) -> Tensor:
    """Images ``[n, C, H, W]`` rotated counter-clockwise by ``degrees`` about their centre.

    Output pixel ``p`` (coordinates from the image centre, y pointing up) takes the bilinear
    interpolation of the input at ``R(-degrees) p``; points outside the image read 0.
    """
    n, _, h, w = images.shape
    t = math.radians(degrees)
    dtype = images.dtype if images.is_floating_point() else torch.float64
    rows = torch.arange(h, dtype=dtype) - (h - 1) / 2
    cols = torch.arange(w, dtype=dtype) - (w - 1) / 2
    y, x = -rows[:, None], cols[None, :]  # y up
    x_in = math.cos(t) * x + math.sin(t) * y
    y_in = -math.sin(t) * x + math.cos(t) * y
    # grid_sample with align_corners=True maps -1 / 1 to the centres of the first / last pixel.
    gx = x_in / max((w - 1) / 2, 1e-12)
    gy = -y_in / max((h - 1) / 2, 1e-12)
    grid = torch.stack([gx.expand(h, w), gy.expand(h, w)], dim=-1).expand(n, h, w, 2)
    return torch.nn.functional.grid_sample(
        images.to(dtype), grid, mode="bilinear", padding_mode="zeros", align_corners=True
    )


def domains_of(n: int, num_domains: int) -> np.ndarray:
    """The domain of each of ``n`` samples: a fixed permutation dealt in turn (sizes differ by
    at most 1)."""
    order = np.random.default_rng(DOMAIN_SEED).permutation(n)
    out = np.empty(n, dtype=np.int64)
    out[order] = np.arange(n) % num_domains
    return out


def rotate_by_domain(x: np.ndarray, domains: np.ndarray, angles: tuple[float, ...]) -> np.ndarray:
    """Each image rotated by its domain's angle, in the dtype it came in (uint8 rounded)."""
    out = np.empty_like(x)
    for d, angle in enumerate(angles):
        rows = np.flatnonzero(domains == d)
        turned = rotate(torch.from_numpy(x[rows]), angle)
        if x.dtype == np.uint8:
            turned = turned.round().clamp(0, 255)
        out[rows] = turned.numpy().astype(x.dtype)
    return out


def parse_angles(text: str) -> tuple[float, ...]:
    """``"0,30,60"`` as angles in degrees, or a one-line error."""
    try:
        angles = tuple(float(a) for a in text.split(","))
    except ValueError:
        raise ConfigError(
            f"rotated:...@{text}: angles must be comma-separated numbers of degrees (0,15,30)"
        ) from None
    if len(set(angles)) != len(angles):
        raise ConfigError(f"rotated:...@{text}: each angle may be named once")
    return angles


def load_rotated(
    base: str, angles: tuple[float, ...], root: Path, seed: int = 0, **settings: str
) -> ArrayDataset:
    """``base`` with each image rotated by its domain's angle, its domain as its natural group."""
    data = dataset_info(base).loader(root, seed=seed, **settings)
    if data.x_train.ndim != 4:
        raise ConfigError(
            f"rotated:{base}: {base} has inputs of shape {data.x_train.shape[1:]}, not images "
            "[channels, height, width]; rotate an image dataset (mnist, fmnist, cifar10)"
        )
    split = {}
    for name, x in (("train", data.x_train), ("test", data.x_test)):
        if x is not None:
            domains = domains_of(len(x), len(angles))
            split[f"x_{name}"] = rotate_by_domain(x, domains, angles)
            split[f"groups_{name}"] = domains
    return dataclasses.replace(
        data,
        name=f"rotated:{base}",
        extra={**data.extra, "group_names": [f"{a:g}deg" for a in angles]},
        **split,
    )


@register_family(
    "rotated",
    "rotated:BASE[@ANGLES]",
    "an image dataset cut into domains rotated by 0,15,30,45,60,75 degrees (rotated:mnist)",
)
def rotated_dataset_info(spec: str) -> DatasetInfo:
    """The registry entry of ``rotated:<base>[@<angles>]``: the base dataset's model."""
    base, sep, text = spec.partition("@")
    angles = parse_angles(text) if sep else ANGLES
    info = dataset_info(base)
    return DatasetInfo(
        f"rotated:{spec}",
        partial(load_rotated, base, angles),
        info.default_model,
        info.needs_data_dir,
        f"{base} in {len(angles)} rotated domains",
    )
