"""Attention on the CPU: decoding steps in float32 products, prompts read whole in bf16 blocks.

torch's CPU kernel for `scaled_dot_product_attention` is slow on a decoding step in bf16: one query
row over a 1,300-token cache took 2.6-3.1 ms per layer (12-14 heads, one thread), where the two
products and the softmax in float32 take 0.2 ms and are more exact (the kernel multiplies the
probabilities by the values in bf16). On the Qwen models that was about half of each decoded
token's time (docs/cpu-inference.md). So a model loaded on the CPU (`load_model`) attends through
`step_attention`: calls of up to `STEP_TOKENS` query rows per sequence (a decoding step, a drafted
step's check) take the float32 products; a bf16 prompt read whole (causal, no mask, no cache
before it) takes `blocked_causal_attention` (1.5-1.7x the kernel's speed a layer on the Qwen
models' heads on one machine, 1.16x on the next), and the rest of a bf16 prompt of one sequence
read after a kept start takes the same blocks through `blocked_masked_attention`, so its rows are
those of a whole read; so does a masked read of one sequence within `sparse_mask_reads` (a tree
of prompts); every other call (padded batches, float32 models) takes SDPA as before. Masks mean
what they mean to SDPA. A model whose measured default path the blocks moved past the drift bound
(`EmbeddedModel.prompt_blocks`), and any model loaded unquantised (whose numbers a published sweep
must reproduce), attends through `steps_only_attention`: its prompts keep the kernel.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from rag_mspoe.models.grouped_heads import by_key_head
from rag_mspoe.models.prompt_attention import (
    blocked_causal_attention,
    blocked_masked_attention,
    reads_sparse_masks,
)

NAME = "rag_mspoe_sdpa"
STEPS_ONLY_NAME = "rag_mspoe_steps"  # decoding steps in float32, every prompt through the kernel
# Query rows per sequence up to which a call takes the float32 products: a drafted step checks
# `rag_mspoe.engine.engine_base.PROMPT_LOOKUP_TOKENS` + 1 = 11 rows.
STEP_TOKENS = 16


def use_step_attention(model: Any, *, prompt_blocks: bool = True) -> None:
    """Make `model` (on the CPU, attending through SDPA) attend through `step_attention` (or, with
    `prompt_blocks=False`, `steps_only_attention`); any other model is left as it is. Its config's
    `_attn_implementation` then names it (`NAME`, `STEPS_ONLY_NAME`); "sdpa" restores."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    if config._attn_implementation != "sdpa" or model.device.type != "cpu":
        return
    name, attention = (NAME, step_attention) if prompt_blocks else (STEPS_ONLY_NAME, steps_only_attention)
    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)  # the masks SDPA takes
    config._attn_implementation = name


def step_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    prompt_blocks: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, Tq, D], key and value [B, KV heads, Tk, D]
    (after RoPE and the cache update); returns [B, Tq, H, D]. Long calls but bf16 prompts read
    whole, dropout, and what only SDPA's wrapper knows (a position bias, a paged cache, a soft cap)
    go to SDPA."""
    rows = query.shape[2]
    if dropout or any(kwargs.get(name) is not None for name in _SDPA_ONLY):
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if rows > STEP_TOKENS:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        # A tree of prompts (one sequence, a boolean mask): each block of rows over its own keys.
        tree = attention_mask if reads_sparse_masks() and query.shape[0] == 1 else None
        if tree is not None and tree.dtype == torch.bool:
            return blocked_masked_attention(query, key, value, tree, scale), None
        whole_read = attention_mask is None and is_causal and key.shape[2] == rows
        if prompt_blocks and whole_read and query.dtype == torch.bfloat16:
            return blocked_causal_attention(query, key, value, scale), None
        # The rest of one prompt read after a kept start: the same blocks, so its rows are a whole
        # read's and an answer from a kept start is the whole read's.
        one_bf16_prompt = prompt_blocks and query.shape[0] == 1 and query.dtype == torch.bfloat16
        mask = attention_mask if one_bf16_prompt else None
        if mask is not None and _plainly_causal_after_start(mask, rows, key.shape[2]):
            return blocked_masked_attention(query, key, value, mask, scale), None
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if attention_mask is None and is_causal and rows > 1:
        # As SDPA's is_causal: row i reads the first i + 1 keys (a prompt read whole).
        key, value = key[:, :, :rows], value[:, :, :rows]
        attention_mask = torch.ones(rows, rows, dtype=torch.bool, device=query.device).tril()
    return float32_attention(query, key, value, attention_mask, scaling), None


steps_only_attention = partial(step_attention, prompt_blocks=False)


def _plainly_causal_after_start(mask: torch.Tensor, rows: int, keys: int) -> bool:
    """Whether `mask` lets each of `rows` rows read every key up to its own after `keys - rows` kept
    ones, and nothing else (no window, no padding: what a whole read's blocks compute)."""
    if mask.dtype != torch.bool or keys <= rows or mask.numel() != rows * keys:
        return False
    causal = torch.ones(rows, keys, dtype=torch.bool, device=mask.device).tril(keys - rows)
    return torch.equal(mask.reshape(rows, keys), causal)


_SDPA_ONLY = ("position_bias", "cache", "softcap", "s_aux")


def _sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(  # type: ignore[no-any-return]
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def float32_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v in float32, each query head reading KV head h // group;
    mask: boolean (True: attend) or additive, broadcastable to [B, H, Tq, Tk]. [B, Tq, H, D]."""
    width = query.shape[-1]
    scores = by_key_head(query.float(), key.float().transpose(-1, -2))
    scores = scores.mul_(width**-0.5 if scaling is None else scaling)
    if mask is not None and mask.dtype == torch.bool:
        # The float minimum rather than -inf: a row with nothing to read averages the values
        # instead of giving NaN.
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    elif mask is not None:
        scores = scores + mask.float()
    out = by_key_head(torch.softmax(scores, dim=-1), value.float())
    return out.transpose(1, 2).contiguous().to(query.dtype)
