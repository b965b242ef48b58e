"""FEMNIST and Shakespeare in LEAF's JSON format: one writer / one speaking role per client.

LEAF (Caldas et al.) writes each split as JSON files of the form
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``. LEAF
ships no ready-made files to download: its preprocessing scripts produce them. Point the loader at
the folder those scripts fill, ``<data-dir>/<name>/`` holding ``train/*.json`` and ``test/*.json``
(LEAF's own ``data/train`` / ``data/test`` layout is accepted too), or only ``all_data/*.json``, in
which case each client's samples are split into train and test by the partition's fractions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pflego.data.cache import cached_arrays
from pflego.data.datasets import register
from pflego.data.federated import ArrayDataset
from pflego.errors import DataError

# LEAF's character vocabulary for Shakespeare (models/shakespeare, language_utils.ALL_LETTERS).
SHAKESPEARE_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
#: Character code -> its index in the vocabulary (every letter is ASCII).
_LETTER_CODES = np.zeros(128, dtype=np.uint8)
_LETTER_CODES[[ord(c) for c in SHAKESPEARE_LETTERS]] = np.arange(len(SHAKESPEARE_LETTERS))


def leaf_folders(root: Path, name: str) -> tuple[list[Path], list[Path]]:
    """The train and test JSON files of a LEAF dataset (test empty for an ``all_data`` copy)."""
    base = root / name
    for folder in (base, base / "data"):
        train, test = (sorted((folder / split).glob("*.json")) for split in ("train", "test"))
        if train and test:
            return train, test
    for folder in (base, base / "data"):
        every = sorted((folder / "all_data").glob("*.json"))
        if every:
            return every, []
    raise DataError(
        f"{name}: no LEAF JSON files found; run LEAF's preprocessing (github.com/TalwalkarLab/leaf) "
        f"and put its train/*.json and test/*.json in {base}"
    )


def read_leaf_json(path: Path) -> dict[str, dict[str, list[Any]]]:
    """``user -> {"x": [...], "y": [...]}`` from one LEAF JSON file, checking its structure."""
    try:
        with open(path, encoding="utf-8") as f:
            blob = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"cannot read {path} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "regenerate it with LEAF's preprocessing"
        ) from None
    users = blob.get("user_data") if isinstance(blob, dict) else None
    if not isinstance(users, dict):
        raise DataError(f"{path} is not a LEAF file (no 'user_data' mapping); regenerate it")
    for user, d in users.items():
        if not isinstance(d, dict) or not {"x", "y"} <= set(d) or len(d["x"]) != len(d["y"]):
            raise DataError(
                f"{path}: user {user!r} lacks matching 'x' and 'y' lists; regenerate it"
            )
    return users


def _decode_split(
    files: list[Path], user_index: dict[str, int], encode: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples of one split; users get ids in order of first appearance (shared across splits)."""
    xs, ys, groups = [], [], []
    for path in files:  # one file at a time: LEAF's JSON is far larger than the arrays
        for user, d in read_leaf_json(path).items():
            if not d["y"]:
                continue
            x, y = encode(d["x"], d["y"], path)
            xs.append(x)
            ys.append(y)
            groups.append(np.full(len(y), user_index.setdefault(user, len(user_index)), np.int64))
    if not xs:
        raise DataError(f"{files[0].parent} holds no samples; regenerate the LEAF files")
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(groups)


def load_leaf(root: Path, name: str, encode: Any, num_classes: int, scale: float) -> ArrayDataset:
    """A LEAF dataset with one natural client per user (writer / role)."""
    train_files, test_files = leaf_folders(root, name)

    def decode() -> dict[str, np.ndarray]:
        index: dict[str, int] = {}
        x, y, g = _decode_split(train_files, index, encode)
        out = {"x_train": x, "y_train": y, "g_train": g}
        if test_files:
            out["x_test"], out["y_test"], out["g_test"] = _decode_split(test_files, index, encode)
        out["users"] = np.array(list(index))
        return out

    a = cached_arrays(name, 1, train_files + test_files, decode)
    return ArrayDataset(
        name,
        a["x_train"],
        a["y_train"],
        a.get("x_test"),
        a.get("y_test"),
        num_classes,
        scale=scale,
        groups_train=a["g_train"],
        groups_test=a.get("g_test"),
        extra={"group_names": [str(u) for u in a["users"]]},
    )


def _encode_femnist(x: list, y: list, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        pixels = np.asarray(x, dtype=np.float32)
        labels = np.asarray(y, dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f"{path}: FEMNIST x must be lists of 784 numbers; regenerate it") from None
    if pixels.ndim != 2 or pixels.shape[1] != 784 or labels.min() < 0 or labels.max() >= 62:
        raise DataError(
            f"{path}: FEMNIST needs 784 pixels and labels 0..61 per sample; regenerate it"
        )
    images = np.round(np.clip(pixels, 0, 1) * 255).astype(np.uint8).reshape(-1, 1, 28, 28)
    return images, labels


def _encode_shakespeare(x: list, y: list, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        text = "".join(x) + "".join(y)
        unknown = set(text) - set(SHAKESPEARE_LETTERS)
        if unknown or any(len(s) != len(x[0]) for s in x) or any(len(c) != 1 for c in y):
            raise ValueError(f"unknown characters {sorted(unknown)!r}" if unknown else "lengths")
    except (TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: Shakespeare needs equal-length strings over LEAF's vocabulary and one next "
            f"character each ({exc}); regenerate it"
        ) from None
    idx = _LETTER_CODES[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    n, width = len(x), len(x[0])
    return idx[: n * width].reshape(n, width), idx[n * width :].astype(np.int64)


@register("femnist", "mlp", True, "FEMNIST in LEAF's JSON format, one writer per client")
def load_femnist(root: Path, seed: int = 0) -> ArrayDataset:
    """FEMNIST (62 classes, 28x28) from LEAF JSON in ``<data-dir>/femnist``; clients are writers."""
    return load_leaf(root, "femnist", _encode_femnist, 62, 1 / 255)


@register("shakespeare", "lstm", True, "Shakespeare in LEAF's JSON format, one role per client")
def load_shakespeare(root: Path, seed: int = 0) -> ArrayDataset:
    """Shakespeare next-character prediction from LEAF JSON in ``<data-dir>/shakespeare``.

    Inputs are the 80-character strings encoded with LEAF's 80-letter vocabulary (uint8 indices);
    the label is the index of the next character. Clients are speaking roles.
    """
    return load_leaf(root, "shakespeare", _encode_shakespeare, len(SHAKESPEARE_LETTERS), 1.0)
