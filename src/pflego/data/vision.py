"""EMNIST (official ``gzip.zip``) and CIFAR-10 / CIFAR-100 (official Python pickles)."""

from __future__ import annotations

import io
import logging
import pickle
import tarfile
import zipfile
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pflego.data.cache import cached_arrays
from pflego.data.datasets import check_digits, check_labels, gunzip_bytes, parse_idx, register
from pflego.data.download import REMOTES, ensure_files
from pflego.data.federated import ArrayDataset
from pflego.errors import DataError

log = logging.getLogger("pflego.data")

# --- EMNIST -----------------------------------------------------------------------------------

EMNIST_SPLITS = {"byclass": 62, "balanced": 47, "letters": 26, "digits": 10}


def _emnist_read(source: Path, member: str) -> np.ndarray:
    """One IDX array from the archive (or from the extracted ``gzip/`` folder)."""
    where = f"{source}:{member}" if source.suffix == ".zip" else str(source / member)
    try:
        if source.suffix == ".zip":
            with zipfile.ZipFile(source) as z:
                raw = z.read(member)
        else:
            raw = (source / member).read_bytes()
    except KeyError:
        raise DataError(
            f"{source} has no member {member}; replace it with the official EMNIST gzip.zip"
        ) from None
    except FileNotFoundError:
        raise DataError(
            f"missing {where}; put the official EMNIST gzip.zip in {source.parent}"
        ) from None
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"cannot read {where} ({exc}); replace it with the official EMNIST gzip.zip"
        ) from None
    return parse_idx(gunzip_bytes(raw, where), where)


def load_emnist(root: Path, seed: int = 0, *, split: str) -> ArrayDataset:
    """One EMNIST split from ``<root>/emnist/gzip.zip`` (or the extracted ``<root>/emnist/gzip/``).

    EMNIST images are stored transposed (column-major); they are transposed back here so that
    they look like MNIST. The letters split's labels 1..26 become 0..25.
    """
    folder = root / "emnist" if (root / "emnist").is_dir() else root
    if (folder / "gzip").is_dir() and not (folder / "gzip.zip").is_file():
        source = folder
    else:
        folder = folder if (folder / "gzip.zip").is_file() else root / "emnist"
        source = ensure_files("emnist", folder)[0]

    def decode() -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for part in ("train", "test"):
            images = f"gzip/emnist-{split}-{part}-images-idx3-ubyte.gz"
            labels = f"gzip/emnist-{split}-{part}-labels-idx1-ubyte.gz"
            x, y = _emnist_read(source, images), _emnist_read(source, labels).astype(np.int64)
            first = 1 if split == "letters" else 0  # the letters split numbers its classes 1..26
            x, out[f"y_{part}"] = check_digits(
                x, y - first, f"{source}:{images}", f"{source}:{labels}", EMNIST_SPLITS[split]
            )
            out[f"x_{part}"] = np.ascontiguousarray(x.transpose(0, 2, 1))
        return out

    name = f"emnist-{split}"
    a = cached_arrays(name, 1, [source], decode)
    return ArrayDataset(
        name,
        a["x_train"][:, None],
        a["y_train"],
        a["x_test"][:, None],
        a["y_test"],
        EMNIST_SPLITS[split],
        scale=1 / 255,
    )


for _split, _classes in EMNIST_SPLITS.items():
    register(
        f"emnist-{_split}",
        "mlp",
        True,
        f"EMNIST {_split} ({_classes} classes), official gzip.zip in <data-dir>/emnist",
    )(partial(load_emnist, split=_split))


# --- CIFAR ------------------------------------------------------------------------------------

_NUMPY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles CIFAR batches: plain containers and numpy arrays only, nothing executable."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR batch")


#: Number of classes of each CIFAR label key.
CIFAR_CLASSES = {"labels": 10, "fine_labels": 100, "coarse_labels": 20}


def read_cifar_batch(raw: bytes, where: str, label_keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Decode one CIFAR pickle (Python-2 layout, bytes keys) into images and label arrays.

    Returns:
        ``{"x": uint8 [n, 3, 32, 32], <label key>: int64 [n], ...}``.
    """
    try:
        batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means a damaged or foreign file
        raise DataError(
            f"cannot read {where} ({type(exc).__name__}); replace it with the official CIFAR file"
        ) from None
    if not isinstance(batch, dict) or b"data" not in batch:
        raise DataError(f"{where} is not a CIFAR batch (no b'data' key); replace it")
    data = np.asarray(batch[b"data"])
    if data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{where}: data has shape {data.shape}, expected [n, 3072]; replace it")
    out = {"x": data.astype(np.uint8).reshape(-1, 3, 32, 32)}
    for key in label_keys:
        labels = batch.get(key.encode())
        if labels is None or len(labels) != len(data):
            raise DataError(f"{where}: labels {key!r} missing or of the wrong length; replace it")
        try:
            values = np.asarray(labels, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise DataError(f"{where}: labels {key!r} are not integers; replace it") from None
        out[key] = check_labels(values, CIFAR_CLASSES[key], f"{where} ({key})")
    return out


def _cifar_source(root: Path, folder_name: str, key: str) -> Path:
    """The extracted folder or the official tarball (checked, or downloaded into ``root``)."""
    for base in (root, root / key):
        if (base / folder_name).is_dir():
            return base / folder_name
    tarball = REMOTES[key][0].filename
    in_subfolder = (root / key / tarball).is_file() and not (root / tarball).is_file()
    return ensure_files(key, root / key if in_subfolder else root)[0]


def _cifar_members(source: Path, folder_name: str) -> dict[str, bytes]:
    """The raw bytes of every batch file, by file name."""
    if source.is_dir():
        return {p.name: p.read_bytes() for p in sorted(source.iterdir()) if p.is_file()}
    try:
        with tarfile.open(source, "r:gz") as tar:
            return {
                Path(m.name).name: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers()
                if m.isfile() and Path(m.name).parent.name == folder_name
            }
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:  # zlib: a damaged stream
        raise DataError(
            f"cannot read {source} ({exc}); replace it with the official tarball"
        ) from None


def _load_cifar(
    root: Path,
    key: str,
    folder_name: str,
    train_names: list[str] | None,
    test_name: str,
    label_keys: tuple[str, ...],
) -> dict[str, np.ndarray]:
    source = _cifar_source(root, folder_name, key)

    def decode() -> dict[str, np.ndarray]:
        members = _cifar_members(source, folder_name)
        names = train_names or sorted(n for n in members if n.startswith("data_batch_"))
        present = [n for n in names if n in members]
        if not present or test_name not in members:
            wanted = ", ".join([*(train_names or ["data_batch_1..5"]), test_name])
            raise DataError(f"{source} lacks {wanted}; put the official {folder_name} files there")
        if train_names is None and len(present) < 5:
            log.warning(
                "%s: partial copy, using %s only (the official set has data_batch_1..5)",
                source,
                ", ".join(present),
            )
        parts = [read_cifar_batch(members[n], f"{source}/{n}", label_keys) for n in present]
        test = read_cifar_batch(members[test_name], f"{source}/{test_name}", label_keys)
        out = {"x_train": np.concatenate([p["x"] for p in parts]), "x_test": test["x"]}
        for k in label_keys:
            out[f"{k}_train"] = np.concatenate([p[k] for p in parts])
            out[f"{k}_test"] = test[k]
        return out

    return cached_arrays(key, 1, [source], decode)


@register("cifar10", "cnn", True, "CIFAR-10, official pickles in <data-dir>/cifar-10-batches-py")
def load_cifar10(root: Path, seed: int = 0) -> ArrayDataset:
    """CIFAR-10 from ``cifar-10-batches-py/`` or ``cifar-10-python.tar.gz``.

    Every ``data_batch_*`` present is used: a partial copy (for example only batches 1 and 2) loads
    with a warning in the log that names the batches used.
    """
    a = _load_cifar(root, "cifar10", "cifar-10-batches-py", None, "test_batch", ("labels",))
    return ArrayDataset(
        "cifar10", a["x_train"], a["labels_train"], a["x_test"], a["labels_test"], 10, 1 / 255
    )


def load_cifar100(root: Path, seed: int = 0, *, coarse: bool) -> ArrayDataset:
    """CIFAR-100 from ``cifar-100-python/`` or ``cifar-100-python.tar.gz``.

    The class labels are the 100 fine labels, or the 20 coarse ones with ``coarse``. Both label sets
    are kept in ``extra`` (``fine_train``, ``coarse_train``, ...) for the ``pachinko`` partition.
    """
    a = _load_cifar(
        root, "cifar100", "cifar-100-python", ["train"], "test", ("fine_labels", "coarse_labels")
    )
    key = "coarse_labels" if coarse else "fine_labels"
    extra = {
        f"{kind}_{part}": a[f"{kind}_labels_{part}"]
        for kind in ("fine", "coarse")
        for part in ("train", "test")
    }
    return ArrayDataset(
        "cifar100-coarse" if coarse else "cifar100",
        a["x_train"],
        a[f"{key}_train"],
        a["x_test"],
        a[f"{key}_test"],
        20 if coarse else 100,
        1 / 255,
        extra=extra,
    )


register("cifar100", "cnn", True, "CIFAR-100 (100 fine labels), official pickles")(
    partial(load_cifar100, coarse=False)
)
register("cifar100-coarse", "cnn", True, "CIFAR-100 with its 20 coarse labels, official pickles")(
    partial(load_cifar100, coarse=True)
)
