"""Shared fixtures: a tiny registered dataset and float64 experiments built on it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pflego.algorithms import ALGORITHMS
from pflego.config import load_config
from pflego.data import ArrayDataset, download, register
from pflego.experiments.presets import shipped_presets
from pflego.sim import build_experiment
from pflego.sim.metrics import client_rows
from pflego.sim.summary import summarize

# `--backend auto` picks by measured timings, which vary from run to run: the suite takes the
# rule's reproducible choice (tests/test_backend_probe.py measures, with injected timings).
os.environ["PFLEGO_BACKEND_PROBE"] = "0"

# The Ctrl-C tests need Python's SIGINT handler, which a suite started as a background job (`&`)
# inherits switched off (ignored); their child processes then get the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@register(
    "tiny", "mlp", False, "random 1x4x4 images in 4 classes with a learnable rule (tests only)"
)
def load_tiny(root: Path, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(123)
    x = rng.normal(size=(240, 1, 4, 4)).astype(np.float32)
    y = (x.reshape(240, -1)[:, :4].argmax(1)).astype(np.int64)
    return ArrayDataset("tiny", x, y, None, None, 4)


TINY = {
    "dataset": "tiny",
    "clients": 6,
    "classes_per_client": 2,
    "participation": 0.5,
    "rounds": 4,
    "inner_steps": 3,
    "client_lr": 0.1,
    "eval_every": 2,
    "average_last": 0,
    "dtype": "float64",
}


@pytest.fixture
def tiny_settings() -> dict:
    return dict(TINY)


def evaluate_pools(algorithm, downlink_for, states, pools, personalization=None, chunk_size=None):
    """Summary metrics and one row per client of ``pflego.sim.metrics.client_rows``
    (``downlink_for``: a function of client ids, or every client's downlink)."""
    if not callable(downlink_for):
        sent = downlink_for
        downlink_for = lambda ids: sent  # noqa: E731
    rows = client_rows(algorithm, downlink_for, states, pools, personalization, chunk_size)
    return summarize(rows), rows


def tiny_experiment(**overrides):
    """A float64 experiment on the tiny dataset with an MLP of hidden width 200.

    Algorithms that validate on a held-out split get one (``val_fraction`` 0.2).
    """
    if ALGORITHMS[overrides.get("algorithm", "pflego")].uses_validation:
        overrides = {"val_fraction": 0.2, **overrides}
    return build_experiment(load_config({**TINY, **overrides}))


#: The check of local copies of official files against their published checksums.
VERIFY_LOCAL = download.verify_local


@pytest.fixture(autouse=True)
def _no_checksums_of_test_files(monkeypatch):
    """Tests write small files under the official names, which cannot match the published
    checksums: the check is off, except in the tests of the check (``VERIFY_LOCAL``)."""
    monkeypatch.setattr(download, "verify_local", lambda key, path: Path(path))


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield


def approx_numbers(record: dict, rel: float) -> dict:
    """``record`` with its float values compared up to ``rel`` and every other value exactly
    (pytest 9's ``approx`` refuses strings and nested lists under a relative tolerance)."""
    return {k: pytest.approx(v, rel=rel) if isinstance(v, float) else v for k, v in record.items()}


def preset(name: str = "main.yaml") -> dict:
    """A preset file shipped with the package, as a plain mapping (``settings``, ``algorithms``...)."""
    return yaml.safe_load(shipped_presets()[name.removesuffix(".yaml")].read_text())
