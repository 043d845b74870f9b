"""The positional bias of attention calibration: estimated once per model and number of documents.

The bias of slot k is the attention a reference document gets when it sits in slot k. Putting
the same reference document in every slot of one prompt measures all slots at once: their
relevance is equal, so what differs between them is position. Estimates are kept in one JSON
file per model under the cache directory, one entry per number of documents (the layout).
The estimation runs the method itself, so it lives with it (`calibration.estimate_positional_bias`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rag_mspoe.files import atomic_write
from rag_mspoe.models.model_cache import cache_dir

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
    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", model_name).strip("-") or "model"
    return cache_dir() / "positional_bias" / f"{safe}.json"


def cached_layouts(model_name: str) -> set[int]:
    """The numbers of documents whose bias the cache holds for a model."""
    path = bias_cache_path(model_name)
    return set(PositionalBias.load(path).layouts) if path.is_file() else set()
