"""Centralized arrays (``ArrayDataset``) and their federated form (``FederatedData``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pflego.data import partition as P
from pflego.errors import ConfigError, DataError


@dataclass
class ArrayDataset:
    """A dataset as loaded from disk, before it is split over clients.

    Attributes:
        name: Dataset name.
        x_train: Training inputs ``[n, ...]`` (uint8 images or float features).
        y_train: Training labels in ``0..num_classes-1``.
        x_test: Official test inputs, or ``None`` when the dataset has no official split.
        y_test: Official test labels, or ``None``.
        num_classes: Number of classes C.
        scale: Factor that turns stored inputs into model inputs (1/255 for uint8 images).
        groups_train: Natural client of each training sample (writer, role, alphabet), if any.
        groups_test: Natural client of each test sample, if any.
        extra: Anything else a partition needs (for example coarse labels).
        sources: The files it was read from (none for generated data), for checksums.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    num_classes: int
    scale: float = 1.0
    groups_train: np.ndarray | None = None
    groups_test: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every loader's output is checked: matching lengths and labels in ``0..C-1``."""
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            groups = getattr(self, f"groups_{split}")
            if y is None:
                continue
            if len(x) != len(y) or (groups is not None and len(groups) != len(y)):
                raise DataError(
                    f"dataset {self.name}: the {split} split has {len(x):,} inputs, {len(y):,} "
                    "labels"
                    + (f" and {len(groups):,} client ids" if groups is not None else "")
                    + "; its files are corrupt, replace them"
                )
            bad = (np.asarray(y) < 0) | (np.asarray(y) >= self.num_classes)
            if bad.any():
                raise DataError(
                    f"dataset {self.name}: {int(bad.sum()):,} {split} labels lie outside "
                    f"0..{self.num_classes - 1}; its files are corrupt, replace them"
                )

    def pooled(self) -> ArrayDataset:
        """The official test split merged into the training data (no official split left).

        Partitions then split each client's samples with ``test_fraction``, as PFLlib and the
        PGFed paper do (a per-client 75/25 split of train and test pooled).
        """
        if self.x_test is None:
            return self
        groups = None
        if self.groups_train is not None and self.groups_test is not None:
            groups = np.concatenate([self.groups_train, self.groups_test])
        extra = dict(self.extra)  # per-sample arrays such as CIFAR-100's fine / coarse labels
        for name in [k[: -len("_train")] for k in self.extra if k.endswith("_train")]:
            if f"{name}_test" in extra:
                test = extra.pop(f"{name}_test")
                extra[f"{name}_train"] = np.concatenate([extra[f"{name}_train"], test])
        return dataclasses.replace(
            self,
            x_train=np.concatenate([self.x_train, self.x_test]),
            y_train=np.concatenate([self.y_train, self.y_test]),
            x_test=None,
            y_test=None,
            groups_train=groups,
            groups_test=None,
            extra=extra,
        )


@dataclass
class FederatedData:
    """Every client's train and test data, held in memory as concatenated tensors.

    Client ``i`` owns rows ``train_offsets[i]:train_offsets[i+1]`` of ``x_train`` (and likewise for
    test). ``client_classes[i]`` lists its classes (global ids, padded with -1 to K_max); local labels
    renumber them to ``0..K_i-1`` for personal heads. The optional validation split
    (``val_fraction > 0``) is laid out the same way; ``groups`` names each client's natural group
    (writer, role, alphabet) for the ``natural`` partition.
    """

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    scale: float
    x_train: Tensor
    y_train: Tensor
    y_train_local: Tensor
    train_offsets: Tensor
    x_test: Tensor
    y_test: Tensor
    y_test_local: Tensor
    test_offsets: Tensor
    client_classes: Tensor
    x_val: Tensor | None = None
    y_val: Tensor | None = None
    y_val_local: Tensor | None = None
    val_offsets: Tensor | None = None
    groups: list[str] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.train_offsets) - 1

    @property
    def train_sizes(self) -> Tensor:
        return self.train_offsets.diff()

    @property
    def test_sizes(self) -> Tensor:
        return self.test_offsets.diff()

    @property
    def total_train(self) -> int:
        return int(self.train_offsets[-1])

    @property
    def max_classes(self) -> int:
        """K_max: the widest client label set (the personal head's width)."""
        return self.client_classes.shape[1]

    def inputs(self, x: Tensor) -> Tensor:
        """Stored inputs as float32 model inputs."""
        converted = x.to(torch.float32)
        return converted.mul_(self.scale) if converted is not x else converted * self.scale

    def train_slice(self, i: int) -> slice:
        return slice(int(self.train_offsets[i]), int(self.train_offsets[i + 1]))

    def test_slice(self, i: int) -> slice:
        return slice(int(self.test_offsets[i]), int(self.test_offsets[i + 1]))

    def subset(self, clients: np.ndarray) -> FederatedData:
        """The clients ``clients`` (in that order) as a population of their own, renumbered 0.."""
        clients = np.asarray(clients, dtype=np.int64)

        def rows(offsets: Tensor) -> tuple[Tensor, Tensor]:
            starts, ends = offsets[:-1][clients], offsets[1:][clients]
            index = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, ends)])
            sizes = ends - starts
            return index.long(), torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])

        changes: dict[str, Any] = {}
        for split in ("train", "test", "val"):
            offsets = getattr(self, f"{split}_offsets")
            if offsets is None:
                continue
            index, new_offsets = rows(offsets)
            changes[f"{split}_offsets"] = new_offsets
            for name in (f"x_{split}", f"y_{split}", f"y_{split}_local"):
                changes[name] = getattr(self, name)[index]
        changes["client_classes"] = self.client_classes[torch.from_numpy(clients)]
        if self.groups is not None:
            changes["groups"] = [self.groups[i] for i in clients]
        return dataclasses.replace(self, **changes)

    def with_local_labels(self) -> FederatedData:
        """The same clients with every label replaced by its local id 0..K_i-1 (C becomes K_max).

        A head shared by all clients then has K_max outputs, output k meaning "this client's k-th
        class": the PFLEGO reference code's shared-head baselines (a 55-way head on Omniglot's
        alphabets, a K-way head on MNIST with K classes per client). Personal heads are unchanged.
        """
        k_max = self.max_classes
        ranks = torch.arange(k_max).expand(self.num_clients, -1)
        classes = torch.where(self.client_classes >= 0, ranks, -1)
        return dataclasses.replace(
            self,
            num_classes=k_max,
            y_train=self.y_train_local,
            y_test=self.y_test_local,
            y_val=self.y_val_local,
            client_classes=classes,
        )

    def class_counts(self, split: str) -> list[dict[int, int]]:
        """Per client, ``{class: samples}`` of one split (``train``, ``test`` or ``val``)."""
        y, offsets = getattr(self, f"y_{split}"), getattr(self, f"{split}_offsets")
        owner = torch.repeat_interleave(torch.arange(self.num_clients), offsets.diff())
        table = torch.zeros(self.num_clients, self.num_classes, dtype=torch.int64)
        table.index_put_((owner, y), torch.ones_like(y), accumulate=True)
        return [
            {int(c): int(table[i, c]) for c in torch.nonzero(table[i]).flatten()}
            for i in range(self.num_clients)
        ]

    def summary(self) -> list[dict[str, Any]]:
        """Per client: its classes (those of its training split), its train / test (/ val)
        sample counts, the per-class counts of each split and its natural group."""
        splits = ("train", "test") + (("val",) if self.val_offsets is not None else ())
        sizes = {split: getattr(self, f"{split}_offsets").diff().tolist() for split in splits}
        counts = {split: self.class_counts(split) for split in splits}
        return [
            {
                "client": i,
                "classes": [int(c) for c in self.client_classes[i] if c >= 0],
                **{split: sizes[split][i] for split in splits},
                **{f"{split}_counts": counts[split][i] for split in splits},
                **({"group": self.groups[i]} if self.groups is not None else {}),
            }
            for i in range(self.num_clients)
        ]


def _concat(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> tuple[Tensor, Tensor, Tensor]:
    idx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
    return (
        torch.from_numpy(x[idx]),
        torch.from_numpy(y[idx].astype(np.int64)),
        torch.from_numpy(offsets),
    )


def _local_labels(y: Tensor, offsets: Tensor, classes: Tensor) -> Tensor:
    """Each sample's label renumbered within its client's sorted class list (one table lookup)."""
    if len(y) == 0:
        return y.clone()
    num_clients, k_max = classes.shape
    width = int(max(int(classes.max()), int(y.max()))) + 1
    table = torch.full((num_clients, width), -1, dtype=torch.int64)
    valid = classes >= 0
    rows = torch.arange(num_clients).unsqueeze(1).expand(-1, k_max)
    ranks = torch.arange(k_max).expand(num_clients, -1)
    table[rows[valid], classes[valid]] = ranks[valid]
    owner = torch.repeat_interleave(torch.arange(num_clients), offsets.diff())
    return table[owner, y]


def from_parts(
    data: ArrayDataset,
    train_parts: list[np.ndarray],
    test_parts: list[np.ndarray],
    val_parts: list[np.ndarray] | None = None,
    groups: list[str] | None = None,
) -> FederatedData:
    """Assemble ``FederatedData`` from per-client index arrays into the train and test pools.

    Test parts index the official test split, or the training arrays when there is none;
    ``val_parts`` (indices into the training pool) give each client a validation split. Each
    client's classes (its personal head's outputs) are those of its training split; test and
    validation samples of other classes get the local label -1.
    """
    pool = (data.x_train, data.y_train) if data.x_test is None else (data.x_test, data.y_test)
    xtr, ytr, otr = _concat(data.x_train, data.y_train, train_parts)
    xte, yte, ote = _concat(*pool, test_parts)
    # A client's label set is the classes of its training split only: a head never has outputs
    # for classes seen only in its test or validation split (their samples count as errors).
    sets = [np.unique(data.y_train[a]).astype(np.int64) for a in train_parts]
    k_max = max(1, max(len(s) for s in sets))
    classes = torch.full((len(sets), k_max), -1, dtype=torch.int64)
    for i, s in enumerate(sets):
        classes[i, : len(s)] = torch.from_numpy(s)
    out = FederatedData(
        name=data.name,
        num_classes=data.num_classes,
        input_shape=tuple(data.x_train.shape[1:]),
        scale=data.scale,
        x_train=xtr,
        y_train=ytr,
        y_train_local=_local_labels(ytr, otr, classes),
        train_offsets=otr,
        x_test=xte,
        y_test=yte,
        y_test_local=_local_labels(yte, ote, classes),
        test_offsets=ote,
        client_classes=classes,
        groups=groups,
    )
    if val_parts is not None:
        out.x_val, out.y_val, out.val_offsets = _concat(data.x_train, data.y_train, val_parts)
        out.y_val_local = _local_labels(out.y_val, out.val_offsets, classes)
    return out


def federate(
    data: ArrayDataset,
    num_clients: int,
    partition: str = "classes",
    classes_per_client: int | str = "high",
    alpha: float = 0.5,
    min_client_size: int = 2,
    test_fraction: float = 0.25,
    seed: int = 0,
    val_fraction: float = 0.0,
    beta: float = 10.0,
) -> FederatedData:
    """Split a dataset over clients by ``partition`` (docs/datasets.md, "Partitions", says what
    each does with ``classes_per_client``, ``alpha``, ``beta`` and the natural groups).

    With an official test split, the same per-client distribution deals train and test (for
    ``natural``, each group's own test samples), so each client's test data follows its training
    distribution. Without one, each client's samples are split at random into train and test with
    ``test_fraction``. ``val_fraction`` then holds out that fraction of each client's training
    samples as a validation split (none at 0).
    """
    if num_clients < 1:
        raise ConfigError(f"clients={num_clients} must be at least 1")
    if num_clients > len(data.y_train):
        raise ConfigError(
            f"clients={num_clients} exceeds the {len(data.y_train)} training samples of "
            f"{data.name}; lower it"
        )
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction} must lie in [0, 1)")
    if partition not in P.PARTITIONS:
        raise ConfigError(
            f"unknown partition {partition!r}; choose one of {', '.join(P.PARTITIONS)}"
        )
    if partition == "auto":
        partition = "natural" if data.groups_train is not None else "classes"
    rng = np.random.default_rng([seed, 7])
    groups = None  # the natural groups' names, where clients are natural groups
    if partition == "natural":
        train_parts, test_parts, groups = _federate_natural(data, num_clients, test_fraction, rng)
    elif partition == "natural-dirichlet":
        train_parts, test_parts, groups = _federate_natural_dirichlet(
            data, num_clients, alpha, min_client_size, test_fraction, rng
        )
    elif partition == "pachinko":
        train_parts, test_parts = _federate_pachinko(
            data, num_clients, alpha, beta, test_fraction, rng
        )
    else:
        k = P.resolve_classes_per_client(classes_per_client, data.num_classes)
        shares = P.class_shares(partition, num_clients, data.num_classes, rng, k, alpha)
        train_parts = P.enforce_min_size(P.deal(data.y_train, shares, rng), min_client_size, rng)
        if data.x_test is None:
            train_parts, test_parts = P.split_train_test(train_parts, test_fraction, rng)
        else:
            test_parts = P.deal(data.y_test, shares, rng)
            if partition != "classes":
                test_parts = P.enforce_min_size(test_parts, 1, rng)
    train_parts, val_parts = P.split_fraction(train_parts, val_fraction, rng)
    return from_parts(data, train_parts, test_parts, val_parts if val_fraction else None, groups)


def _groups(data: ArrayDataset, split: str = "train") -> np.ndarray:
    """Each sample's natural group in ``split``, or a one-line error when the dataset has none."""
    groups = getattr(data, f"groups_{split}")
    if groups is None:
        raise ConfigError(
            f"dataset {data.name} has no natural clients"
            + ("" if split == "train" else " for its test split")
            + "; use partition classes, dirichlet or iid"
        )
    return groups


def _group_names(data: ArrayDataset, groups: np.ndarray) -> list[str]:
    """The names of natural groups (their ids when the dataset names none)."""
    names = data.extra.get("group_names")
    return [str(names[g]) if names is not None else str(int(g)) for g in groups]


def _federate_natural(
    data: ArrayDataset,
    num_clients: int,
    test_fraction: float,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """Each client's training and test indices (into the official test split, or the training
    arrays when there is none) and its natural group's name; likewise below."""
    selected = P.select_groups(_groups(data), num_clients, rng)
    groups = _group_names(data, selected)
    parts = P.group_parts(data.groups_train, selected)
    if data.x_test is None:
        train_parts, test_parts = P.split_train_test(parts, test_fraction, rng)
    else:
        train_parts, test_parts = parts, P.group_parts(_groups(data, "test"), selected)
    return train_parts, test_parts, groups


def _federate_natural_dirichlet(
    data: ArrayDataset,
    num_clients: int,
    alpha: float,
    min_client_size: int,
    test_fraction: float,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    groups = np.unique(_groups(data))
    if num_clients % len(groups):
        raise ConfigError(
            f"natural-dirichlet gives each of the {len(groups)} natural groups of {data.name} "
            f"the same number of clients; set clients to a multiple of {len(groups)}"
        )
    per_group = num_clients // len(groups)
    train_parts, test_parts = [], []
    for g in groups:
        shares = P.class_shares("dirichlet", per_group, data.num_classes, rng, alpha=alpha)
        rows = np.flatnonzero(data.groups_train == g)
        parts = P.deal(data.y_train[rows], shares, rng)
        parts = [rows[p] for p in P.enforce_min_size(parts, min_client_size, rng)]
        if data.x_test is None:
            parts, tests = P.split_train_test(parts, test_fraction, rng)
        else:
            test_rows = np.flatnonzero(_groups(data, "test") == g)
            tests = [test_rows[p] for p in P.deal(data.y_test[test_rows], shares, rng)]
        train_parts += parts
        test_parts += tests
    return train_parts, test_parts, _group_names(data, np.repeat(groups, per_group))


def _federate_pachinko(
    data: ArrayDataset,
    num_clients: int,
    alpha: float,
    beta: float,
    test_fraction: float,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    fine, coarse = data.extra.get("fine_train"), data.extra.get("coarse_train")
    if fine is None or coarse is None:
        raise ConfigError(
            f"the pachinko partition needs coarse and fine labels, which {data.name} lacks; "
            "use cifar100 or cifar100-coarse, or name an hf: dataset's coarse labels with "
            "--set hf_coarse=COLUMN"
        )
    fine_all, coarse_all = fine, coarse
    if data.x_test is not None:
        fine_all = np.concatenate([fine, data.extra["fine_test"]])
        coarse_all = np.concatenate([coarse, data.extra["coarse_test"]])
    parent = P.coarse_of_fine(fine_all, coarse_all)
    coarse_p, fine_p = P.pachinko_distributions(parent, num_clients, alpha, beta, rng)

    def allocate(labels: np.ndarray) -> list[np.ndarray]:
        available = np.bincount(labels, minlength=len(parent))
        sizes = P.even_sizes(len(labels), num_clients)
        counts = P.pachinko_counts(available, parent, coarse_p, fine_p, sizes, rng)
        return P.deal_counts(labels, counts, rng)

    train_parts = allocate(fine)
    if data.x_test is None:
        train_parts, test_parts = P.split_train_test(train_parts, test_fraction, rng)
    else:
        test_parts = allocate(data.extra["fine_test"])
    return train_parts, test_parts
