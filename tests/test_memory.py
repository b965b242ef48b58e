"""While a run trains, large freed blocks stay in the C heap: allocating them again faults in no
new pages (glibc); the outermost exit restores glibc's defaults."""

from __future__ import annotations

import resource

import pytest
import torch

from pflego.sim import memory
from pflego.sim.memory import retained_heap

BLOCK = 64 * 2**20 // 4  # float32 elements of a 64 MiB tensor, over glibc's mmap threshold


def faults_in_steady_state(cycles: int = 4) -> int:
    """Minor page faults of filling and freeing a 64 MiB tensor ``cycles`` times, after as many
    cycles that let the heap settle (the first touch of a block's pages always faults)."""
    for _ in range(cycles):
        torch.empty(BLOCK).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        torch.empty(BLOCK).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(memory._libc is None, reason="the C library is not glibc")
def test_a_freed_large_block_is_reused_without_page_faults_inside_the_block():
    pages = BLOCK * 4 // resource.getpagesize()
    with retained_heap() as applied:
        assert applied
        inside = faults_in_steady_state()
    assert inside < pages // 10  # served from pages the heap kept (a fresh mapping: 4 x pages)


class RecordingLibc:
    """Stands in for glibc and records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append(("mallopt", parameter, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_only_the_outermost_block_sets_and_restores_the_heap_settings(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_libc", libc)
    with retained_heap():
        with retained_heap():
            assert libc.calls == [
                ("mallopt", memory.M_MMAP_MAX, 0),
                ("mallopt", memory.M_TRIM_THRESHOLD, -1),
            ]
        assert len(libc.calls) == 2  # the inner exit keeps them
    assert libc.calls[2:] == [
        ("mallopt", memory.M_MMAP_MAX, memory.DEFAULT_MMAP_MAX),
        ("mallopt", memory.M_TRIM_THRESHOLD, memory.DEFAULT_TRIM_THRESHOLD),
        ("malloc_trim", 0),
    ]
