"""Greedy decoding with drafts looked up in the prompt, from any starting cache.

A RAG answer often copies a run of a document. Each step here proposes the tokens that followed
the latest earlier occurrence of the text's last few tokens, and one forward checks them all: the
tokens the model would have chosen anyway are kept, the first one it would not is replaced by its
own choice. The answer is greedy decoding's, token for token; only the number of forwards drops.

transformers' assisted decoding does the same but reads the whole prompt again when handed a
cache, so an answer that starts from rows already computed (a kept document prefix) could not be
drafted. This loop starts from whatever rows the cache holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import torch

from rag_mspoe.rope.hooks import cache_argument, cache_grows_plainly, returned_cache

LONGEST_NGRAM = 3  # the longest run of last tokens looked up; shorter ones are tried after it

# generate() settings that change greedy choices; this loop applies none of them, so a model whose
# generation config sets one decodes through generate instead.
_NEUTRAL_SETTINGS: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
}


def drafts_apply(model: Any) -> bool:
    """Whether greedy answers of `model` can be drafted here: its generation config changes no
    greedy choice and its cache can be cut back (no sliding window)."""
    config = getattr(model, "generation_config", None)
    if config is not None and any(
        getattr(config, name, None) not in neutral for name, neutral in _NEUTRAL_SETTINGS.items()
    ):
        return False
    return cache_grows_plainly(model)


def drafted_tokens(tokens: Sequence[int], count: int, longest: int = LONGEST_NGRAM) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the largest n up to `longest` that occurs earlier; [] when none does."""
    if count <= 0:
        return []
    for size in range(min(longest, len(tokens) - 1), 0, -1):
        tail = list(tokens[-size:])
        # Latest first: the nearest copy is the likeliest to go on the way the answer does.
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start : start + size]) == tail:
                follows = list(tokens[start + size : start + size + count])
                if follows:
                    return follows
    return []


def decode_with_drafts(
    model: Any,
    ids: Sequence[int],
    *,
    cache: Any | None,
    max_new_tokens: int,
    draft_tokens: int,
    eos_ids: Collection[int],
    finished: Callable[[torch.LongTensor], bool],
) -> list[int]:
    """Greedy decoding of up to `max_new_tokens` after `ids`, drafting up to `draft_tokens` a
    forward. `cache` holds the rows of a start of `ids` (None: nothing read yet); it is used up.
    `finished(sequence)` gets the prompt and every token so far after each forward ([1, length])
    and ends decoding when it returns true, as a stopping criterion of generate does. Returns the
    new tokens; decoding also ends after an end-of-sequence token."""
    from transformers.cache_utils import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    tokens = list(ids)
    unread = tokens[cache.get_seq_length() :]
    if not unread:
        raise ValueError("The cache holds every prompt token; it must leave at least the last one to read.")
    new: list[int] = []
    stops = set(eos_ids)
    while len(new) < max_new_tokens:
        # The prompt is read alone, as plain decoding reads it: a layer may compute a long read
        # otherwise than a short one (`rag_mspoe.models.int8_prompt`), and drafted tokens must be
        # read as greedy decoding reads them.
        count = min(draft_tokens, max_new_tokens - len(new) - 1) if len(unread) == 1 else 0
        draft = drafted_tokens(tokens, count)
        read = torch.tensor([unread + draft], device=model.device)
        output = model(read, use_cache=True, logits_to_keep=len(draft) + 1, **cache_argument(cache))
        cache = returned_cache(output)
        chosen = output.logits[0].argmax(dim=-1).tolist()
        agreed = 0
        while agreed < len(draft) and draft[agreed] == chosen[agreed]:
            agreed += 1
        step = chosen[: agreed + 1]  # the agreed drafts and the model's own next token
        ended = next((i for i, token in enumerate(step) if token in stops), None)
        if ended is not None:
            step = step[: ended + 1]
        # Rows of rejected drafts go; the last chosen token is read at the next forward.
        cache.crop(-(len(draft) - agreed))
        tokens += step
        new += step
        sequence = cast(torch.LongTensor, torch.tensor([tokens], dtype=torch.long, device=model.device))
        if finished(sequence) or ended is not None:
            break
        unread = [step[-1]]
    return new
