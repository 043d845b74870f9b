"""Attention calibration ("Found in the Middle", Hsieh et al. 2024): the method's config, and the
estimation of its positional bias (forwards under the method itself, with a zero bias).

The attention a document gets is modelled as relevance plus a positional bias that depends only
on the document's slot. The bias of every slot is estimated once per model and number of
documents (a reference document in every slot, `estimate_positional_bias`; stored as
`rag_mspoe.attention.bias` says), and the attention of the calibrated query rows to each
document is rescaled to its calibrated relevance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from rag_mspoe.attention.attention_calibration_hooks import AttentionCalibrationHooks
from rag_mspoe.attention.bias import (
    REFERENCE_BIAS,
    REFERENCE_QUESTION,
    REFERENCE_TEXT,
    REFERENCE_TITLE,
    ZERO_BIAS,
    PositionalBias,
    bias_cache_path,
    cached_layouts,
)
from rag_mspoe.attention.document_hooks import DocumentAttentionMethod
from rag_mspoe.attention.spans import document_spans, prompt_with_spans
from rag_mspoe.methods.method_config import MethodConfig, check_finite, check_layers, number_argument
from rag_mspoe.models.loading import model_display_name
from rag_mspoe.prompts.qa_prompt import render_qa_prompt
from rag_mspoe.rope.rescaling import STATE_ATTR, rescaled


@dataclass
class AttentionCalibration(DocumentAttentionMethod):
    """Rescale each document's share of attention by its position-calibrated relevance.

    For a calibrated query row, head and layer, let A_k be the attention on document k's tokens,
    D their sum and b_k the positional bias of slot k (the attention a reference document gets
    there). The calibrated relevance is A_k - b_k. Document k's new total is
      temperature None: A_k - (b_k - mean(b)), clipped at 0 and renormalised to D, so a bias that
                        is the same in every slot (zero included) leaves attention unchanged;
      temperature t:    D * softmax((A_k - b_k) / t), the paper's form.
    Each document's tokens keep their proportions; the total attention on documents stays D.

    bias: "reference" (estimated per model and number of documents with
    `rag_mspoe.attention.estimate_positional_bias`, kept in the cache), "zero", or the path of a
    saved estimate (.json). layers: the layers calibrated (default all). query_rows: the query
    rows calibrated: None for every row after the last document (question, answer cue and
    generated tokens; a full forward and a cached decode then agree), n for the last n prompt
    rows and every generated token. strength: a factor on the bias subtracted (0: none, 1: the
    estimate as measured, above 1: more), a setting for calibration to search.
    """

    kind: ClassVar[str] = "attention-calibration"
    alone_because: ClassVar[str] = (
        "it subtracts a positional bias estimated on the unmodified model's attention, which a RoPE "
        "or hidden-state change would no longer match"
    )
    hooks: ClassVar[type[AttentionCalibrationHooks]] = AttentionCalibrationHooks
    presets: ClassVar[dict[str, dict[str, Any]]] = {"attention-calibration": {}}
    argument_name: ClassVar[str] = "attention-calibration"  # attention-calibration:TEMPERATURE
    temperature: float | None = None
    bias: str = REFERENCE_BIAS
    layers: list[int] | None = None
    query_rows: int | None = None
    strength: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature is not None and (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature <= 0
        ):
            raise ValueError(f"temperature must be a positive number or None, got {self.temperature!r}")
        if not isinstance(self.bias, str) or not self.bias:
            raise ValueError(
                f"bias must be {REFERENCE_BIAS!r}, {ZERO_BIAS!r} or the path of a saved estimate, "
                f"got {self.bias!r}"
            )
        check_layers(self.layers)
        check_finite("strength", self.strength)
        if self.strength < 0:
            raise ValueError(f"strength must be 0 or more, got {self.strength}")
        if self.query_rows is not None and self.query_rows < 1:
            raise ValueError(f"query_rows must be at least 1 (or None), got {self.query_rows}")

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        return cls(temperature=number_argument(part, argument))

    def keeps_rows_through_documents(self) -> bool:
        return True  # only rows after the last document are calibrated

    def prepare(self, model: Any, tokenizer: Any, spans: Sequence[Sequence[tuple[int, int]] | None]) -> None:
        """Estimate the reference bias for each number of documents the prompts have and the
        model's cache lacks (one forward each, once per model and number)."""
        if self.bias == REFERENCE_BIAS:
            ensure_reference_bias(model, tokenizer, spans)


def ensure_reference_bias(model: Any, tokenizer: Any, spans: Iterable[Sequence[Any] | None]) -> None:
    """Estimate and keep the reference bias for each number of documents among `spans` (one row
    per prompt) that the model's cache lacks: one forward each, once per model and number."""
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
