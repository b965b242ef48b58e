"""Writers of tiny files in the official dataset formats, for the loader tests."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

IDX_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def idx_bytes(arr: np.ndarray) -> bytes:
    """An uncompressed IDX file holding a uint8 array."""
    arr = np.asarray(arr, dtype=np.uint8)
    return bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def mnist_arrays(n_train: int = 30, n_test: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "y_train": np.arange(n_train, dtype=np.uint8) % 10,
        "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "y_test": np.arange(n_test, dtype=np.uint8) % 10,
    }


def write_idx_set(folder: Path, arrays: dict[str, np.ndarray]) -> list[Path]:
    """The four MNIST-layout IDX gz files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = ("x_train", "y_train", "x_test", "y_test")
    paths = []
    for name, key in zip(IDX_NAMES, keys):
        path = folder / name
        path.write_bytes(gzip.compress(idx_bytes(arrays[key])))
        paths.append(path)
    return paths


def write_emnist_zip(path: Path, split: str, arrays: dict[str, np.ndarray]) -> Path:
    """An EMNIST ``gzip.zip`` with one split; images are stored transposed, as in the original."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for part, tag in (("train", "train"), ("test", "test")):
            x = arrays[f"x_{tag}"].transpose(0, 2, 1)
            z.writestr(
                f"gzip/emnist-{split}-{part}-images-idx3-ubyte.gz", gzip.compress(idx_bytes(x))
            )
            z.writestr(
                f"gzip/emnist-{split}-{part}-labels-idx1-ubyte.gz",
                gzip.compress(idx_bytes(arrays[f"y_{tag}"])),
            )
    return path


def cifar_batch(n: int, label_keys: dict[str, np.ndarray], seed: int = 0) -> bytes:
    """A CIFAR batch pickled as the originals: protocol 2, bytes keys, uint8 data [n, 3072]."""
    rng = np.random.default_rng(seed)
    batch = {b"batch_label": b"testing batch", b"data": rng.integers(0, 256, (n, 3072), np.uint8)}
    for key, labels in label_keys.items():
        batch[key.encode()] = [int(v) for v in labels]
    return pickle.dumps(batch, protocol=2)


def write_cifar10(folder: Path, batches: tuple[int, ...] = (1, 2), n: int = 12) -> Path:
    """``cifar-10-batches-py`` with the given training batches and the test batch."""
    folder.mkdir(parents=True, exist_ok=True)
    for b in batches:
        (folder / f"data_batch_{b}").write_bytes(
            cifar_batch(n, {"labels": np.arange(n) % 10}, seed=b)
        )
    (folder / "test_batch").write_bytes(cifar_batch(n, {"labels": np.arange(n) % 10}, seed=99))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a"] * 10}, protocol=2))
    return folder


def cifar100_labels(n: int) -> dict[str, np.ndarray]:
    fine = np.arange(n) % 100
    return {"fine_labels": fine, "coarse_labels": fine // 5}


def write_cifar100_tar(path: Path, n_train: int = 200, n_test: int = 100) -> Path:
    """The official ``cifar-100-python.tar.gz`` layout: ``cifar-100-python/{train,test,meta}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files = {
        "train": cifar_batch(n_train, cifar100_labels(n_train), seed=1),
        "test": cifar_batch(n_test, cifar100_labels(n_test), seed=2),
        "meta": pickle.dumps({b"fine_label_names": []}, protocol=2),
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, raw in files.items():
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def png_bytes(seed: int) -> bytes:
    """A 105x105 binary drawing, PNG-encoded like Omniglot's (mode 1, white background)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.random((105, 105)) > 0.1).convert("1")
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


OMNIGLOT_LAYOUT = {
    "images_background": {"Alpha": 2, "Beta": 1},
    "images_evaluation": {"Gamma": 2},
}


def omniglot_members(drawings: int = 4) -> dict[str, bytes]:
    """``<set>/<Alphabet>/characterNN/XXXX_YY.png`` -> PNG bytes for :data:`OMNIGLOT_LAYOUT`."""
    out, seed = {}, 0
    for set_name, alphabets in OMNIGLOT_LAYOUT.items():
        for alphabet, chars in alphabets.items():
            for c in range(1, chars + 1):
                for d in range(1, drawings + 1):
                    seed += 1
                    out[f"{set_name}/{alphabet}/character{c:02d}/{seed:04d}_{d:02d}.png"] = (
                        png_bytes(seed)
                    )
    return out


def write_omniglot_zips(folder: Path, drawings: int = 4) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    members = omniglot_members(drawings)
    paths = []
    for set_name in OMNIGLOT_LAYOUT:
        path = folder / f"{set_name}.zip"
        with zipfile.ZipFile(path, "w") as z:
            for name, raw in members.items():
                if name.startswith(set_name + "/"):
                    z.writestr(name, raw)
        paths.append(path)
    return paths


def write_omniglot_folders(folder: Path, drawings: int = 4) -> None:
    for name, raw in omniglot_members(drawings).items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)


def write_leaf(path: Path, users: dict[str, tuple[list, list]]) -> Path:
    """One LEAF JSON file: ``{"users", "num_samples", "user_data": {u: {"x", "y"}}}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(blob))
    return path


def medmnist_arrays(sizes=(12, 4, 6), seed: int = 0) -> dict[str, np.ndarray]:
    """A MedMNIST ``.npz`` layout: ``{split}_images`` [n, 28, 28] uint8, ``{split}_labels`` [n, 1]."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in zip(("train", "val", "test"), sizes):
        out[f"{split}_images"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        out[f"{split}_labels"] = (np.arange(n, dtype=np.uint8) % 11)[:, None]
    return out


def write_medmnist(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


OFFICE_HOME_DOMAINS = ("Art", "Clipart", "Product", "Real World")


def write_office_home(
    folder: Path, classes=("Alarm_Clock", "Bike", "Calculator"), per_class: int = 4, seed: int = 0
) -> dict[tuple[str, str, str], np.ndarray]:
    """The official ``OfficeHomeDataset_10072016`` layout: <domain>/<class>/<image>.jpg, images of
    different sizes. Returns each written image's RGB pixels by (domain, class, file)."""
    rng = np.random.default_rng(seed)
    written = {}
    for domain in OFFICE_HOME_DOMAINS:
        for name in classes:
            (folder / domain / name).mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                h, w = int(rng.integers(20, 60)), int(rng.integers(20, 60))
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                file = f"{k:05d}.png" if k % 2 else f"{k:05d}.jpg"
                Image.fromarray(pixels).save(folder / domain / name / file)
                written[(domain, name, file)] = pixels
    (folder / "ImageInfo.csv").write_text("not an image\n")
    return written


def zip_folder(folder: Path, path: Path) -> Path:
    """``folder`` (and its name as the top level) as a zip file."""
    with zipfile.ZipFile(path, "w") as z:
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                z.write(file, str(file.relative_to(folder.parent)))
    return path
