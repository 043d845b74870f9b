"""A causal prompt read's attention in bf16 on the CPU: blocks of query rows through bf16 products.

torch's CPU kernel for a causal `scaled_dot_product_attention` in bf16 runs far below the speed of
its own bf16 matrix products: 72-75 ms a layer for a 1,319-token prompt on the 1.5B's heads (12 of
128 dimensions, one thread), where the same products in blocks of 64 query rows take 46 ms
(docs/cpu-inference.md). A plain bf16 product rounds each score to 8 bits of mantissa, though, and
scores run into the hundreds (tens of thousands in the Qwen models' first layer): rounded there, a
row's largest scores move by more than softmax forgives. So each block's product takes a shift:
the query gains two columns holding minus its row's largest score (a bf16 pair, high and low
part) and each key two ones, so the product, accumulated in float32, gives `score - max` before
its one rounding to bf16, and the scores that carry the weight round near zero, where bf16 is fine
grained. The row's largest score is read from a plain bf16 product first; where that estimate is
too coarse (a row's shifted maximum still more than `SHIFT_SLACK` from zero, after scaling), the
shift is corrected and the block read again (twice at most, then those rows take float32). The
result is as close to float64 as the kernel's (relative error 1.6-2.2e-3 against its 1.3-1.8e-3
on real prompts' layers; the output's own bf16 rounding is about 2e-3).
"""

from __future__ import annotations

import torch

from rag_mspoe.models.grouped_heads import by_key_head

BLOCK_ROWS = 64  # query rows per product: 64 and 128 measured alike, 256 slower
SHIFT_SLACK = 1.0  # scaled scores: a row's maximum this far from zero rounds by ~0.002 at most
SHIFT_READS = 3  # shifted products per block before the rows still off take float32


def blocked_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """softmax(q k^T * scaling, causal) v for a prompt read whole (query i reads keys 0..i), each
    query head reading KV head h // group. query [B, H, T, D], key and value [B, KV heads, T, D],
    all bf16; returns [B, T, H, D]."""
    rows = query.shape[2]
    ones = torch.ones(*key.shape[:3], 2, dtype=key.dtype, device=key.device)
    shifted_keys = torch.cat([key, ones], dim=-1).transpose(-1, -2)  # [B, KV heads, D + 2, T]
    out = torch.empty_like(query)
    for start in range(0, rows, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, rows)
        # Keys before the block are visible to all its rows; the causal cut lies in its own keys.
        hidden = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).triu(1)
        block = query[:, :, start:end]
        scores = _shifted_scores(block, key[:, :, :end], shifted_keys[..., :end], hidden, scaling)
        weights = torch.softmax(scores.mul_(scaling), dim=-1).to(query.dtype)
        out[:, :, start:end] = by_key_head(weights, value[:, :, :end])
    return out.transpose(1, 2).contiguous()


def _shifted_scores(
    block: torch.Tensor,
    key: torch.Tensor,
    shifted_keys: torch.Tensor,
    hidden: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """float32 q k^T minus each row's largest, -inf where `hidden` (the block's own keys):
    [B, H, rows, keys]."""
    rows = block.shape[2]
    plain = by_key_head(block, key.transpose(-1, -2))
    plain[..., -rows:].masked_fill_(hidden, -torch.inf)
    largest = plain.amax(dim=-1, keepdim=True).float()
    for _ in range(SHIFT_READS):
        high = largest.to(block.dtype)
        low = (largest - high.float()).to(block.dtype)
        shifted = by_key_head(torch.cat([block, -high, -low], dim=-1), shifted_keys).float()
        shifted[..., -rows:].masked_fill_(hidden, -torch.inf)
        top = shifted.amax(dim=-1, keepdim=True)
        off = top.abs() * scaling > SHIFT_SLACK
        if not off.any():
            return shifted
        largest = largest + top
    # Rows still off (none seen on real prompts): their scores in float32, shifted alike.
    batch, head, row = off[..., 0].nonzero(as_tuple=True)
    group = block.shape[1] // key.shape[1]
    exact = block[batch, head, row].float().unsqueeze(1) @ key[batch, head // group].float().transpose(-1, -2)
    shifted[batch, head, row] = exact.squeeze(1) - largest[batch, head, row]
    shifted[..., -rows:].masked_fill_(hidden, -torch.inf)
    return shifted
