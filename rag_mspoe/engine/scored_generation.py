"""Answers and the log-likelihoods of given continuations from one prefill per prompt
(`generate_and_score`: what a sweep measuring both greedy answers and the gold answer asks).

Generating prefills a prompt, and so does scoring a continuation after it: apart, a prompt is read
twice. On the CPU each prompt of a batch is prefilled alone before the rows decode together
(`joined_decode`), and that prefill holds exactly what scoring reads: the prompt's KV cache and the
logits predicting the token after it. So the continuations are scored on it, before the rows
decode. Under the unmodified model (after any rewriting method reordered the prompt) this gives
the scores `score_prompts` gives (to rounding: one forward per prompt instead of shared starts) and
the answers `generate_batch` gives. Other methods, sampling, tools, truncated prompts and
compiled or GPU engines score apart, with the same results as calling both.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from rag_mspoe.engine import prefix_scoring
from rag_mspoe.engine.engine_generation import GeneratingEngine, with_read_order
from rag_mspoe.engine.engine_scoring import ScoringEngine
from rag_mspoe.engine.engine_types import GenerationResult, GenerationSettings
from rag_mspoe.prompts.chat_template import Prompt
from rag_mspoe.rope.hooks import returned_cache

Scores = list[tuple[float, int]]  # per continuation: (sum of log-probabilities, tokens)


class ScoredGeneratingEngine(GeneratingEngine, ScoringEngine):
    """`generate_and_score`: `generate_batch` and `score_prompts` of the same prompts at once."""

    def generate_and_score(
        self,
        items: Sequence[tuple[Prompt, Sequence[str]]],
        *,
        cancel: threading.Event | None = None,
        **settings: Any,
    ) -> list[tuple[GenerationResult, Scores]]:
        """Per (prompt, continuations): the answer `generate_batch` gives under `settings`, and
        each continuation's (sum of log-probabilities, tokens) as `score_prompts` gives them under
        the same method; one prefill per prompt where it can (module docstring)."""
        if isinstance(items, str) or not isinstance(items, Sequence) or not items:
            raise TypeError("generate_and_score takes a non-empty list of (prompt, continuations) pairs.")
        prompts = [prompt for prompt, _ in items]
        config = GenerationSettings.of(settings)
        asked = self._resolve_method(config.method)
        method, rewritten = self._rewritten(asked, prompts, config.raw)
        prepared = [self._prepare(prompt, config, method) for prompt in rewritten]
        requests = [
            self._continuations(prompt, texts, False, "", method)
            for prompt, (_, texts) in zip(rewritten, items, strict=True)
        ]
        shared = self._shares_prefill(config, method, prepared, requests)
        # Greedy answers and scores of equal prompts with equal continuations are equal: run each once.
        keys = self._keys(config, prepared, requests)
        unique: dict[Any, int] = {}
        for number, key in enumerate(keys):
            unique.setdefault(key, number)
        rows = list(unique.values())
        scores: dict[int, Scores] = {}

        def score_row(row: int, output: Any) -> None:
            scores[row] = prefix_scoring.score_after_prefill(
                self.model, requests[rows[row]], returned_cache(output), output.logits, self._pad_id
            )

        answers = self._run(
            [prepared[number] for number in rows],
            config,
            method,
            cancel=cancel,
            shown=asked,
            after_prefill=score_row if shared else None,
        )
        if not shared:
            apart = self.score_prompts([(rewritten[n], items[n][1]) for n in rows], method=method)
            scores = dict(enumerate(apart))
        row_of = {key: row for row, key in enumerate(unique)}
        results = []
        for number, key in enumerate(keys):
            answer = with_read_order(answers[row_of[key]], prompts[number], rewritten[number])
            results.append((answer, scores[row_of[key]]))
        return results

    @staticmethod
    def _keys(config: GenerationSettings, prepared: Sequence[Any], requests: Sequence[Any]) -> list[Any]:
        """Per item, what its answer and scores depend on (its number when sampling)."""
        if config.temperature:
            return list(range(len(prepared)))
        return [
            (item.key, tuple(map(tuple, request.candidates)))
            for item, request in zip(prepared, requests, strict=True)
        ]

    def _shares_prefill(
        self,
        config: GenerationSettings,
        method: Any,
        prepared: Sequence[Any],
        requests: Sequence[prefix_scoring.Continuations],
    ) -> bool:
        """Whether one prefill per prompt gives both the answer and the scores: greedy answers to the
        unmodified model's prompts as scoring reads them (no prefix, tools, grammar, logprobs or
        truncation), on an engine that prefills prompts one at a time."""
        return (
            method is None
            and config.temperature == 0
            and not config.prefix
            and not config.tools
            and config.grammar is None
            and config.logprobs is None
            and self.joins_prefills(prepared, method)
            and all(
                item.truncation is None and item.ids == request.context == request.prefill
                for item, request in zip(prepared, requests, strict=True)
            )
        )
