"""The position-awareness score of Ms-PoE (Eq. 1) and the head ranking it gives.

Only the last prompt row of attention is needed, so we never build a T x T matrix: the
score costs one [heads, T] product per layer.
"""

from __future__ import annotations

import torch


def position_awareness(
    last_query: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
    alpha: float,
) -> torch.Tensor:
    """Eq. 1: per query head, the fraction of keys whose weight is at least alpha x the row mean.

    last_query: [B, Hq, D], keys: [B, Hk, T, D] (Hq a multiple of Hk), key_valid: [B, T] bool
    (padding and keys outside a sliding window are False). Returns [B, Hq] in [0, 1].
    """
    batch, num_q, dim = last_query.shape
    num_k = keys.shape[1]
    q = last_query.float().view(batch, num_k, num_q // num_k, dim)
    logits = torch.einsum("bkgd,bktd->bkgt", q, keys.float()) * scaling
    valid = key_valid[:, None, None, :]
    weights = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    count = key_valid.sum(dim=-1).clamp(min=1).float()[:, None, None]
    # The row sums to 1 over the valid keys, so its mean is 1 / count.
    above = (weights >= alpha / count[..., None]) & valid
    return (above.sum(dim=-1).float() / count).reshape(batch, num_q)


def rank_heads(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each head, 0 for the most position-aware (highest score); ties keep head order.

    scores: [..., H] -> ranks [..., H] (long). Rank r gets the r-th ratio of Eq. 2, so the most
    position-aware head gets the ratio nearest 1.
    """
    order = torch.argsort(-scores, dim=-1, stable=True)
    return torch.argsort(order, dim=-1)


def ranks_from_order(order: list[int]) -> torch.Tensor:
    """Ranks from a head order given most position-aware first (the static Ms-PoE format)."""
    return torch.argsort(torch.tensor(order))
