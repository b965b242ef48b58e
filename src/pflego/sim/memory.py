"""The C heap while a run trains: freed memory kept for the next round instead of returned.

A round allocates the same large tensors again and again (activations and their gradients, a
client's or a chunk's at a time). glibc's ``malloc`` serves a block over its mmap threshold
(dynamic, at most 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` when it is
freed, so every round faults in, and the kernel zeroes, every page of those tensors anew: on
PFLEGO's CIFAR-10 CNN (500 images a client) that kernel time was a third of the run. While
:func:`retained_heap` is entered, blocks come from the heap and freed ones stay in it (no mmap
threshold, no trimming); on the way out the thresholds go back to glibc's defaults and the free
memory is returned. The price is a resident size at the run's peak, which it reaches anyway.

Elsewhere than on glibc (macOS, musl, Windows) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# mallopt parameters (<malloc.h>)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: glibc's defaults (DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024

_lock = threading.Lock()
_depth = 0


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else ``None``."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError, TypeError):
        return None


_libc = _glibc()


@contextmanager
def retained_heap() -> Iterator[bool]:
    """Serve large blocks from the heap and keep freed memory in it while the block runs.

    Re-entrant and process-wide (the settings are the C library's): the outermost exit restores
    glibc's defaults and returns the free heap memory to the system.

    Yields:
        Whether the settings took effect (``False`` where the C library is not glibc).
    """
    global _depth
    libc = _libc
    with _lock:
        _depth += 1
        applied = (
            libc is not None
            and _depth == 1
            and bool(libc.mallopt(M_MMAP_MAX, 0))
            and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
        )
    try:
        yield libc is not None
    finally:
        with _lock:
            _depth -= 1
            if libc is not None and _depth == 0 and applied:
                libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
                libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
                libc.malloc_trim(0)
