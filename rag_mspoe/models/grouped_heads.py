"""Products of grouped-query attention without copying the KV cache per query head."""

from __future__ import annotations

import torch


def by_key_head(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[B, H, R, X] @ [B, kv_heads, X, Y] -> [B, H, R, Y], query head h reading KV head h // group.

    The query heads of a group share one product, so the KV cache is never copied per query head.
    """
    batch, heads, rows, inner = left.shape
    groups = right.shape[1]
    grouped = left.reshape(batch, groups, (heads // groups) * rows, inner) @ right
    return grouped.reshape(batch, heads, rows, right.shape[-1])
