"""Shared pieces of the evaluation runner tests: a tiny chat model with the embedded tokenizer."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tiny_models import tiny_model

from rag_mspoe.loading import resolve_source


@functools.cache
def embedded_tokenizer() -> Any:
    """The embedded model's tokenizer (with its chat template), without loading its weights."""
    from transformers import AutoTokenizer

    folder, _ = resolve_source(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_chat_model(max_position_embeddings: int = 2048, seed: int = 0) -> tuple[Any, Any]:
    """A randomly initialised 4-layer Llama over the embedded tokenizer's vocabulary: fast mechanics."""
    tokenizer = embedded_tokenizer()
    model = tiny_model(
        "llama", seed=seed, vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings
    )
    model._rag_mspoe_name = "tiny-llama"
    return model, tokenizer


def save_tiny_chat_model(folder: Path, max_position_embeddings: int = 2048) -> Path:
    """The tiny model saved as a Hugging Face folder, for commands that load a model themselves."""
    model, tokenizer = tiny_chat_model(max_position_embeddings)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
