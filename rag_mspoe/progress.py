"""Progress bars of the long jobs: reading, chunking and embedding documents, evaluation runs;
and the switch that hides the bars of the libraries we load models with."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

# On a terminal a bar is redrawn at least this often, even while one unit of work runs for
# minutes (a sweep's batch on a CPU), so its elapsed time shows the job is alive.
TICK_SECONDS = 5.0


def tqdm_disable(progress: bool | None) -> bool | None:
    """tqdm's `disable` argument: True/False force bars on/off, None shows them only on a terminal."""
    return None if progress is None else not progress


def progress_bar(
    iterable: Iterable[Any] | None = None, *, desc: str, unit: str, progress: bool | None, **options: Any
) -> Any:
    """A tqdm bar. progress None shows it on a terminal only; a log file gets a line every 30 s.
    On a terminal it is redrawn every TICK_SECONDS while open."""
    from tqdm.auto import tqdm

    terminal = sys.stderr.isatty()
    bar = tqdm(
        iterable,
        desc=desc,
        unit=unit,
        disable=tqdm_disable(progress),
        mininterval=1 if terminal else 30,
        **options,
    )
    if terminal and not bar.disable:
        threading.Thread(target=_tick, args=(bar,), daemon=True).start()
    return bar


def _tick(bar: Any) -> None:
    while True:
        time.sleep(TICK_SECONDS)
        if bar.disable:  # tqdm sets it when the bar closes
            return
        bar.refresh()


def silence_library_bars() -> None:
    """Hide the bars transformers and huggingface_hub draw while loading and saving models
    ("Loading weights", "Writing model shards", downloads); ours stay. Their switch is read when
    they are imported, so it is set in the environment (and through transformers' own function
    if it is imported already). The GGUF conversion's bar follows it (`model_cache`)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def library_bars_enabled() -> bool:
    """Whether transformers draws its bars (see `silence_library_bars`)."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        return bool(hf_logging.is_progress_bar_enabled())
    return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() not in ("1", "true", "yes", "on")
