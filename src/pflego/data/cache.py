"""A cache of decoded dataset arrays, so that the second load of a dataset takes about a second.

Entries are ``.npz`` files in ``$PFLEGO_CACHE`` (default: ``.pflego-cache`` in the default data
directory), never in a ``--data-dir`` folder, which may be shared or read-only. A name carries the
dataset, the decoder version, a hash of the source paths and a fingerprint of the source files
(sizes, modification times), so a replaced file or a new decoder misses the old entry. Entries are
renamed into place once complete: a failed or interrupted decode leaves the cache as it was.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import numpy as np

from pflego.environment import source_files

log = logging.getLogger("pflego.data")

CACHE_DIRNAME = ".pflego-cache"

#: The source files the dataset being loaded reads (see :func:`recording_sources`).
_SOURCES: ContextVar[list[Path] | None] = ContextVar("pflego_sources", default=None)


@contextmanager
def recording_sources() -> Iterator[list[Path]]:
    """Collect the source files every :func:`cached_arrays` call inside the block reads."""
    sources: list[Path] = []
    token = _SOURCES.set(sources)
    try:
        yield sources
    finally:
        _SOURCES.reset(token)


def default_data_dir() -> Path:
    """Where dataset files live by default: ``$PFLEGO_DATA`` if set, else
    ``~/.cache/pflego/data`` (the loaders' and this cache's)."""
    return Path(os.environ.get("PFLEGO_DATA", Path.home() / ".cache" / "pflego" / "data"))


def cache_dir() -> Path | None:
    """``$PFLEGO_CACHE`` if set, else ``.pflego-cache`` inside the default data directory,
    created if needed; ``None`` when it cannot be written."""
    path = Path(os.environ.get("PFLEGO_CACHE") or default_data_dir() / CACHE_DIRNAME)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError:
        return None
    return path


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def source_key(sources: Iterable[Path]) -> str:
    """A short hash of the sources' resolved paths."""
    return _sha1("\n".join(sorted(str(Path(s).resolve()) for s in sources)))


def fingerprint(sources: Iterable[Path]) -> str:
    """A short hash of the sources' paths, sizes and modification times (folders: their files)."""
    stats = [(f, f.stat()) for f in source_files(sources)]
    return _sha1("\n".join(f"{f}\0{st.st_size}\0{st.st_mtime_ns}" for f, st in stats))


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_npz(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:  # damaged: redo
        log.warning("ignoring unreadable cache entry %s (%s)", path, exc)
        return None


def cached_arrays(
    name: str,
    version: int,
    sources: list[Path],
    decode: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The decoded arrays of a dataset (``name``, which the entry's name carries), from the cache
    when it holds them, else from ``decode()`` (which may raise ``DataError``: nothing is written).
    ``version`` is the decoder's (bump it when the decoded form changes); ``sources`` are the
    files or folders the arrays come from."""
    recorded = _SOURCES.get()
    if recorded is not None:
        recorded.extend(Path(s) for s in sources)
    directory = cache_dir()
    if directory is None:
        log.info("no writable cache folder for %s; decoding without a cache", name)
        return decode()
    stem = f"{name}-v{version}-{source_key(sources)}"
    path = directory / f"{stem}-{fingerprint(sources)}.npz"
    if path.is_file():
        arrays = _load_npz(path)
        if arrays is not None:
            return arrays
    arrays = decode()
    save_npz_atomic(path, arrays)
    for stale in directory.glob(f"{stem}-*.npz"):  # entries of replaced source files
        if stale != path:
            stale.unlink(missing_ok=True)
    log.info("cached decoded %s in %s", name, path)
    return arrays
