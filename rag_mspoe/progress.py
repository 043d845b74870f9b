"""Progress bars of the long jobs: reading, chunking and embedding documents, evaluation runs."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def tqdm_disable(progress: bool | None) -> bool | None:
    """tqdm's `disable` argument: True/False force bars on/off, None shows them only on a terminal."""
    return None if progress is None else not progress


def progress_bar(
    iterable: Iterable[Any] | None = None, *, desc: str, unit: str, progress: bool | None, **options: Any
) -> Any:
    """A tqdm bar. progress None shows it on a terminal only; a log file gets a line every 30 s."""
    from tqdm.auto import tqdm

    return tqdm(
        iterable,
        desc=desc,
        unit=unit,
        disable=tqdm_disable(progress),
        mininterval=1 if sys.stderr.isatty() else 30,
        **options,
    )
