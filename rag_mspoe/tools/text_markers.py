"""Where streamed text may stop inside a marker (a stop string, a tool-call tag) not yet whole."""

from __future__ import annotations

from collections.abc import Sequence


def unfinished_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into one of `markers` (held
    back from streaming until the next text decides it)."""
    longest = max((len(m) for m in markers), default=0)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0
