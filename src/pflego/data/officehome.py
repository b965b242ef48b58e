"""Office-Home: 15,588 images of 65 office and home objects in four domains.

Venkateswara, Eusebio, Chakraborty, Panchanathan. "Deep Hashing Network for Unsupervised Domain
Adaptation". CVPR 2017. Read from the official folder ``OfficeHomeDataset_10072016`` (domains
``Art``, ``Clipart``, ``Product``, ``Real World``, each with one sub-folder of images per class),
or its zip, in ``<data-dir>/office-home`` or ``<data-dir>``; ``Real_World`` is accepted for the
last domain. There is no automatic download: the official copy sits behind a form at
https://www.hemanthdv.org/officeHomeDataset.html and publishes no checksum.

Images are decoded with Pillow (no torchvision), converted to RGB and resized to 32x32 with
bilinear filtering, the size the PGFed authors use (they also normalize to [-1, 1]; here inputs
are in [0, 1] as for CIFAR). Labels are the class folders in sorted order; each sample's natural
group is its domain, so ``partition: natural-dirichlet`` with ``clients: 20`` and ``alpha: 0.3``
gives the PGFed paper's five clients per domain with Dir(0.3) label shares inside each.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from pflego.data.cache import cached_arrays
from pflego.data.datasets import register
from pflego.data.federated import ArrayDataset
from pflego.data.images import decode_image, image_files
from pflego.errors import DataError

ARCHIVE = "OfficeHomeDataset_10072016"
DOMAINS = ("Art", "Clipart", "Product", "Real World")
SPELLINGS = {"Real_World": "Real World"}
IMAGE_SIZE = 32
SUFFIXES = (".jpg", ".jpeg", ".png")
HOME = "https://www.hemanthdv.org/officeHomeDataset.html"


def domain_name(folder: str) -> str | None:
    """The domain a folder name spells, or ``None``."""
    name = SPELLINGS.get(folder, folder)
    return name if name in DOMAINS else None


def has_domains(folder: Path) -> bool:
    present = (
        {domain_name(p.name) for p in folder.iterdir() if p.is_dir()} if folder.is_dir() else set()
    )
    return set(DOMAINS) <= present


def find_source(root: Path) -> Path:
    """The official folder (or its zip) under ``root``."""
    for base in (root / "office-home", root):
        for folder in (base / ARCHIVE, base):
            if has_domains(folder):
                return folder
        if (base / f"{ARCHIVE}.zip").is_file():
            return base / f"{ARCHIVE}.zip"
    raise DataError(
        f"office-home: no {ARCHIVE} folder (Art, Clipart, Product, Real World) or {ARCHIVE}.zip "
        f"in {root / 'office-home'} or {root}; download it from {HOME} (no automatic download)"
    )


def _is_image(parts: tuple[str, ...]) -> bool:
    """Whether a file's path is ``<domain>/<class>/<image>`` (outside ``__MACOSX``)."""
    return (
        len(parts) >= 3
        and parts[-1].lower().endswith(SUFFIXES)
        and domain_name(parts[-3]) is not None
        and "__MACOSX" not in parts
    )


def entries(source: Path) -> list[tuple[str, str, str, bytes]]:
    """``(domain, class, where, image bytes)`` of every image, sorted."""
    files = image_files(source, _is_image, "the official zip")
    out = [(domain_name(parts[-3]), parts[-2], where, raw) for parts, where, raw in files]
    if not out:
        raise DataError(f"{source} holds no <domain>/<class>/<image> files; replace it ({HOME})")
    return sorted(out, key=lambda e: (DOMAINS.index(e[0]), e[1], e[2]))


def _decode_rgb(raw: bytes, where: str) -> np.ndarray:
    """One image as ``[3, 32, 32]`` uint8 RGB."""
    image = decode_image(raw, where, "RGB", IMAGE_SIZE, Image.Resampling.BILINEAR)
    return image.transpose(2, 0, 1)


def decode_officehome(source: Path) -> dict[str, np.ndarray]:
    items = entries(source)
    classes = sorted({c for _, c, _, _ in items})
    index = {c: i for i, c in enumerate(classes)}
    return {
        "x": np.stack([_decode_rgb(raw, where) for _, _, where, raw in items]),
        "y": np.array([index[c] for _, c, _, _ in items], dtype=np.int64),
        "domain": np.array([DOMAINS.index(d) for d, _, _, _ in items], dtype=np.int64),
        "class_names": np.array(classes),
    }


@register(
    "office-home", "cnn", True, "Office-Home, 65 classes in 4 domains (official folder), 32x32"
)
def load_officehome(root: Path, seed: int = 0) -> ArrayDataset:
    """Office-Home with each image's domain as its natural group (see the module docstring)."""
    source = find_source(root)
    a = cached_arrays("office-home", 1, [source], lambda: decode_officehome(source))
    return ArrayDataset(
        "office-home",
        a["x"],
        a["y"],
        None,
        None,
        len(a["class_names"]),
        scale=1 / 255,
        groups_train=a["domain"],
        extra={"group_names": list(DOMAINS), "class_names": [str(c) for c in a["class_names"]]},
    )
