"""The positional bias of attention calibration: estimated once per model and number of documents.

The bias of slot k is the attention a reference document gets when it sits in slot k. Putting
the same reference document in every slot of one prompt measures all slots at once: their
relevance is equal, so what differs between them is position. Estimates are kept in one JSON
file per model under the cache directory, one entry per number of documents (the layout).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rag_mspoe.files import atomic_write

# Where the positional bias comes from (see `AttentionCalibration.bias`).
REFERENCE_BIAS = "reference"
ZERO_BIAS = "zero"

REFERENCE_TITLE = "Reference"
REFERENCE_TEXT = "This search result is a placeholder and says nothing about the question."
REFERENCE_QUESTION = "What do the search results say?"


@dataclass
class PositionalBias:
    """Per number of documents K: a [layers, query heads, K] tensor, the attention mass on slot k."""

    model: str
    layouts: dict[int, torch.Tensor] = field(default_factory=dict)

    def table(self, documents: int, layers: int, heads: int) -> torch.Tensor | None:
        values = self.layouts.get(documents)
        if values is not None and tuple(values.shape) != (layers, heads, documents):
            raise ValueError(
                f"The positional bias for {documents} documents has shape {tuple(values.shape)}, but "
                f"this model needs ({layers}, {heads}, {documents}); it was estimated on another model. "
                "Estimate it again with estimate_positional_bias(model, tokenizer, ...)."
            )
        return values

    def save(self, path: str | os.PathLike[str]) -> Path:
        target = Path(path)
        payload = {
            "model": self.model,
            "layouts": {str(k): v.tolist() for k, v in sorted(self.layouts.items())},
        }
        atomic_write(target, (json.dumps(payload) + "\n").encode())
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PositionalBias:
        target = Path(path)
        try:
            data = json.loads(target.read_text())
            layouts = {int(k): torch.tensor(v, dtype=torch.float32) for k, v in data["layouts"].items()}
            return cls(model=str(data.get("model", "")), layouts=layouts)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{target} is not a positional-bias estimate ({exc}); write one with "
                "rag_mspoe.attention.estimate_positional_bias."
            ) from exc


def bias_cache_path(model_name: str) -> Path:
    """Where the estimates for one model are kept: <cache>/positional_bias/<model>.json."""
    from rag_mspoe.loading import cache_dir

    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", model_name).strip("-") or "model"
    return cache_dir() / "positional_bias" / f"{safe}.json"


def cached_layouts(model_name: str) -> set[int]:
    """The numbers of documents whose bias the cache holds for a model."""
    path = bias_cache_path(model_name)
    return set(PositionalBias.load(path).layouts) if path.is_file() else set()


def ensure_reference_bias(model: Any, tokenizer: Any, spans: Iterable[Sequence[Any] | None]) -> None:
    """Estimate and keep the reference bias for each number of documents among `spans` (one row
    per prompt) that the model's cache lacks: one forward each, once per model and number."""
    from rag_mspoe.loading import model_display_name

    counts = {len(row) for row in spans if row}
    missing = sorted(counts - cached_layouts(model_display_name(model)))
    if missing:
        estimate_positional_bias(model, tokenizer, missing)


def estimate_positional_bias(
    model: Any,
    tokenizer: Any,
    num_documents: int | Iterable[int],
    *,
    reference_text: str = REFERENCE_TEXT,
    question: str = REFERENCE_QUESTION,
    save: bool | str | os.PathLike[str] = True,
) -> PositionalBias:
    """Measure the positional bias of `model` for each number of documents, and keep it.

    One forward per layout: the packer's QA prompt with `reference_text` in every slot, through
    the chat template. save=True adds the layouts to the model's file in the cache (where
    AttentionCalibration(bias="reference") looks), a path writes there, False keeps nothing.
    """
    from rag_mspoe.attention.calibration import AttentionCalibration
    from rag_mspoe.attention.spans import document_spans, prompt_with_spans
    from rag_mspoe.loading import model_display_name
    from rag_mspoe.pipelines.packing import render_qa_prompt
    from rag_mspoe.rope.rescaling import STATE_ATTR, rescaled

    counts = [num_documents] if isinstance(num_documents, int) else sorted(set(num_documents))
    if not counts or any(k < 1 for k in counts):
        raise ValueError(f"num_documents must be positive, got {num_documents!r}")
    name = model_display_name(model)
    target = bias_cache_path(name) if save is True else (Path(save) if save else None)
    estimate = (
        PositionalBias.load(target) if target is not None and target.is_file() else PositionalBias(name)
    )
    device = next(model.parameters()).device
    with rescaled(model, AttentionCalibration(bias=ZERO_BIAS)):
        state = getattr(model, STATE_ATTR)
        for count in counts:
            prompt, char_spans = render_qa_prompt(question, [(REFERENCE_TITLE, reference_text)] * count)
            ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
            state.recorded = {}
            with document_spans(model, [spans]), torch.no_grad():
                model(input_ids=torch.tensor([ids], device=device))
            estimate.layouts[count] = torch.stack(
                [state.recorded[layer].cpu() for layer in sorted(state.recorded)]
            )
        state.recorded = None
    if target is not None:
        estimate.save(target)
    return estimate
