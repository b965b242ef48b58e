"""Partition properties: disjoint, complete, K classes per client, Dirichlet always finishes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pflego.data import ArrayDataset, federate
from pflego.data import partition as P
from pflego.errors import ConfigError


def labels_strategy():
    return st.tuples(st.integers(2, 12), st.integers(1, 15), st.integers(0, 10_000)).map(
        lambda t: (t[0], t[1], np.random.default_rng(t[2]).integers(0, t[0], size=t[0] * 40))
    )


def check_disjoint_and_complete(parts, n):
    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined)) == n


@settings(max_examples=40, deadline=None)
@given(labels_strategy(), st.integers(1, 5), st.integers(0, 99))
def test_classes_partition(case, k, seed):
    num_classes, num_clients, labels = case
    k = min(k, num_classes)
    if num_clients * k < num_classes:
        with pytest.raises(ConfigError, match="cannot cover"):
            P.class_shares("classes", num_clients, num_classes, np.random.default_rng(seed), k)
        return
    rng = np.random.default_rng(seed)
    shares = P.class_shares("classes", num_clients, num_classes, rng, k)
    held = shares > 0
    assert (held.sum(1) == k).all()  # K classes per client
    assert held.any(0).all()  # every class held by someone
    holders = held.sum(0)
    assert holders.max() - holders.min() <= 1  # classes spread as evenly as possible
    parts = P.deal(labels, shares, rng)
    check_disjoint_and_complete(parts, len(labels))
    for i, p in enumerate(parts):
        assert set(np.unique(labels[p])) <= set(np.flatnonzero(held[i]))
    for c in range(
        num_classes
    ):  # round-robin: the holders' counts of a class differ by at most one
        counts = [np.sum(labels[parts[i]] == c) for i in np.flatnonzero(held[:, c])]
        assert max(counts) - min(counts) <= 1


@settings(max_examples=40, deadline=None)
@given(labels_strategy(), st.floats(1e-4, 100.0), st.integers(0, 5), st.integers(0, 99))
def test_dirichlet_finishes_and_respects_min_size(case, alpha, min_size, seed):
    num_classes, num_clients, labels = case
    rng = np.random.default_rng(seed)
    shares = P.class_shares("dirichlet", num_clients, num_classes, rng, alpha=alpha)
    np.testing.assert_allclose(shares.sum(0), 1.0)
    parts = P.enforce_min_size(P.deal(labels, shares, rng), min_size, rng)
    check_disjoint_and_complete(parts, len(labels))
    assert min(len(p) for p in parts) >= min_size


def test_dirichlet_with_many_clients_and_tiny_alpha_finishes():
    labels = np.random.default_rng(0).integers(0, 10, size=5000)
    rng = np.random.default_rng(1)
    shares = P.class_shares("dirichlet", 1000, 10, rng, alpha=1e-3)
    parts = P.enforce_min_size(P.deal(labels, shares, rng), 5, rng)
    assert min(len(p) for p in parts) == 5


def test_min_size_too_large_is_a_config_error():
    with pytest.raises(ConfigError, match="min_client_size"):
        P.enforce_min_size([np.arange(3), np.arange(3, 4)], 3, np.random.default_rng(0))


def test_iid_gives_near_equal_sizes():
    labels = np.random.default_rng(0).integers(0, 10, size=1000)
    parts = P.deal(
        labels, P.class_shares("iid", 7, 10, np.random.default_rng(0)), np.random.default_rng(0)
    )
    sizes = [len(p) for p in parts]
    check_disjoint_and_complete(parts, 1000)
    assert max(sizes) - min(sizes) <= 10


@pytest.mark.parametrize(
    ("preset", "k"), [("high", 2), ("medium", 5), ("none", 10), (3, 3), ("4", 4)]
)
def test_personalization_presets(preset, k):
    assert P.resolve_classes_per_client(preset, 10) == k


@pytest.mark.parametrize("bad", [0, 11, "extreme"])
def test_bad_classes_per_client(bad):
    with pytest.raises(ConfigError):
        P.resolve_classes_per_client(bad, 10)


def _dataset(official_test: bool) -> ArrayDataset:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(600, 3)).astype(np.float32), rng.integers(0, 6, 600)
    if official_test:
        return ArrayDataset("d", x, y, x[:200], y[:200], 6)
    return ArrayDataset("d", x, y, None, None, 6)


@pytest.mark.parametrize("official_test", [True, False])
def test_federate_keeps_test_classes_within_train_classes(official_test):
    data = federate(_dataset(official_test), 9, "classes", 2, seed=3)
    expected = (600, 200) if official_test else (None, None)
    if not official_test:  # a pooled dataset is split, every sample once
        assert data.total_train + int(data.test_offsets[-1]) == 600
    else:
        assert (data.total_train, int(data.test_offsets[-1])) == expected
    for i in range(data.num_clients):
        train_classes = set(data.y_train[data.train_slice(i)].tolist())
        test_classes = set(data.y_test[data.test_slice(i)].tolist())
        assert len(train_classes) == 2 and test_classes <= train_classes
        classes = [c for c in data.client_classes[i].tolist() if c >= 0]
        local = data.y_train_local[data.train_slice(i)]
        assert [classes[j] for j in local.tolist()] == data.y_train[data.train_slice(i)].tolist()


def test_federate_is_deterministic_under_a_seed():
    a, b = (federate(_dataset(False), 5, "dirichlet", alpha=0.3, seed=7) for _ in range(2))
    assert a.train_offsets.tolist() == b.train_offsets.tolist()
    assert a.y_train.tolist() == b.y_train.tolist()
