"""A causal prompt read's attention on the CPU in bf16: blocks of query rows through plain products.

torch's CPU kernel for a causal `scaled_dot_product_attention` in bf16 runs far below the speed of
the matrix products it is made of: 73-77 ms a layer for a 1,319-token prompt on the 1.5B's heads
(12 of 128 dimensions, one thread), where the same attention in blocks of 64 query rows takes 45
(docs/cpu-inference.md). Each block's scores are computed in float32 (a bf16 product would round
scores in the hundreds, or the tens of thousands of the Qwen models' first layer, by more than
softmax forgives); the weights multiply the values in bf16, as the kernel's do. The result is as
close to float64 as the kernel's (relative error 1.5-2.1e-3 against its 1.3-1.8e-3 on real
prompts' layers; the output's own bf16 rounding is about 2e-3).

A read under a mask that hides most keys from most rows (many prompts read together as a tree of
their tokens, `rag_mspoe.attention.token_tree`) goes the same way when asked for
(`sparse_mask_reads`): each block reads only the keys some row of it may see. The kernel computes
every row against every key: a 10-document ranking's tree (1,710 rows) took 226 ms a layer with
the 1.5B's heads, the blocks 41; at 20 documents 885 against 88 (`benchmarks/bench_tree_attention.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from rag_mspoe.models.grouped_heads import by_key_head

BLOCK_ROWS = 64  # query rows per product: 32 and 64 measured alike, 128 slower


def blocked_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """softmax(q k^T * scaling, causal) v for a prompt read whole (query i reads keys 0..i), each
    query head reading KV head h // group. query [B, H, T, D], key and value [B, KV heads, T, D],
    in bf16; returns [B, T, H, D]."""
    rows = query.shape[2]
    queries, keys = query.float(), key.float().transpose(-1, -2)
    out = torch.empty_like(query)
    for start in range(0, rows, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, rows)
        scores = by_key_head(queries[:, :, start:end], keys[..., :end]).mul_(scaling)
        # Keys before the block are visible to all its rows; the causal cut lies in its own keys.
        hidden = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).triu(1)
        scores[..., start:end].masked_fill_(hidden, -torch.inf)
        weights = torch.softmax(scores, dim=-1).to(value.dtype)
        out[:, :, start:end] = by_key_head(weights, value[:, :, :end])
    return out.transpose(1, 2).contiguous()


_SPARSE_MASKS: ContextVar[bool] = ContextVar("sparse_mask_reads", default=False)


@contextlib.contextmanager
def sparse_mask_reads() -> Iterator[None]:
    """Within it, a masked read of one sequence on the CPU (through `step_attention`) attends in
    blocks of query rows, each over the keys its rows may see (`blocked_masked_attention`)."""
    token = _SPARSE_MASKS.set(True)
    try:
        yield
    finally:
        _SPARSE_MASKS.reset(token)


def reads_sparse_masks() -> bool:
    """Whether masked reads go through `blocked_masked_attention` here (`sparse_mask_reads`)."""
    return _SPARSE_MASKS.get()


def blocked_masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """softmax(q k^T * scaling, where `mask`) v for one sequence, each block of query rows over only
    the keys one of its rows may see. query [1, H, Tq, D], key and value [1, KV heads, Tk, D];
    mask: booleans (True: attend) broadcastable to [1, 1, Tq, Tk], every row seeing a key; returns
    [1, Tq, H, D]."""
    rows = query.shape[2]
    visible = mask.expand(1, 1, rows, key.shape[2])[0, 0]
    queries, keys = query.float(), key.float().transpose(-1, -2)
    out = torch.empty_like(query)
    for start in range(0, rows, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, rows)
        seen = visible[start:end]
        columns = seen.any(0).nonzero()[:, 0]
        scores = by_key_head(queries[:, :, start:end], keys[..., columns]).mul_(scaling)
        scores.masked_fill_(~seen[:, columns], -torch.inf)
        weights = torch.softmax(scores, dim=-1).to(value.dtype)
        out[:, :, start:end] = by_key_head(weights, value[:, :, columns])
    return out.transpose(1, 2).contiguous()
