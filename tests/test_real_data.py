"""Integration tests on the real files in ``<repo>/../shared/data`` (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pflego.data import federate, load_dataset

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def offline_private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "cache"))


def need(sub: str) -> Path:
    if not (SHARED / sub).exists():
        pytest.skip(f"real data not found at {SHARED / sub} (CI keeps shared/ beside the checkout)")
    return SHARED


def test_mnist_pfedme_real():
    data = load_dataset("mnist-pfedme", need("mnist"))
    fd = federate(data, 20, "auto", test_fraction=0.25)  # natural clients, the paper's 75 / 25
    train = fd.train_sizes.numpy()
    assert train.min() == 1167 and train.max() == 3834 and fd.max_classes == 2
    assert len(data.y_train) == 70000
    assert abs(float(data.x_train.mean())) < 0.05  # standardized per pixel


def test_mnist_real():
    data = load_dataset("mnist", need("mnist"))
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(data.y_train).tolist()[:2] == [5923, 6742]
    fd = federate(data, 100, "classes", "high")
    assert fd.max_classes == 2 and fd.total_train == 60000


def all_zero_rows(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.abs(x.reshape(len(x), -1)).sum(1) == 0).tolist())


@pytest.mark.slow
def test_cifar10_real():
    """The whole CIFAR-10: its 146 unrecovered images are the all-zero rows the list names."""
    root = need("cifar-10-batches-py")
    data = load_dataset("cifar10", root)
    assert data.x_train.shape == (50000, 3, 32, 32) and data.x_test.shape == (10000, 3, 32, 32)
    assert np.bincount(data.y_train).tolist() == [5000] * 10
    listed = [
        line.split("\t")
        for line in (root / "cifar-10-batches-py.missing.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    missing = {int(row[2]) for row in listed}
    assert all_zero_rows(data.x_train) | {50000 + i for i in all_zero_rows(data.x_test)} == missing
    assert len(missing) == 146
    fd = federate(data, 20, "classes", "high")
    assert fd.input_shape == (3, 32, 32) and fd.num_clients == 20 and fd.total_train == 50000


@pytest.mark.slow
def test_omniglot_real():
    data = load_dataset("omniglot", need("omniglot"))
    assert data.num_classes == 1623
    assert data.x_train.shape == (97380, 1, 28, 28) and data.x_test.shape == (32460, 1, 28, 28)
    fd = federate(data, 50, "auto")  # natural: one alphabet per client
    rows = fd.summary()
    assert len(rows) == 50 and max(len(r["classes"]) for r in rows) == 55
    assert all(r["train"] == 60 * len(r["classes"]) for r in rows)
