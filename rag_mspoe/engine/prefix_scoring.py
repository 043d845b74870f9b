"""Score the continuations of many prompts, computing each run of tokens they share once.

Prompts that start alike are laid out as a trie of token runs: the prompts of one example in a
gold-position sweep are identical up to the earliest gold document, and every prompt shares the
chat template's system turn and the instruction. Each run is computed once and its KV cache is
extended by a copy for every branch below it, so a prompt costs only the tokens after the
point where it leaves the others. At each prompt's end its continuations are scored as
`Engine.score_continuations` scores them: one right-padded batch over the repeated cache, with
logits only where a continuation's token is predicted.

Exact only for methods whose rotation of a token does not depend on what comes after it in the
prompt (`shares_prefixes`); per-prompt Ms-PoE ranks its heads on the prompt's last token and
hidden-state scaling recomputes the prompt's last rows, so both need a prompt's whole prefill.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_mspoe.methods.method_config import MethodConfig
from rag_mspoe.rope.hooks import cache_argument, returned_cache

Score = tuple[float, int]  # (sum of log-probabilities, tokens scored)
# transformers RoPE types whose frequencies change with the sequence length seen.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class Continuations:
    """One prompt's token ids and, per continuation, the ids of prompt + continuation."""

    context: list[int]
    candidates: list[list[int]]
    spans: list[tuple[int, int]] | None = None  # the documents' token spans, for methods that read them

    @property
    def starts(self) -> list[int]:
        """Per continuation, the first token scored: where it changes the prompt's tokenization
        (a continuation can merge with the prompt's last tokens), never the very first token."""
        return [max(1, shared_length(self.context, ids)) for ids in self.candidates]

    @property
    def prefill(self) -> list[int]:
        """The prompt tokens every continuation keeps: what the cache holds before they are scored."""
        return self.context[: min(self.starts)]


def shares_prefixes(method: MethodConfig | None, model_config: Any = None) -> bool:
    """Whether a prompt's prefix computes the same under `method` whatever follows it: the
    unmodified model and methods that declare it (`MethodConfig.shares_prompt_prefixes`), unless
    the model's RoPE type (from `model_config`) picks its frequencies by sequence length.
    """
    if model_config is not None and _length_dependent_rope(model_config):
        return False
    return method is None or method.shares_prompt_prefixes()


def _length_dependent_rope(config: Any) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
    return any(entry.get("rope_type") in LENGTH_DEPENDENT_ROPE for entry in per_type)


def score(model: Any, requests: Sequence[Continuations], pad_id: int) -> list[list[Score]]:
    """(sum of log-probabilities, tokens) of every continuation of every request, in order.

    The caller holds the model, applies the method, and turns gradients off.
    """
    results: list[list[Score]] = [[] for _ in requests]
    prefills = [request.prefill for request in requests]
    order = sorted(range(len(requests)), key=lambda index: prefills[index])
    _extend(model, requests, prefills, order, 0, None, None, results, pad_id)
    return results


def score_from(model: Any, request: Continuations, cache: Any, depth: int, pad_id: int) -> list[Score]:
    """`score` of one request whose first `depth` prompt tokens `cache` already holds."""
    results: list[list[Score]] = [[]]
    _extend(model, [request], [request.prefill], [0], depth, cache, None, results, pad_id)
    return results[0]


def score_after_prefill(
    model: Any, request: Continuations, cache: Any, logits: torch.Tensor, pad_id: int
) -> list[Score]:
    """`score` of one request whose whole prefill `cache` holds (extended here), `logits`
    ([1, 1, vocab]) predicting the token after it: scores from a prefill made for something else."""
    return _score_continuations(model, request, len(request.prefill), cache, logits, pad_id)


def _extend(
    model: Any,
    requests: Sequence[Continuations],
    prefills: list[list[int]],
    group: list[int],
    depth: int,
    cache: Any,
    logits: torch.Tensor | None,
    results: list[list[Score]],
    pad_id: int,
) -> None:
    """Score the requests of `group`, whose prefills agree on their first `depth` tokens, which
    `cache` holds (`logits`: the prediction after them)."""
    end = depth + shared_length(*(prefills[index][depth:] for index in group))
    if end > depth:
        ids = torch.tensor([prefills[group[0]][depth:end]], device=model.device)
        out = model(ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        cache, logits = returned_cache(out), out.logits
    assert logits is not None  # every prefill has at least one token
    leaves = [index for index in group if len(prefills[index]) == end]
    branches: dict[int, list[int]] = {}
    for index in group:
        if len(prefills[index]) > end:
            branches.setdefault(prefills[index][end], []).append(index)
    users = len(leaves) + len(branches)
    for index in leaves:
        users -= 1
        own = copy.deepcopy(cache) if users else cache  # the last user may extend the cache itself
        results[index] = _score_continuations(model, requests[index], end, own, logits, pad_id)
    for branch in branches.values():
        users -= 1
        own = copy.deepcopy(cache) if users else cache
        _extend(model, requests, prefills, branch, end, own, logits, results, pad_id)


def _score_continuations(
    model: Any, request: Continuations, shared: int, cache: Any, logits: torch.Tensor, pad_id: int
) -> list[Score]:
    """Score a request's continuations on the cache of its first `shared` tokens; `logits`
    ([1, 1, vocab]) predicts token `shared`."""
    candidates = request.candidates
    rows = [ids[shared:-1] for ids in candidates]  # inputs; the last token predicts nothing
    width = max(len(row) for row in rows)
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for index, row in enumerate(rows):
        inputs[index, : len(row)] = torch.tensor(row, dtype=torch.long)
    predictions = logits.float().expand(len(rows), 1, -1)
    if width:
        # Right padding follows every real token, so causal attention keeps it out of them.
        cache.batch_repeat_interleave(len(rows))
        rest = model(inputs.to(model.device), **cache_argument(cache), use_cache=True).logits.float()
        predictions = torch.cat([predictions, rest], dim=1)
    logprobs = torch.log_softmax(predictions, dim=-1)
    results = []
    for index, (ids, start) in enumerate(zip(candidates, request.starts, strict=True)):
        targets = torch.tensor(ids[start:], dtype=torch.long, device=logprobs.device)
        picked = logprobs[index, start - shared : len(ids) - shared].gather(1, targets[:, None])
        results.append((float(picked.sum()), len(targets)))
    return results


def shared_length(*sequences: Sequence[int]) -> int:
    """Length of the common start of token lists."""
    shortest = min(len(sequence) for sequence in sequences)
    first = sequences[0]
    for position in range(shortest):
        token = first[position]
        if any(sequence[position] != token for sequence in sequences[1:]):
            return position
    return shortest
