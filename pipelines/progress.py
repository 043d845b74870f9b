"""Progress bar settings shared by the long steps (reading, chunking, embedding)."""

from __future__ import annotations


def tqdm_disable(progress: bool | None) -> bool | None:
    """tqdm's `disable` argument: True/False force bars on/off, None shows them only on a terminal."""
    return None if progress is None else not progress
