"""Per-layer rotary tables: cos and sin at `position_ids / divisor`, computed by the model's own rotary
module (so its `rope_parameters`: linear, dynamic, yarn, llama3, still apply on top) and kept for
the forward that asked for them.

A layer with one factor (uniform or layer-wise scaling) reads one table; an Ms-PoE layer reads one
per head ratio, gathered into each head's table by its rank (`for_heads`).
"""

from __future__ import annotations

from typing import Any

import torch

from rag_mspoe.rope.architectures import Architecture
from rag_mspoe.rope.hooks import ForwardInfo

# Inputs up to this many tokens (decoding steps) get every rotary table of a forward in one
# call; longer ones compute each table when first needed and keep few, to bound memory.
SHORT_INPUT = 64
_LONG_INPUT_TABLES_KEPT = 2

Tables = tuple[torch.Tensor, torch.Tensor]


class RotaryTables:
    """The cos/sin tables the rescaled layers of one model read, cached per forward."""

    def __init__(
        self, arch: Architecture, decoder: Any, divisors_by_layer: dict[int, tuple[float, ...]]
    ) -> None:
        self.arch = arch
        self.decoder = decoder
        self.rotary = arch.rotary(decoder)
        # Per layer type: every divisor its layers use, sorted (one rotary call covers them), and the
        # divisor tuples its layers ask for.
        every: dict[Any, set[float]] = {}
        self._requests: dict[Any, set[tuple[float, ...]]] = {}
        for index, divisors in divisors_by_layer.items():
            every.setdefault(self.layer_type(index), set()).update(divisors)
            self._requests.setdefault(self.layer_type(index), set()).add(divisors)
        self._every = {key: tuple(sorted(values)) for key, values in every.items()}

    def layer_type(self, index: int) -> Any:
        if self.arch.rope_per_layer_type:
            return self.decoder.layers[index].self_attn.layer_type
        return None

    def for_layer(
        self, forward: ForwardInfo, index: int, hidden: torch.Tensor, divisors: tuple[float, ...]
    ) -> Tables:
        """cos, sin of shape [len(divisors), B, T, D] at `position_ids / divisor`, cached per forward."""
        layer_type = self.layer_type(index)
        tables = forward.tables
        found = tables.get((layer_type, divisors))
        if found is not None:
            return found
        if hidden.shape[1] <= SHORT_INPUT:
            # Decoding: one rotary call gives every table of this layer type for the whole forward,
            # so the other layers only look theirs up.
            every = self._every[layer_type]
            cos_all, sin_all = self._compute(forward, layer_type, hidden, every)
            for wanted in self._requests[layer_type]:
                rows = [every.index(d) for d in wanted]
                tables[(layer_type, wanted)] = (cos_all[rows], sin_all[rows])
            return tables[(layer_type, divisors)]
        # Long inputs: tables are large, so compute each when needed and keep only a few.
        if len(tables) >= _LONG_INPUT_TABLES_KEPT:
            tables.clear()
        result = self._compute(forward, layer_type, hidden, divisors)
        tables[(layer_type, divisors)] = result
        return result

    def for_heads(
        self,
        forward: ForwardInfo,
        index: int,
        hidden: torch.Tensor,
        ratios: tuple[float, ...],
        ranks: torch.Tensor,
    ) -> Tables:
        """cos, sin [B, n, T, D]: each head's table at the ratio of its rank.

        Decoding eagerly on the CPU, layers with the same ranking (few distinct ones) share one
        gather per forward. Elsewhere each layer gathers its own: reading the ranking on the host
        would wait for a GPU, and would break a compiled graph.
        """
        cos_t, sin_t = self.for_layer(forward, index, hidden, ratios)  # [n, Bp, T, D]
        # A model spread over GPUs computes tables where its rotary module sits.
        cos_t, sin_t = cos_t.to(ranks.device), sin_t.to(ranks.device)
        shared = (
            hidden.shape[1] <= SHORT_INPUT
            and ranks.device.type == "cpu"
            and not torch.compiler.is_compiling()
        )
        if not shared:
            return gather_heads(cos_t, ranks), gather_heads(sin_t, ranks)
        key = (self.layer_type(index), ratios, tuple(ranks.shape), tuple(ranks.flatten().tolist()))
        found = forward.tables.get(key)
        if found is None:
            found = (gather_heads(cos_t, ranks), gather_heads(sin_t, ranks))
            forward.tables[key] = found
        return found

    def _compute(
        self, forward: ForwardInfo, layer_type: Any, hidden: torch.Tensor, divisors: tuple[float, ...]
    ) -> Tables:
        positions = forward.position_ids
        if positions is None:
            raise RuntimeError(
                "The decoder's rotary embedding did not run before attention; unsupported model."
            )
        positions = positions.float()
        scaled = torch.stack([positions / d for d in divisors])  # [F, Bp, T]
        flat = scaled.reshape(-1, positions.shape[-1])
        extra = (layer_type,) if self.arch.rope_per_layer_type else ()
        # .forward skips the hook on the rotary module, which must see only the model's call.
        cos, sin = self.rotary.forward(hidden, flat, *extra)
        shape = (len(divisors), *positions.shape, cos.shape[-1])
        return cos.reshape(shape), sin.reshape(shape)


def gather_heads(table: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """table [n, Bp, T, D] by rank, ranks [B or 1, n] -> [B, n, T, D]."""
    batch = max(ranks.shape[0], table.shape[1])
    ranks = ranks.expand(batch, -1)
    if table.shape[1] == 1:
        return table[ranks, 0]
    return table[ranks, torch.arange(batch, device=ranks.device)[:, None]]
