"""A site's own data on a SuperNode: the formats a site has, read and fitted to the run's task.

A SuperNode started with ``--node-config "data=/path format=imagefolder|npz|csv|idx"`` serves
the data at that path instead of a partition of a global dataset. Labels are names (strings);
the run's label space maps them to global ids (see :mod:`pflego.flower.population`). The formats,
the train/test split of data with a single part (seeded by the run's seed and the site's name, so
the same in every process) and the scaling of uint8 inputs by 1/255 are described in
``docs/flower.md`` ("Site data").
"""

from __future__ import annotations

import csv
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pflego.config import Config
from pflego.data import ArrayDataset, FederatedData, from_parts
from pflego.data import partition as P
from pflego.data.cache import cached_arrays
from pflego.data.datasets import read_idx
from pflego.errors import ConfigError, DataError
from pflego.flower.population import Report, Task, natural_key
from pflego.rng import seed_for

FORMATS = ("imagefolder", "npz", "csv", "idx")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm"}
#: Seed stream of a site's own train/test and validation splits.
SITE_SPLIT_STREAM = 9


@dataclass
class SiteArrays:
    """A site's samples as read from disk: inputs, label names, and the test part if any."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None

    @property
    def scale(self) -> float:
        return 1 / 255 if self.x_train.dtype == np.uint8 else 1.0


def default_site_name(path: str | Path) -> str:
    """``<host>:<absolute data path>``: unique per site when the node config names none."""
    return f"{socket.gethostname()}:{Path(path).resolve()}"


def read_site(path: str | Path, fmt: str, label_column: str = "label") -> SiteArrays:
    """Read a site's data in format ``fmt``; one-line ``DataError`` / ``ConfigError`` if wrong."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    if not path.exists():
        raise DataError(f"the site's data {path} does not exist; fix data= in --node-config")
    reader = {"imagefolder": _imagefolder, "npz": _npz, "csv": _csv, "idx": _idx}[fmt]
    arrays = reader(path, label_column) if fmt == "csv" else reader(path)
    for split in ("train", "test"):
        x, y = getattr(arrays, f"x_{split}"), getattr(arrays, f"y_{split}")
        if x is not None and len(x) != len(y):
            raise DataError(f"{path}: {len(x)} {split} inputs but {len(y)} labels")
    if arrays.x_test is not None and arrays.x_test.shape[1:] != arrays.x_train.shape[1:]:
        raise DataError(
            f"{path}: test inputs have shape {arrays.x_test.shape[1:]} but training inputs "
            f"{arrays.x_train.shape[1:]}"
        )
    return arrays


def _labels(values: np.ndarray) -> np.ndarray:
    """Label values as names: integers as their decimal text, anything else as its string."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        if not np.all(values == np.round(values)):
            raise DataError("labels must be integers or names, not fractions")
        values = values.astype(np.int64)
    return values.astype(str)


# --- formats ----------------------------------------------------------------------------------


def _image_array(file: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as image:
            mode = {"1": "L", "P": "RGB", "LA": "L", "RGBA": "RGB"}.get(image.mode, image.mode)
            if mode not in ("L", "RGB"):
                raise DataError(f"{file}: image mode {image.mode} is not grayscale or RGB")
            pixels = np.asarray(image.convert(mode), dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as exc:
        raise DataError(f"cannot read image {file} ({exc})") from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _image_part(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    classes = sorted((d for d in folder.iterdir() if d.is_dir()), key=lambda d: natural_key(d.name))
    files = [
        (f.name, d.name, f)
        for d in classes
        for f in d.iterdir()
        if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise DataError(f"{folder} holds no class sub-folders of images (<label>/<image>.png)")
    files.sort(key=lambda item: (natural_key(item[0]), natural_key(item[1])))
    first = _image_array(files[0][2])
    x = np.empty((len(files), *first.shape), np.uint8)
    for k, (_, _, file) in enumerate(files):
        image = first if k == 0 else _image_array(file)
        if image.shape != first.shape:
            raise DataError(
                f"{file} has shape {image.shape} (channels, height, width) but {files[0][2]} "
                f"has {first.shape}; every image of a site must have the same size and mode"
            )
        x[k] = image
    return x, np.array([label for _, label, _ in files])


def _imagefolder(path: Path) -> SiteArrays:
    if not path.is_dir():
        raise DataError(
            f"{path} is not a folder; format=imagefolder needs a folder of class folders"
        )
    split = (path / "train").is_dir()
    parts = {"train": path / "train", "test": path / "test"} if split else {"train": path}

    def decode() -> dict[str, np.ndarray]:
        arrays = {}
        for name, folder in parts.items():
            if folder.is_dir():
                arrays[f"x_{name}"], arrays[f"y_{name}"] = _image_part(folder)
        return arrays

    a = cached_arrays("site-imagefolder", 1, [path], decode)
    return SiteArrays(a["x_train"], a["y_train"], a.get("x_test"), a.get("y_test"))


def _npz(path: Path) -> SiteArrays:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path} as .npz ({exc})") from None
    if {"x_train", "y_train"} <= set(arrays):
        x_test, y_test = arrays.get("x_test"), arrays.get("y_test")
        if (x_test is None) != (y_test is None):
            raise DataError(f"{path} has only one of x_test and y_test")
        return SiteArrays(
            arrays["x_train"],
            _labels(arrays["y_train"]),
            x_test,
            None if y_test is None else _labels(y_test),
        )
    if {"x", "y"} <= set(arrays):
        return SiteArrays(arrays["x"], _labels(arrays["y"]), None, None)
    raise DataError(
        f"{path} holds {', '.join(sorted(arrays)) or 'nothing'}; it needs x and y "
        "(or x_train, y_train, x_test, y_test)"
    )


def _csv_part(file: Path, label_column: str) -> tuple[np.ndarray, np.ndarray]:
    with file.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows or label_column not in rows[0]:
        raise DataError(
            f"{file} has no column {label_column!r} in its header; name the label column "
            "with label-column=... in --node-config"
        )
    header, body = rows[0], [r for r in rows[1:] if r]
    where = header.index(label_column)
    try:
        x = np.array(
            [[float(v) for k, v in enumerate(r) if k != where] for r in body], dtype=np.float32
        )
    except ValueError as exc:
        raise DataError(f"{file}: a feature is not a number ({exc})") from None
    if x.ndim != 2 or x.shape[1] != len(header) - 1:
        raise DataError(f"{file}: every row must have {len(header)} columns")
    labels = np.array([r[where].strip() for r in body])
    return x, labels


def _csv(path: Path, label_column: str) -> SiteArrays:
    if path.is_dir():
        train, test = path / "train.csv", path / "test.csv"
        if not train.is_file():
            raise DataError(f"{path} has no train.csv (and test.csv); or point data= at one file")
        x, y = _csv_part(train, label_column)
        xt, yt = _csv_part(test, label_column) if test.is_file() else (None, None)
        return SiteArrays(x, y, xt, yt)
    x, y = _csv_part(path, label_column)
    return SiteArrays(x, y, None, None)


def _idx_file(folder: Path, stem: str) -> Path | None:
    return next((folder / n for n in (stem, stem + ".gz") if (folder / n).is_file()), None)


def _idx(path: Path) -> SiteArrays:
    parts = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = _idx_file(path, f"{prefix}-images-idx3-ubyte")
        labels = _idx_file(path, f"{prefix}-labels-idx1-ubyte")
        if images is not None and labels is not None:
            x = read_idx(images)
            parts[split] = (x[:, None] if x.ndim == 3 else x, _labels(read_idx(labels)))
    if "train" not in parts:
        raise DataError(
            f"{path} has no train-images-idx3-ubyte(.gz) and train-labels-idx1-ubyte(.gz)"
        )
    x_test, y_test = parts.get("test", (None, None))
    return SiteArrays(*parts["train"], x_test, y_test)


# --- the site's client ----------------------------------------------------------------------


@dataclass
class Site:
    """A site's data, split as the run says, before it is fitted to the run's task.

    Attributes:
        name: The site's stable name (the client's name in the population).
        x: Inputs of the ``train``, ``test`` and (with ``val_fraction``) ``val`` parts.
        y: Their label names.
        scale: Factor that turns stored inputs into model inputs.
    """

    name: str
    x: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    scale: float

    @classmethod
    def load(cls, name: str, arrays: SiteArrays, config: Config) -> Site:
        """Split a site's arrays into train / test (when it has no test part) and validation."""
        rng = np.random.default_rng(
            seed_for(config.seed, SITE_SPLIT_STREAM, zlib.crc32(name.encode()))
        )
        rows = np.arange(len(arrays.y_train))
        x, y = {}, {}
        if arrays.x_test is None:
            (train,), (test,) = P.split_train_test([rows], config.test_fraction, rng)
            x["test"], y["test"] = arrays.x_train[test], arrays.y_train[test]
        else:
            train = rows
            x["test"], y["test"] = arrays.x_test, arrays.y_test
        (train,), (val,) = P.split_fraction([train], config.val_fraction, rng)
        x["train"], y["train"] = arrays.x_train[train], arrays.y_train[train]
        if config.val_fraction > 0:
            x["val"], y["val"] = arrays.x_train[val], arrays.y_train[val]
        return cls(name, x, y, arrays.scale)

    def report(self) -> Report:
        """What the node tells the server: counts, label names (its classes are those of its
        training split, as in the simulator) and the input shape."""
        own = set(np.unique(self.y["train"]).tolist())
        held = set(np.unique(np.concatenate(list(self.y.values()))).tolist())
        return Report(
            self.name,
            len(self.y["train"]),
            len(self.y["test"]),
            tuple(sorted(own, key=natural_key)),
            tuple(self.x["train"].shape[1:]),
            other_labels=tuple(sorted(held - own, key=natural_key)),
        )

    def federated(self, task: Task) -> FederatedData:
        """The site as a one-client ``FederatedData`` over the run's label space.

        Its class list (global ids) is padded to the task's K_max, as the simulator pads every
        client's, so personal heads have the population's width.
        """
        task.check(self.report())
        ids = {name: k for k, name in enumerate(task.labels)}
        y = {split: np.array([ids[n] for n in names], np.int64) for split, names in self.y.items()}
        pool = ["train", "val"] if "val" in self.x else ["train"]  # validation rows follow
        x_pool, y_pool = (np.concatenate([part[split] for split in pool]) for part in (self.x, y))
        raw = ArrayDataset(
            self.name, x_pool, y_pool, self.x["test"], y["test"], task.num_classes, self.scale
        )
        n_train = len(y["train"])
        val = [np.arange(n_train, len(y_pool))] if "val" in self.x else None
        data = from_parts(raw, [np.arange(n_train)], [np.arange(len(y["test"]))], val_parts=val)
        width = data.client_classes.shape[1]
        if width < task.max_classes:
            pad = torch.full((1, task.max_classes - width), -1, dtype=torch.int64)
            data.client_classes = torch.cat([data.client_classes, pad], 1)
        data.input_shape = tuple(task.input_shape)
        return data


# --- writing sites (rehearsals and tests) -------------------------------------------------------


def write_site(
    folder: str | Path,
    fmt: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
) -> Path:
    """Write one site's train and test parts in format ``fmt``; returns the path for ``data=``.

    ``imagefolder`` and ``idx`` take uint8 images ``[n, C, H, W]`` (C = 1 or 3; idx: C = 1);
    ``npz`` writes ``folder/data.npz``; ``csv`` writes ``train.csv`` and ``test.csv`` with the
    flattened inputs as features and a ``label`` column. Samples keep their order (image files are numbered).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    parts = {"train": (x_train, y_train), "test": (x_test, y_test)}
    if fmt == "npz":
        path = folder / "data.npz"
        np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
        return path
    if fmt == "imagefolder":
        from PIL import Image

        for split, (x, y) in parts.items():
            for k, (image, label) in enumerate(zip(x, y)):
                target = folder / split / str(label)
                target.mkdir(parents=True, exist_ok=True)
                pixels = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
                Image.fromarray(pixels).save(target / f"{k:06d}.png")
        return folder
    if fmt == "csv":
        for split, (x, y) in parts.items():
            flat = x.reshape(len(x), -1)
            with (folder / f"{split}.csv").open("w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow([f"x{j}" for j in range(flat.shape[1])] + ["label"])
                writer.writerows(
                    [*map(repr, map(float, row)), label] for row, label in zip(flat, y)
                )
        return folder
    if fmt == "idx":
        for prefix, (x, y) in (("train", parts["train"]), ("t10k", parts["test"])):
            images = x.reshape(len(x), *x.shape[-2:]).astype(np.uint8)
            labels = np.asarray(y).astype(np.uint8)
            for name, array, ndim in (("images-idx3", images, 3), ("labels-idx1", labels, 1)):
                header = bytes([0, 0, 0x08, ndim]) + b"".join(
                    int(d).to_bytes(4, "big") for d in array.shape
                )
                (folder / f"{prefix}-{name}-ubyte").write_bytes(header + array.tobytes())
        return folder
    raise ConfigError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")


def export_partition(config: Config, root: str | Path, fmt: str = "imagefolder") -> list[Path]:
    """Write every client of the simulator's partition of ``config`` as a site
    ``root/site<i>`` (for rehearsing a deployment, and for tests that compare with the simulator).

    Inputs are written as stored (uint8 images), except ``csv``, which holds model inputs.
    Returns each site's ``data=`` path.
    """
    from pflego.sim import build_experiment

    data = build_experiment(config).data
    paths = []
    for i in range(data.num_clients):
        train, test = data.train_slice(i), data.test_slice(i)
        x_train, x_test = data.x_train[train].numpy(), data.x_test[test].numpy()
        if fmt == "csv":
            x_train, x_test = (data.inputs(torch.from_numpy(x)).numpy() for x in (x_train, x_test))
        paths.append(
            write_site(
                Path(root) / f"site{i}",
                fmt,
                x_train,
                data.y_train[train].numpy(),
                x_test,
                data.y_test[test].numpy(),
            )
        )
    return paths
