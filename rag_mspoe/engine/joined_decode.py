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

The unmodified model's rows of a token prefix depend on that prefix alone, so a prompt that starts
as an earlier one of the batch does (the same template and documents, another question; a sweep's
gold moved further down) starts from a copy of that prompt's rows and prefills only the rest.
A method's rows can depend on the whole prompt (the heads Ms-PoE ranks on its last row), so
prompts read under one are prefilled whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from rag_mspoe.rope.hooks import cache_argument, cache_grows_plainly, returned_cache
from rag_mspoe.rope.rescaling import STATE_ATTR


def joinable(model: Any, method: Any) -> bool:
    """Whether prompts prefilled one at a time under `method` (None: the unmodified model) can
    decode as one batch on `model`: the method's hooks join their prefills, and every layer keeps
    a plain growing cache (a sliding window's or a fixed-size cache does not pad)."""
    if method is not None and not getattr(method.hooks_class(), "joins_prefills", False):
        return False
    return cache_grows_plainly(model)


def prefill_apart(
    model: Any,
    rows: Sequence[Sequence[int]],
    row_context: Callable[[int], AbstractContextManager[Any]],
    before_row: Callable[[], None] = lambda: None,
    after_row: Callable[[int, Any], None] | None = None,
    share_prefixes: bool = False,
) -> dict[str, Any]:
    """Prefill each row of token ids alone (inside `row_context(row)`, which gives the method the
    row's document spans) and return the joined cache as `generate`'s keyword argument: row b
    holds its first len(rows[b]) - 1 tokens, left-padded. `before_row` runs before each prefill
    (it raises to give up, when the call is cancelled); `after_row(row, output)`, still inside the
    row's context, gets the prefill's output (its cache, whole, is the callee's to extend: the
    join has copied what it keeps, and `output.logits` predicts the token after the prompt).
    share_prefixes: a row that starts with at least `MIN_SHARED_PREFIX` tokens of an earlier row
    prefills only the tokens after them (for the unmodified model only)."""
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
            shared, start = (0, None) if not share_prefixes else longest_shared_prefix(rows, row)
            past = {}
            if start is not None:
                offset = width - (len(rows[start]) - 1)  # where the earlier row's tokens begin
                past = cache_argument(_prefix_cache(model, padded[start], offset, shared))
            output = model(
                input_ids=torch.tensor([list(ids[shared:])], device=model.device),
                use_cache=True,
                logits_to_keep=1,  # the first decoding step recomputes the prompt's last logits
                **past,
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


MIN_SHARED_PREFIX = 16  # tokens; below it a copy saves less than it costs


def longest_shared_prefix(rows: Sequence[Sequence[int]], row: int) -> tuple[int, int | None]:
    """(tokens, earlier row): the longest start of `rows[row]` that an earlier row's kept tokens
    (all but its last) begin with, leaving `rows[row]` at least one token to prefill; (0, None)
    when none reaches `MIN_SHARED_PREFIX`."""
    ids = rows[row]
    best, source = 0, None
    for earlier in range(row):
        other = rows[earlier]
        limit = min(len(ids) - 1, len(other) - 1)
        length = 0
        while length < limit and ids[length] == other[length]:
            length += 1
        if length > best:
            best, source = length, earlier
    return (best, source) if best >= MIN_SHARED_PREFIX else (0, None)


def _prefix_cache(model: Any, kept: list[tuple[torch.Tensor, torch.Tensor]], offset: int, length: int) -> Any:
    """A cache of the first `length` tokens of an earlier row, from its left-padded kept states
    (its tokens start at `offset`)."""
    from transformers.cache_utils import DynamicCache

    end = offset + length
    layers = [(keys[:, :, offset:end].clone(), values[:, :, offset:end].clone()) for keys, values in kept]
    return DynamicCache(ddp_cache_data=layers, config=model.config)


def _left_padded(states: torch.Tensor, kept: int, width: int) -> torch.Tensor:
    """[1, heads, tokens, dim] -> [1, heads, width, dim]: the first `kept` tokens, right-aligned."""
    padded = states.new_zeros(*states.shape[:2], width, states.shape[3])
    padded[:, :, width - kept :] = states[:, :, :kept]
    return padded
