"""Prompts prefilled one at a time, then decoded as one batch (`generate_batch` on the CPU).

On the CPU a left-padded batch's prefill costs as much as the prompts' own prefills or more (the
padding is computed too), while a decoding step reads the weights once for every row of the batch.
So each prompt is prefilled alone, under its method exactly as a single call prefills it (its own
document spans, the heads Ms-PoE ranks on its last row), and the caches are joined, left-padded,
for `generate` to decode the rows together, each stopping on its own.

Each cache is cut before the prompt's last token, which the first decoding step reads for every
row at once: `generate` then starts from an ordinary left-padded cache and takes the position
ids from the attention mask. The method's hooks join what each prefill left them
(`ModelHooks.join_prefills`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from rag_mspoe.rope.hooks import cache_argument, returned_cache
from rag_mspoe.rope.rescaling import STATE_ATTR


def joinable(model: Any, method: Any) -> bool:
    """Whether prompts prefilled one at a time under `method` (None: the unmodified model) can
    decode as one batch on `model`: the method's hooks join their prefills, and every layer keeps
    a plain growing cache (a sliding window's or a fixed-size cache does not pad)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if method is not None and not getattr(method.hooks_class(), "joins_prefills", False):
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def prefill_apart(
    model: Any,
    rows: Sequence[Sequence[int]],
    row_context: Callable[[int], AbstractContextManager[Any]],
    before_row: Callable[[], None] = lambda: None,
    after_row: Callable[[int, Any], None] | None = None,
) -> dict[str, Any]:
    """Prefill each row of token ids alone (inside `row_context(row)`, which gives the method the
    row's document spans) and return the joined cache as `generate`'s keyword argument: row b
    holds its first len(rows[b]) - 1 tokens, left-padded. `before_row` runs before each prefill
    (it raises to give up, when the call is cancelled); `after_row(row, output)`, still inside the
    row's context, gets the prefill's output (its cache, whole, is the callee's to extend: the
    join has copied what it keeps, and `output.logits` predicts the token after the prompt)."""
    from transformers.cache_utils import DynamicCache

    hooks = getattr(model, STATE_ATTR, None)
    lengths = [len(ids) for ids in rows]
    if min(lengths) < 2:
        raise ValueError(
            "Joined decoding needs prompts of at least 2 tokens (the last is decoded with the batch); "
            "give a one-token prompt to a padded batch."
        )
    width = max(lengths) - 1
    padded: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per row, per layer: (keys, values)
    states = []
    for row, ids in enumerate(rows):
        before_row()
        with row_context(row):
            output = model(
                input_ids=torch.tensor([list(ids)], device=model.device),
                use_cache=True,
                logits_to_keep=1,  # the first decoding step recomputes the prompt's last logits
            )
            cache = returned_cache(output)
            padded.append(
                [
                    (
                        _left_padded(layer.keys, len(ids) - 1, width),
                        _left_padded(layer.values, len(ids) - 1, width),
                    )
                    for layer in cache.layers
                ]
            )
            states.append(None if hooks is None else hooks.prefill_state())
            if after_row is not None:
                after_row(row, output)
    if hooks is not None:
        hooks.join_prefills(states, lengths)
    layers = [
        (torch.cat([row[index][0] for row in padded]), torch.cat([row[index][1] for row in padded]))
        for index in range(len(padded[0]))
    ]
    return cache_argument(DynamicCache(ddp_cache_data=layers, config=model.config))


def _left_padded(states: torch.Tensor, kept: int, width: int) -> torch.Tensor:
    """[1, heads, tokens, dim] -> [1, heads, width, dim]: the first `kept` tokens, right-aligned."""
    padded = states.new_zeros(*states.shape[:2], width, states.shape[3])
    padded[:, :, width - kept :] = states[:, :, :kept]
    return padded
