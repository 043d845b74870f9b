"""Give the memory a long run has freed back to the system.

A worker that scores prompts of many lengths for hours frees tensors of every size; glibc keeps
the freed pages of its heaps for reuse, and with the sizes ever changing they pile up (a 1.5B
worker grew from 4.6 GB to 7.5-10 GB in an hour, until Ray killed one for memory). `malloc_trim`
hands the free pages back; a call after each unit of work costs milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any, TypeVar

Unit = TypeVar("Unit")
Result = TypeVar("Result")


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot (not glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


def releasing(score: Callable[[Unit], Result]) -> Callable[[Unit], Result]:
    """`score`, returning the memory it freed to the system after each call."""

    def scored(unit: Unit) -> Result:
        try:
            return score(unit)
        finally:
            release_freed_memory()

    return scored
