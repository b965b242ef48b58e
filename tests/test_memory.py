"""While a run trains, large freed blocks stay in the C heap: allocating them again faults in no
new pages (glibc); outside the block glibc's defaults hold again."""

from __future__ import annotations

import resource

import pytest
import torch

from pflego.sim import memory
from pflego.sim.memory import retained_heap

pytestmark = pytest.mark.skipif(memory._libc is None, reason="the C library is not glibc")

BLOCK = 64 * 2**20 // 4  # float32 elements of a 64 MiB tensor, over glibc's mmap threshold


def faults_of_a_second_allocation() -> int:
    """Minor page faults of filling a 64 MiB tensor after one like it was filled and freed."""
    torch.empty(BLOCK).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(BLOCK).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_freed_large_block_is_reused_without_page_faults_only_inside_the_block():
    pages = BLOCK * 4 // resource.getpagesize()
    with retained_heap() as applied:
        assert applied
        with retained_heap():  # re-entrant: the inner exit keeps the settings
            pass
        inside = faults_of_a_second_allocation()
    outside = faults_of_a_second_allocation()
    assert inside < pages // 10
    assert outside > pages // 2
