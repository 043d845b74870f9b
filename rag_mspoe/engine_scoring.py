"""Teacher-forced scoring: log-likelihoods of fixed continuations, and prefills for calibration."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from rag_mspoe.chat_template import Prompt
from rag_mspoe.engine_base import EngineBase
from rag_mspoe.engine_types import ENGINE_DEFAULT, CallMethod, Prefill, PromptTooLongError
from rag_mspoe.rope.rescaling import frozen_head_order, head_scores


def _is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(t, int) for t in prompt)
    )


class ScoringEngine(EngineBase):
    """Scores without generating: `loglikelihood`, `score_continuations`, `prefill`."""

    def loglikelihood(
        self,
        prompt: Prompt,
        continuations: Sequence[str],
        *,
        prefix: str = "",
        raw: bool = False,
        method: CallMethod = ENGINE_DEFAULT,
    ) -> list[float]:
        """Log-probability of each continuation right after the prompt (and the answer prefix).

        For picking among fixed options (multiple choice, enums, booleans); the sums of
        `score_continuations`.
        """
        scored = self.score_continuations(prompt, continuations, prefix=prefix, raw=raw, method=method)
        return [total for total, _ in scored]

    def score_continuations(
        self,
        prompt: Prompt,
        continuations: Sequence[str],
        *,
        prefix: str = "",
        raw: bool = False,
        method: CallMethod = ENGINE_DEFAULT,
    ) -> list[tuple[float, int]]:
        """(sum of log-probabilities, number of tokens) of each continuation right after the prompt.

        The sums `loglikelihood` gives, at the cost of one prompt forward plus one small batched
        forward over all continuations: the prompt's KV cache is repeated once per continuation,
        and the continuations are right-padded, so padding follows every real token and causal
        attention keeps it out of them (its scores are not counted). With Ms-PoE the ranking made
        on the prompt serves every continuation, as in generation.
        """
        if isinstance(continuations, str) or not continuations:
            raise TypeError("continuations is a non-empty list of strings.")
        context = self._render(prompt, raw, prefix)
        candidates = [self._render(prompt, raw, prefix + text) for text in continuations]
        longest = max(len(ids) for ids in candidates)
        if longest > self.context_window:
            raise PromptTooLongError(
                f"Prompt and continuation need {longest} tokens, more than the context window of {self.name} "
                f"({self.context_window}); shorten the prompt."
            )
        # Score from the first token where a continuation changes the prompt's tokenization; it can
        # merge with the prompt's last tokens, so the cache keeps only what all candidates share.
        starts = [max(1, _shared_length(context, ids)) for ids in candidates]
        shared = min(starts)
        rows = [ids[shared:-1] for ids in candidates]  # inputs; the last token predicts nothing
        width = max(len(row) for row in rows)
        inputs = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        for index, row in enumerate(rows):
            inputs[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        resolved = self._resolve_method(method)
        device = self.model.device
        with self._lock, self._method_applied(resolved), torch.inference_mode():
            if shared < len(context):
                # Ms-PoE ranks heads on the whole prompt's last token, as in `loglikelihood`; the
                # shared tokens then run again with that ranking. Rare, and unlike cropping the
                # cache it works for sliding-window caches too.
                self.model(torch.tensor([context], device=device), logits_to_keep=1)
            with frozen_head_order(self.model) if shared < len(context) else contextlib.nullcontext():
                out = self.model(
                    torch.tensor([context[:shared]], device=device), use_cache=True, logits_to_keep=1
                )
            cache = out.past_key_values
            logits = out.logits.float().expand(len(rows), 1, -1)  # predicts token `shared`
            if width:
                cache.batch_repeat_interleave(len(rows))
                rest = self.model(inputs.to(device), past_key_values=cache, use_cache=True).logits.float()
                logits = torch.cat([logits, rest], dim=1)
            logprobs = torch.log_softmax(logits, dim=-1)
        results = []
        for index, (ids, start) in enumerate(zip(candidates, starts, strict=True)):
            targets = torch.tensor(ids[start:], dtype=torch.long, device=logprobs.device)
            picked = logprobs[index, start - shared : len(ids) - shared].gather(1, targets[:, None])
            results.append((float(picked.sum()), len(targets)))
        return results

    def prefill(
        self,
        prompt: Prompt | Sequence[int],
        *,
        method: CallMethod = ENGINE_DEFAULT,
        raw: bool = False,
        hidden_states: bool = False,
    ) -> Prefill:
        """Run one prompt (text, messages, or token ids) through the model without generating.

        For calibration: returns the hidden states of every layer when asked, and the Ms-PoE
        position-awareness scores the prefill computed (per-prompt Ms-PoE only).
        """
        ids = list(prompt) if _is_token_ids(prompt) else self._render(prompt, raw, "")  # type: ignore[arg-type]
        resolved = self._resolve_method(method)
        with self._lock, self._method_applied(resolved), torch.inference_mode():
            out = self.model(
                torch.tensor([ids], device=self.model.device), output_hidden_states=hidden_states
            )
            return Prefill(
                tokens=len(ids),
                hidden_states=tuple(h[0].float().cpu() for h in out.hidden_states) if hidden_states else None,
                head_scores={layer: scores[0] for layer, scores in head_scores(self.model).items()},
            )


def _shared_length(a: list[int], b: list[int]) -> int:
    """Length of the common start of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
