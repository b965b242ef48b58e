"""Image files read out of an official zip or its extracted folder and decoded with Pillow.

Omniglot and Office-Home ship as zips (or extracted folders) of one image file per sample; their
loaders pick the files they need with :func:`image_files` and decode each image to a fixed size
with :func:`decode_image`. Both name the damaged file in a ``DataError``.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image, UnidentifiedImageError

from pflego.errors import DataError


def image_files(
    source: Path, keep: Callable[[tuple[str, ...]], bool], official: str
) -> list[tuple[tuple[str, ...], str, bytes]]:
    """``(path parts, where, bytes)`` of every file that ``keep`` accepts, given the parts of its
    path: the members of the zip ``source``, or the files of the folder ``source`` (their paths
    starting at the folder's own name, as in the zip).

    Raises:
        DataError: The zip cannot be read (``official`` says what to replace it with).
    """
    if source.is_dir():
        files = ((p, p.relative_to(source.parent).parts) for p in sorted(source.rglob("*")))
        return [
            (parts, str(p), p.read_bytes()) for p, parts in files if keep(parts) and p.is_file()
        ]
    out = []
    try:
        with zipfile.ZipFile(source) as z:
            for info in z.infolist():
                parts = PurePosixPath(info.filename).parts
                if keep(parts):
                    out.append((parts, f"{source}:{info.filename}", z.read(info)))
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {source} ({exc}); replace it with {official}") from None
    return out


def decode_image(
    raw: bytes, where: str, mode: str, size: int, resample: Image.Resampling
) -> np.ndarray:
    """One image converted to ``mode`` and resized to ``size`` x ``size`` with ``resample``: uint8
    ``[size, size]`` for a one-band mode (``L``), else ``[size, size, bands]``; a ``DataError``
    naming it (``where``) when Pillow cannot decode it."""
    try:
        with Image.open(io.BytesIO(raw)) as img:
            img = img.convert(mode).resize((size, size), resample)
            return np.asarray(img, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise DataError(
            f"cannot decode {where} ({exc}); replace it with the official file"
        ) from None
