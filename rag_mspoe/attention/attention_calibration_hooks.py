"""Hooks of attention calibration (`AttentionCalibration`).

In each calibrated layer the original attention runs for every row; then the calibrated query
rows (after the last document; see the config) are recomputed eagerly: softmax weights with the
model's own masking (padding, causal bottom-right, sliding window, soft-capping), each
document's share rescaled, values summed. Those rows are few (the question and each generated
token), so the cost over the unmodified model is small; decoding reads the KV cache as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from rag_mspoe.attention.bias import REFERENCE_BIAS, ZERO_BIAS, PositionalBias, bias_cache_path
from rag_mspoe.attention.document_hooks import (
    AttentionCall,
    DocumentAttentionHooks,
    attention_scaling,
    row_membership,
)
from rag_mspoe.models.grouped_heads import by_key_head
from rag_mspoe.models.loading import model_display_name


class CalibrationSettings(Protocol):
    """What the hooks read of their `AttentionCalibration` (named here, not imported, since that
    module imports this one)."""

    temperature: float | None
    bias: str
    query_rows: int | None
    strength: float


class AttentionCalibrationHooks(DocumentAttentionHooks):
    def __init__(self, model: nn.Module, method: Any) -> None:
        super().__init__(model, method)
        self.calibration: CalibrationSettings = method
        config: Any = model.config
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self._bias: PositionalBias | None = None
        # While estimating the bias: per layer, the [heads, K] attention mass of each slot.
        self.recorded: dict[int, torch.Tensor] | None = None

    def attend(self, call: AttentionCall) -> torch.Tensor:
        layer, query, key, value = call.layer, call.query, call.key, call.value
        queries, keys = query.shape[2], key.shape[2]
        first = self._first_calibrated(queries, keys)
        start = int(first.min())
        # When every row is calibrated (decoding), the original attention would be thrown away.
        every_row = bool((first == 0).all())
        output = None if every_row else call.model_attention()
        if output is not None and start >= queries:
            return output
        device = query.device
        scaling = attention_scaling(call.module, query, call.kwargs)
        logits = by_key_head(query[:, :, start:].float(), key.float().transpose(-1, -2)) * scaling
        weights = self.last_rows_weights(call.module, logits).nan_to_num(0.0)  # a padded row sees no key

        if "member" not in self.per_forward:
            self.per_forward["member"] = row_membership(self.rows, keys, device)
        member = self.per_forward["member"]  # [B, keys, K]
        mass = weights @ member[:, None]  # [B, H, rows, K]
        calibrated = torch.arange(start, queries, device=device)[None] >= first[:, None].to(device)
        if self.recorded is not None:
            self._record(layer, mass, calibrated)
        present = member.sum(dim=1) > 0  # [B, K]
        tables = self.per_prefill.setdefault("bias", {})
        if layer not in tables:
            tables[layer] = self._row_bias(layer, member.shape[-1], device)
        bias = tables[layer]
        factor = self._document_factors(mass, bias, present)
        # Keys outside every document keep their weight.
        key_factor = factor @ member.transpose(1, 2)[:, None] + (1 - member.sum(-1))[:, None, None]
        attended = by_key_head(weights * key_factor, value.float())  # [B, H, rows, D]
        attended = attended.transpose(1, 2).to(query.dtype)
        if output is None:
            return attended.contiguous()
        result = output.clone()
        result[:, start:] = torch.where(calibrated[:, :, None, None], attended, result[:, start:])
        return result

    def _first_calibrated(self, queries: int, keys: int) -> torch.Tensor:
        """[B]: the first query row of this forward each batch row calibrates (`queries`: none)."""
        past = keys - queries  # the cached tokens before this forward's first query
        firsts = []
        for row in self.rows:
            if row is None:
                firsts.append(queries)
                continue
            first = row.end
            if self.calibration.query_rows is not None:
                first = max(first, self.prompt_length - self.calibration.query_rows)
            firsts.append(min(max(first - past, 0), queries))
        return torch.tensor(firsts)

    def _document_factors(
        self, mass: torch.Tensor, bias: torch.Tensor, present: torch.Tensor
    ) -> torch.Tensor:
        """[B, H, rows, K]: the factor on each document's weights; the documents' total is kept."""
        present = present[:, None, None, :]
        bias = bias[:, :, None, :] * self.calibration.strength
        total = mass.sum(dim=-1, keepdim=True)
        if self.calibration.temperature is None:
            count = present.sum(dim=-1, keepdim=True).clamp(min=1)
            mean = (bias * present).sum(dim=-1, keepdim=True) / count
            relevance = (mass - (bias - mean)).clamp(min=0) * present
            norm = relevance.sum(dim=-1, keepdim=True)
            shares = torch.where(norm > 0, relevance * total / norm.clamp(min=1e-30), mass)
        else:
            scores = ((mass - bias) / self.calibration.temperature).masked_fill(~present, float("-inf"))
            shares = torch.softmax(scores, dim=-1).nan_to_num(0.0) * total
        factor = torch.where(mass > 0, shares / mass.clamp(min=1e-30), torch.zeros_like(mass))
        # Mass a document without attention was meant to get cannot be placed: rescale the rest.
        placed = (factor * mass).sum(dim=-1, keepdim=True)
        return factor * torch.where(placed > 0, total / placed.clamp(min=1e-30), torch.ones_like(placed))

    def _row_bias(self, layer: int, most: int, device: torch.device) -> torch.Tensor:
        """[B, H, K]: each row's bias per slot (0 past its documents)."""
        bias = torch.zeros(len(self.rows), self.num_heads, most, device=device)
        if self.calibration.bias == ZERO_BIAS or self.recorded is not None:
            return bias
        for b, row in enumerate(self.rows):
            if row is not None:
                count = len(row.spans)
                bias[b, :, :count] = self._bias_table(count)[layer].to(device)
        return bias

    def _bias_table(self, count: int) -> torch.Tensor:
        source = self._bias_source()
        table = self._bias.table(count, self.num_layers, self.num_heads) if self._bias else None
        if table is None and source.is_file():
            self._bias = PositionalBias.load(source)  # estimated since we last looked
            table = self._bias.table(count, self.num_layers, self.num_heads)
        if table is None:
            raise ValueError(
                f"No positional-bias estimate for {count} documents in {source}. Estimate it once with "
                f"rag_mspoe.attention.estimate_positional_bias(model, tokenizer, {count}), or use "
                "AttentionCalibration(bias='zero') or bias='<a saved estimate>.json'."
            )
        return table

    def _bias_source(self) -> Path:
        if self.calibration.bias == REFERENCE_BIAS:
            return bias_cache_path(model_display_name(self.model))
        source = Path(self.calibration.bias).expanduser()
        if not source.is_file():
            raise FileNotFoundError(
                f"AttentionCalibration.bias is {self.calibration.bias!r}: no such estimate. Use "
                f"{REFERENCE_BIAS!r}, {ZERO_BIAS!r} or a file written by "
                "estimate_positional_bias(..., save=path)."
            )
        return source

    def _record(self, layer: int, mass: torch.Tensor, calibrated: torch.Tensor) -> None:
        assert self.recorded is not None
        weight = calibrated[:, None, :, None].float()  # [B, 1, rows, 1]
        per_row = (mass * weight).sum(dim=2) / weight.sum(dim=2).clamp(min=1)  # [B, H, K]
        self.recorded[layer] = per_row.mean(dim=0)
