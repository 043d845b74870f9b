"""Teacher-forced scoring: log-likelihoods of fixed continuations, and prefills for calibration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict, Unpack

import torch

from rag_mspoe.attention.spans import document_spans
from rag_mspoe.engine import prefix_scoring
from rag_mspoe.engine.engine_base import EngineBase
from rag_mspoe.engine.engine_types import ENGINE_DEFAULT, CallMethod, Prefill, PromptTooLongError
from rag_mspoe.engine.stopping import TextTracker
from rag_mspoe.engine.token_logprobs import LogprobRecorder, TokenLogprob, check_top_logprobs
from rag_mspoe.methods.method_config import method_name
from rag_mspoe.prompts.chat_template import Prompt
from rag_mspoe.rope.rescaling import frozen_head_order, head_scores

_LOGIT_ROWS = 256


class ScoringOptions(TypedDict, total=False):
    """The keyword options of `score_continuations` (see there), which `loglikelihood` passes on."""

    prefix: str
    raw: bool
    method: CallMethod


def _is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(t, int) for t in prompt)
    )


def _through_documents(request: prefix_scoring.Continuations) -> list[int]:
    """The request's prompt tokens up to the end of its last document."""
    assert request.spans
    return request.prefill[: request.spans[-1][1]]


class ScoringEngine(EngineBase):
    """Scores without generating: `loglikelihood`, `score_continuations`, `prefill`."""

    def loglikelihood(
        self, prompt: Prompt, continuations: Sequence[str], **options: Unpack[ScoringOptions]
    ) -> list[float]:
        """Log-probability of each continuation right after the prompt (and the answer prefix).

        For picking among fixed options (multiple choice, enums, booleans); the sums of
        `score_continuations`, which takes the same options (prefix, raw, method).
        """
        scored = self.score_continuations(prompt, continuations, **options)
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
        resolved, (prompt,) = self._rewritten(self._resolve_method(method), [prompt], raw)
        request = self._continuations(prompt, continuations, raw, prefix, resolved)
        if self._after_documents(resolved, request):
            with self._lock:
                return self._score_after_documents(resolved, [request])[0]
        with self._lock, self._method_applied(resolved, [request.spans]), torch.inference_mode():
            if len(request.prefill) < len(request.context):
                # Ms-PoE ranks heads on the whole prompt's last token, as in `loglikelihood`; the
                # shared tokens then run again with that ranking. Rare, and unlike cropping the
                # cache it works for sliding-window caches too.
                self.model(torch.tensor([request.context], device=self.model.device), logits_to_keep=1)
                with frozen_head_order(self.model):
                    return prefix_scoring.score(self.model, [request], self._pad_id)[0]
            return prefix_scoring.score(self.model, [request], self._pad_id)[0]

    def score_prompts(
        self,
        items: Sequence[tuple[Prompt, Sequence[str]]],
        *,
        method: CallMethod = ENGINE_DEFAULT,
    ) -> list[list[tuple[float, int]]]:
        """`score_continuations` of several (prompt, continuations) at once, the same scores.

        Under methods whose rotation does not depend on the prompt's content (and RoPE types that
        do not depend on its length) the prompts' common starts are computed once
        (`prefix_scoring`): a gold-position sweep's prompts of one example share everything
        before the earliest gold document. Other methods score the prompts one by one.
        """
        resolved, prompts = self._rewritten(self._resolve_method(method), [p for p, _ in items], False)
        items = list(zip(prompts, [texts for _, texts in items], strict=True))
        if not prefix_scoring.shares_prefixes(resolved, self.model.config):
            return [self.score_continuations(p, texts, method=resolved) for p, texts in items]
        requests = [self._continuations(p, texts, False, "", resolved) for p, texts in items]
        with self._lock, self._method_applied(resolved), torch.inference_mode():
            return prefix_scoring.score(self.model, requests, self._pad_id)

    def _after_documents(self, method: Any, request: prefix_scoring.Continuations) -> bool:
        """Whether the request's rows through its documents may come from the unmodified model."""
        spans = request.spans
        return (
            method is not None
            and method.keeps_rows_through_documents()
            and bool(spans)
            and spans[-1][1] < len(request.prefill)  # type: ignore[index]  # not empty: checked above
        )

    def _score_after_documents(
        self, method: Any, requests: Sequence[prefix_scoring.Continuations]
    ) -> list[list[tuple[float, int]]]:
        """Score requests under a method that keeps the rows through the documents: the unmodified
        model's cache of those rows (computed once per prompt, `rag_mspoe.engine.document_prefix`), then
        the question and the answers under the method. The caller holds the lock."""
        with torch.inference_mode():
            with self._method_applied(None):
                caches = [self._document_prefixes.copy_of(_through_documents(r)) for r in requests]
            scores = []
            with self._method_applied(method, [r.spans for r in requests]):
                for request, cache in zip(requests, caches, strict=True):
                    depth = len(_through_documents(request))
                    with document_spans(self.model, [request.spans or []]):
                        scores.append(
                            prefix_scoring.score_from(self.model, request, cache, depth, self._pad_id)
                        )
            return scores

    def prompt_logprobs(
        self, prompt: Prompt, *, top: int = 0, raw: bool = False, method: CallMethod = ENGINE_DEFAULT
    ) -> tuple[TokenLogprob, ...]:
        """Each prompt token with its log-probability given the tokens before it under `method`
        (None for the first token: nothing predicts it) and the `top` (0-20) likeliest tokens at its
        position; text offsets in the decoded prompt. What the OpenAI completions API gives for
        `echo` with `logprobs`."""
        check_top_logprobs(top)
        resolved = self._resolve_method(method)
        if resolved is not None and resolved.rewrites_prompt():
            raise ValueError(
                f"{method_name(resolved)} rewrites the prompt before the model reads it, so the prompt "
                "as given has no log-probabilities under it; score it under another method."
            )
        ids, spans = self._render_for(resolved, prompt, raw, "")  # type: ignore[arg-type]
        if len(ids) > self.context_window:
            raise PromptTooLongError(
                f"The prompt is {len(ids)} tokens, more than the context window of {self.name} "
                f"({self.context_window}); shorten it."
            )
        with self._lock, self._method_applied(resolved, [spans]), torch.inference_mode():
            hidden = self.model.get_decoder()(
                input_ids=torch.tensor([ids], device=self.model.device), use_cache=False
            )
            recorder = LogprobRecorder(top, self._token_bytes())
            tracker = TextTracker(self.tokenizer)
            tracker.push(ids[0], recorder.unpredicted(ids[0]))
            # The vocabulary's logits for a few hundred rows at a time: all at once they would
            # take gigabytes on a long prompt.
            for start in range(0, len(ids) - 1, _LOGIT_ROWS):
                rows = hidden.last_hidden_state[0, start : min(start + _LOGIT_ROWS, len(ids) - 1)]
                recorder.record(self._logits(rows))
                for row, token_id in enumerate(ids[start + 1 : start + 1 + len(rows)]):
                    tracker.push(token_id, recorder.entry(row, token_id))
        tracker.flush()
        return tracker.answer_tokens()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states, soft-capped where the model caps its logits."""
        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        resolved = self._resolve_method(method)
        if not _is_token_ids(prompt):
            resolved, (prompt,) = self._rewritten(resolved, [prompt], raw)  # type: ignore[list-item]
        if _is_token_ids(prompt):
            if resolved is not None and resolved.needs_document_spans():
                raise ValueError(
                    f"{method_name(resolved)} needs to know where the documents are; pass the prompt "
                    "as text or messages, not token ids."
                )
            ids: list[int] = [int(token) for token in prompt]  # type: ignore[arg-type]
            spans = None
        else:
            ids, spans = self._render_for(resolved, prompt, raw, "")  # type: ignore[arg-type]
        with self._lock, self._method_applied(resolved, [spans]), torch.inference_mode():
            out = self.model(
                torch.tensor([ids], device=self.model.device), output_hidden_states=hidden_states
            )
            return Prefill(
                tokens=len(ids),
                hidden_states=tuple(h[0].float().cpu() for h in out.hidden_states) if hidden_states else None,
                head_scores={layer: scores[0] for layer, scores in head_scores(self.model).items()},
            )

    def _continuations(
        self, prompt: Prompt, continuations: Sequence[str], raw: bool, prefix: str, method: Any
    ) -> prefix_scoring.Continuations:
        if isinstance(continuations, str) or not continuations:
            raise TypeError("continuations is a non-empty list of strings.")
        context, spans = self._render_for(method, prompt, raw, prefix)
        candidates = [self._render(prompt, raw, prefix + text) for text in continuations]
        longest = max(len(ids) for ids in candidates)
        if longest > self.context_window:
            raise PromptTooLongError(
                f"Prompt and continuation need {longest} tokens, more than the context window of {self.name} "
                f"({self.context_window}); shorten the prompt."
            )
        return prefix_scoring.Continuations(context, candidates, spans)
