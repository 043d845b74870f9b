"""Where converted models are kept, and the GGUF conversion that fills that cache.

GGUF files are de-quantised by transformers, which takes tens of seconds, so we convert once
into a cache folder and reload from there. The conversion writes into a temporary folder
beside the final one and renames it into place, so an interrupted conversion never leaves a
half-written cache behind. Both the loader (`loading`) and the embedded models
(`embedded_models`) convert through here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rag_mspoe.progress import library_bars_enabled, progress_bar

logger = logging.getLogger(__name__)

CACHE_ENV = "RAG_MSPOE_CACHE"
# What a conversion costs on two CPU cores, for the line that announces it: a fixed part and a
# part per MB of GGUF file, fitted to the 0.5B (491 MB) and SmolLM2 (98 MB) converted one after the
# other (118 s and 43 s on a busy machine), scaled to the 58 s the 0.5B takes on a quieter one.
_SECONDS_FIXED = 12.0
_SECONDS_PER_MB = 0.094


class ModelLoadError(RuntimeError):
    """A model could not be found or converted; the message says what to do."""


def cache_dir() -> Path:
    """Where converted models are kept: $RAG_MSPOE_CACHE, else ~/.cache/rag_mspoe."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "rag_mspoe"


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cache folder for one GGUF file, keyed by its name, size and modification time."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path, target: Path | None = None) -> Path:
    """Convert a GGUF file to a Hugging Face folder (once) and return the folder.

    target defaults to the cache folder of the file (`converted_gguf_dir`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = target or converted_gguf_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s into %s (once)", gguf_path, target)
    expected = round(conversion_seconds(gguf_path))
    print(
        f"{gguf_path.name}: converting once into the cache, about {expected} s (later loads take seconds)",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    # On a terminal, the time spent so far, redrawn while transformers works.
    elapsed = progress_bar(
        desc="converting", unit="s", progress=None, leave=False, bar_format="{desc}: {elapsed} elapsed"
    )
    try:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        with _gguf_bar_as_transformers():
            model: Any = AutoModelForCausalLM.from_pretrained(gguf_path.parent, **kwargs)
        # The weights are already de-quantised; drop the GGUF marker so the folder saves and
        # reloads as a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        elapsed.close()
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted %s in %.0f s", gguf_path.name, time.perf_counter() - started)
    return target


def conversion_seconds(gguf_path: Path) -> float:
    """About how long converting this GGUF file takes on two CPU cores."""
    return _SECONDS_FIXED + _SECONDS_PER_MB * gguf_path.stat().st_size / 1e6


@contextlib.contextmanager
def _gguf_bar_as_transformers() -> Iterator[None]:
    """transformers' GGUF reader draws its "de-quantizing" bar with tqdm directly, past its own
    switch for bars; hide that bar too when the switch is off (`progress.silence_library_bars`)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if library_bars_enabled():
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original
