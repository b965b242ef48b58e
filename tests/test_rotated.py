"""The rotated-images domain-shift federation (``rotated:BASE``), checked against a rotation
computed independently (plain loops over pixels, bilinear interpolation)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pflego.config import load_config
from pflego.data import ArrayDataset, dataset_info, federate, load_dataset, register
from pflego.data.rotated import ANGLES, rotate, rotate_by_domain
from pflego.errors import ConfigError
from pflego.sim import build_experiment

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@register("tiny-flat", "linear", False, "random 8-feature vectors (tests only)")
def load_tiny_flat(root: Path, seed: int = 0) -> ArrayDataset:
    x = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    return ArrayDataset("tiny-flat", x, np.arange(20) % 2, None, None, 2)


def rotated_by_hand(image: np.ndarray, degrees: float) -> np.ndarray:
    """One ``[C, H, W]`` image rotated counter-clockwise: each output pixel, taken as a point
    (x right, y up, origin at the image centre), reads the input at that point turned back by
    ``degrees``, interpolating the four pixels around it (zero outside the image)."""
    c, h, w = image.shape
    out = np.zeros((c, h, w))
    t = math.radians(degrees)
    for i in range(h):
        for j in range(w):
            x, y = j - (w - 1) / 2, (h - 1) / 2 - i
            xs, ys = math.cos(t) * x + math.sin(t) * y, -math.sin(t) * x + math.cos(t) * y
            col, row = xs + (w - 1) / 2, (h - 1) / 2 - ys
            c0, r0 = math.floor(col), math.floor(row)
            for r, cc in ((r0, c0), (r0, c0 + 1), (r0 + 1, c0), (r0 + 1, c0 + 1)):
                weight = (1 - abs(row - r)) * (1 - abs(col - cc))
                if 0 <= r < h and 0 <= cc < w:
                    out[:, i, j] += weight * image[:, r, cc]
    return out


def test_rotation_matches_the_hand_computed_one_and_quarter_turns():
    images = torch.from_numpy(np.random.default_rng(1).random((3, 2, 7, 6)))
    for angle in (15.0, 30.0, 75.0, -40.0):
        want = np.stack([rotated_by_hand(im, angle) for im in images.numpy()])
        np.testing.assert_allclose(rotate(images, angle).numpy(), want, atol=1e-12)
    square = images[..., :6, :]
    torch.testing.assert_close(rotate(square, 90.0), torch.rot90(square, 1, dims=(-2, -1)))
    torch.testing.assert_close(rotate(square, 0.0), square)


def test_uint8_images_are_rounded_back_to_eight_bits():
    x = np.random.default_rng(2).integers(0, 256, (4, 1, 5, 5), dtype=np.uint8)
    out = rotate_by_domain(x, np.array([0, 1, 1, 0]), (0.0, 30.0))
    assert out.dtype == np.uint8 and np.array_equal(out[[0, 3]], x[[0, 3]])
    want = np.stack([rotated_by_hand(im.astype(np.float64), 30.0) for im in x[[1, 2]]])
    assert np.abs(out[[1, 2]].astype(np.float64) - want).max() <= 0.5 + 1e-9


def test_each_client_holds_one_domain_rotated_by_its_angle():
    base = load_dataset("tiny")
    data = load_dataset("rotated:tiny")
    assert data.extra["group_names"] == ["0deg", "15deg", "30deg", "45deg", "60deg", "75deg"]
    assert np.bincount(data.groups_train).tolist() == [40] * 6
    assert np.array_equal(data.y_train, base.y_train)
    for d, angle in enumerate(ANGLES):
        rows = np.flatnonzero(data.groups_train == d)
        want = np.stack([rotated_by_hand(im, angle) for im in base.x_train[rows]])
        np.testing.assert_allclose(data.x_train[rows], want, atol=1e-5)
    fed = federate(data, 6, "natural")
    assert fed.groups == data.extra["group_names"]
    for i, name in enumerate(fed.groups):
        domain = data.x_train[data.groups_train == data.extra["group_names"].index(name)]
        for image in fed.x_train[fed.train_slice(i)].numpy():
            assert np.abs(domain - image).reshape(len(domain), -1).max(1).min() == 0


def test_named_angles_and_domains_with_dirichlet_clients():
    data = load_dataset("rotated:tiny@0,90")
    assert data.extra["group_names"] == ["0deg", "90deg"]
    base = load_dataset("tiny")
    turned = data.groups_train == 1
    np.testing.assert_allclose(
        data.x_train[turned], np.rot90(base.x_train[turned], 1, axes=(-2, -1)), atol=1e-6
    )
    fed = federate(data, 4, "natural-dirichlet", alpha=0.5)
    assert fed.groups == ["0deg", "0deg", "90deg", "90deg"]
    assert dataset_info("rotated:tiny").default_model == "mlp"


def test_bad_specs_are_one_line_errors():
    with pytest.raises(ConfigError, match="comma-separated numbers"):
        dataset_info("rotated:tiny@a,b")
    with pytest.raises(ConfigError, match="named once"):
        dataset_info("rotated:tiny@0,0")
    with pytest.raises(ConfigError, match="unknown dataset 'nope'"):
        dataset_info("rotated:nope")
    with pytest.raises(ConfigError, match="not images"):
        load_dataset("rotated:tiny-flat")


def test_a_run_on_rotated_domains():
    settings = {"dataset": "rotated:tiny", "partition": "natural", "clients": 6, "rounds": 2}
    experiment = build_experiment(load_config({**settings, "algorithm": "fedavg"}))
    assert experiment.data.groups == ["0deg", "15deg", "30deg", "45deg", "60deg", "75deg"]


@pytest.mark.slow  # real MNIST from ../shared/data, as tests/test_real_data.py
def test_rotated_mnist_real():
    if not (SHARED / "mnist").exists():
        pytest.skip(f"real data not found at {SHARED / 'mnist'}")
    data = load_dataset("rotated:mnist", SHARED)
    assert np.bincount(data.groups_train).tolist() == [10000] * 6
    assert np.bincount(data.groups_test).tolist() == [1667] * 4 + [1666] * 2
    fed = federate(data, 6, "natural")
    assert fed.train_sizes.tolist() == [10000] * 6
