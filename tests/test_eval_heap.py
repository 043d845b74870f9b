"""Long runs give the memory they freed back to the system after each unit of work."""

from __future__ import annotations

import os
import sys

import pytest

from rag_mspoe.eval.runs.heap import release_freed_memory, releasing

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def fragment_heap() -> list[bytearray]:
    """Free 200 MB of heap blocks while every tenth stays alive, so the heap cannot shrink from
    its top and glibc keeps the freed pages (blocks of 64 KiB stay under its mmap threshold)."""
    blocks = [bytearray(64 * 1024) for _ in range(3200)]
    for block in blocks:
        block[::4096] = b"x" * len(block[::4096])  # touch every page
    kept = blocks[::10]
    del blocks
    return kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap")
def test_freed_heap_pages_go_back_to_the_system() -> None:
    if not release_freed_memory():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    kept = fragment_heap()
    before = resident_bytes()
    release_freed_memory()
    after = resident_bytes()
    assert len(kept) == 320
    assert before - after > 100 * 2**20, (before, after)


def test_releasing_returns_what_the_scorer_returns_and_passes_its_errors() -> None:
    calls = []

    def score(unit: int) -> list[int]:
        calls.append(unit)
        if unit < 0:
            raise ValueError("bad unit")
        return [unit, unit]

    scored = releasing(score)
    assert scored(3) == [3, 3]
    with pytest.raises(ValueError, match="bad unit"):
        scored(-1)
    assert calls == [3, -1]
