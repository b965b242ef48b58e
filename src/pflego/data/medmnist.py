"""OrganAMNIST (MedMNIST v3): 58,830 abdominal CT slices of 11 organs, 28x28 grayscale.

Yang et al., "MedMNIST v2 - A large-scale lightweight benchmark for 2D and 3D biomedical image
classification", Scientific Data 2023. Read from the official ``organamnist.npz`` (arrays
``{train,val,test}_images`` ``[n, 28, 28]`` uint8 and ``{train,val,test}_labels`` ``[n, 1]``) in
``<data-dir>/medmnist`` or ``<data-dir>``, downloaded from the URL and checked against the MD5
that the ``medmnist`` package publishes (the package itself is not used: it requires torchvision).

The three official splits are pooled, as the PGFed authors do; each client's samples are then
split into train and test by the partition (``test_fraction``; PGFed: 75/25).
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from pflego.data.cache import cached_arrays
from pflego.data.datasets import check_labels, dataset_folder, register
from pflego.data.download import ensure_files
from pflego.data.federated import ArrayDataset
from pflego.errors import DataError

FILE = "organamnist.npz"
SPLITS = ("train", "val", "test")
NUM_CLASSES = 11


def read_medmnist(path: Path) -> dict[str, np.ndarray]:
    """Every split's images and labels pooled, checking the file's layout."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DataError(f"cannot read {path} ({exc}); replace it with the official file") from None
    xs, ys = [], []
    for split in SPLITS:
        images, labels = arrays.get(f"{split}_images"), arrays.get(f"{split}_labels")
        if images is None or labels is None:
            raise DataError(
                f"{path} lacks {split}_images / {split}_labels; replace it with the official file"
            )
        labels = labels.reshape(len(labels), -1)
        if images.ndim != 3 or labels.shape[1] != 1 or len(images) != len(labels):
            raise DataError(
                f"{path}: {split} images {images.shape} and labels {labels.shape} are not "
                "[n, H, W] and [n, 1]; replace it with the official file"
            )
        xs.append(images.astype(np.uint8))
        ys.append(labels[:, 0].astype(np.int64))
    return {"x": np.concatenate(xs), "y": check_labels(np.concatenate(ys), NUM_CLASSES, str(path))}


@register("organamnist", "cnn", True, "OrganAMNIST (MedMNIST, 11 organs), official organamnist.npz")
def load_organamnist(root: Path, seed: int = 0) -> ArrayDataset:
    """OrganAMNIST with its official splits pooled (see the module docstring)."""
    folder = dataset_folder(root, "medmnist", FILE)
    [path] = ensure_files("organamnist", folder)
    a = cached_arrays("organamnist", 1, [path], lambda: read_medmnist(path))
    return ArrayDataset("organamnist", a["x"][:, None], a["y"], None, None, NUM_CLASSES, 1 / 255)
