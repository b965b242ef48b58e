"""Omniglot: 50 alphabets, 1,623 characters, 20 drawings each (Lake et al.), as PFLEGO uses it.

Read from the official ``images_background.zip`` / ``images_evaluation.zip`` (or their extracted
folders ``images_background/`` / ``images_evaluation/``) in ``<data-dir>/omniglot`` or
``<data-dir>``. Each 105x105 drawing is converted to grayscale with ink bright on a dark background
and resized to 28x28 (Pillow, Lanczos). Each character's drawings are augmented with rotations by
0/90/180/270 degrees as the same class, and then split 75% / 25% into train and test per character
(seeded). Labels are character ids; each sample's natural group is its alphabet, so the ``natural``
partition gives one alphabet per client (50 clients) with local labels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from pflego.data.cache import cached_arrays
from pflego.data.datasets import register
from pflego.data.download import ensure_files
from pflego.data.federated import ArrayDataset
from pflego.data.images import decode_image, image_files
from pflego.errors import DataError

SETS = ("images_background", "images_evaluation")
SIZE = 28
TEST_FRACTION = 0.25


def _decode_png(raw: bytes, where: str) -> np.ndarray:
    """One drawing as ``[28, 28]`` uint8 grayscale, ink bright on a dark background."""
    return 255 - decode_image(raw, where, "L", SIZE, Image.Resampling.LANCZOS)


def _is_drawing(parts: tuple[str, ...]) -> bool:
    """Whether a zip member's path is ``<set>/<alphabet>/<character>/<drawing>.png``."""
    return len(parts) == 4 and parts[-1].lower().endswith(".png")


def _entries(source: Path) -> list[tuple[str, str, str, bytes]]:
    """``(alphabet, character, file, png bytes)`` for every drawing of one set."""
    files = image_files(source, _is_drawing, "the official Omniglot zip")
    out = [(parts[1], parts[2], where, raw) for parts, where, raw in files]
    if not out:
        raise DataError(
            f"{source} holds no <Alphabet>/<character>/*.png drawings; "
            "replace it with the official Omniglot file"
        )
    return out


def _sources(root: Path) -> list[Path]:
    """Each set's extracted folder, else its zip (checked against its checksum, downloaded into
    ``<root>/omniglot`` when neither is there)."""
    folder = root / "omniglot" if (root / "omniglot").is_dir() else root
    extracted = [n for n in SETS if (folder / n).is_dir() and not (folder / f"{n}.zip").is_file()]
    zips = [f"{n}.zip" for n in SETS if n not in extracted]
    if not extracted and not any((folder / z).is_file() for z in zips):
        folder = root / "omniglot"
    return [*(folder / n for n in extracted), *ensure_files("omniglot", folder, zips)]


def decode_omniglot(sources: list[Path]) -> dict[str, np.ndarray]:
    """28x28 images of every drawing and of its rotations, with character and alphabet ids.

    The rotations are stored too (rotating 130k images takes longer than reading them back), in
    four blocks: all drawings rotated by 0 degrees, then by 90, 180 and 270.
    """
    entries = sorted(e for s in sources for e in _entries(s))
    alphabets = sorted({a for a, _, _, _ in entries})
    characters = sorted({(a, c) for a, c, _, _ in entries})
    alphabet_id = {a: i for i, a in enumerate(alphabets)}
    char_id = {ac: i for i, ac in enumerate(characters)}
    x = np.stack([_decode_png(raw, where) for _, _, where, raw in entries])
    character = np.array([char_id[(a, c)] for a, c, _, _ in entries], dtype=np.int64)
    alphabet = np.array([alphabet_id[a] for a, _, _, _ in entries], dtype=np.int64)
    return {
        "x": np.concatenate([np.rot90(x, k, axes=(1, 2)) for k in range(4)]),
        "character": np.tile(character, 4),
        "alphabet": np.tile(alphabet, 4),
        "alphabet_names": np.array(alphabets),
    }


def split_per_class(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> np.ndarray:
    """A test mask holding ``round(test_fraction * n_c)`` random samples of each class ``c``."""
    order = np.lexsort((rng.random(len(labels)), labels))
    sorted_labels = labels[order]
    starts = np.searchsorted(sorted_labels, sorted_labels, side="left")
    counts = np.bincount(labels)[sorted_labels]
    rank = np.arange(len(labels)) - starts
    mask = np.zeros(len(labels), dtype=bool)
    mask[order] = rank < np.round(test_fraction * counts)
    return mask


@register("omniglot", "conv4", True, "Omniglot, one alphabet per client (official zips)")
def load_omniglot(root: Path, seed: int = 0) -> ArrayDataset:
    """Omniglot as PFLEGO uses it (see the module docstring); the split depends on ``seed``."""
    sources = _sources(root)
    a = cached_arrays("omniglot", 2, sources, lambda: decode_omniglot(sources))
    x, y, groups = a["x"][:, None], a["character"], a["alphabet"]
    test = split_per_class(y, TEST_FRACTION, np.random.default_rng([seed, 11]))
    return ArrayDataset(
        "omniglot",
        x[~test],
        y[~test],
        x[test],
        y[test],
        int(y.max()) + 1,
        scale=1 / 255,
        groups_train=groups[~test],
        groups_test=groups[test],
        extra={"group_names": [str(n) for n in a["alphabet_names"]]},
    )
