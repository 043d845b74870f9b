"""Where converted models are kept, and the GGUF conversion that fills that cache.

GGUF files are de-quantised by transformers, which takes tens of seconds, so we convert once
into a cache folder and reload from there. The conversion writes into a temporary folder
beside the final one and renames it into place, so an interrupted conversion never leaves a
half-written cache behind. Both the loader (`loading`) and the embedded models
(`embedded_models`) convert through here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV = "RAG_MSPOE_CACHE"


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
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
        shutil.rmtree(tmp, ignore_errors=True)
    return target
