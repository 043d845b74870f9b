"""Generation: left-padded batches, stop strings, streaming, the model's lock with cancel and
timeout, grammar-constrained decoding and the compiled decode path."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_mspoe.attention.reorder import documents_read
from rag_mspoe.attention.spans import Span
from rag_mspoe.engine.engine_base import EngineBase
from rag_mspoe.engine.engine_types import (
    GenerationCancelled,
    GenerationResult,
    GenerationSettings,
    GenerationTimeout,
    PromptTooLongError,
    Truncation,
)
from rag_mspoe.engine.joined_decode import MIN_SHARED_PREFIX, joinable, prefill_apart
from rag_mspoe.engine.prompt_lookup import decode_with_drafts, drafts_apply
from rag_mspoe.engine.stopping import GenerationWatch, TextTracker
from rag_mspoe.engine.text_stream import AsyncTextStream, End, StreamOutlet, TextStream
from rag_mspoe.engine.token_logprobs import LogprobRecorder
from rag_mspoe.methods.method_config import method_name
from rag_mspoe.prompts.chat_template import Prompt
from rag_mspoe.rope.hooks import CACHE_NAME, cache_argument
from rag_mspoe.tools.grammar import Grammar, GrammarProcessor, grammar_tokenizer


@dataclass(frozen=True)
class _Prepared:
    ids: list[int]
    truncation: Truncation | None
    spans: list[Span] | None = None  # the documents' token spans, for methods that read them

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """What a greedy answer depends on: equal keys, equal answers."""
        return tuple(self.ids), tuple(self.spans or ())


@dataclass(frozen=True)
class StreamRequest:
    """A prompt checked for streaming (`prepare_stream`): what `run_streams` answers."""

    prompt: Prompt
    prepared: _Prepared
    config: GenerationSettings
    method: Any  # resolved from config.method; may rewrite the prompt when it runs


class GeneratingEngine(EngineBase):
    """Answers: `generate`, `generate_batch`, `stream` and their async forms."""

    def generate(
        self, prompt: Prompt, *, cancel: threading.Event | None = None, **settings: Any
    ) -> GenerationResult:
        """Generate an answer. Settings: see `GenerationSettings`.

        cancel: set it (from another thread) to give up on the call: one still waiting for the
        model never starts, one generating stops at the next token; both raise GenerationCancelled.
        """
        return self.generate_batch([prompt], cancel=cancel, **settings)[0]

    def generate_batch(
        self, prompts: Sequence[Prompt], *, cancel: threading.Event | None = None, **settings: Any
    ) -> list[GenerationResult]:
        """Generate answers for several prompts decoded as one batch (`cancel`: see `generate`).

        On the CPU each prompt is prefilled alone and the rows then decode together
        (`joined_decoding`, `rag_mspoe.engine.joined_decode`); compiled or on a GPU the prompts
        are prefilled as one left-padded batch. Each row stops on its own."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise TypeError(
                "generate_batch takes a non-empty list of prompts; use generate() for a single one."
            )
        config = GenerationSettings.of(settings)
        asked = self._resolve_method(config.method)
        method, rewritten = self._rewritten(asked, prompts, config.raw)
        prepared = [self._prepare(prompt, config, method) for prompt in rewritten]
        if config.temperature:
            answers = self._run(prepared, config, method, cancel=cancel, shown=asked)
        else:
            # Greedy answers to the same tokens are the same: a sweep's prompts often repeat once a
            # method rewrote them (calibrated reordering puts the same document first).
            unique = list({p.key: p for p in prepared}.values())
            unique_answers = self._run(unique, config, method, cancel=cancel, shown=asked)
            by_prompt = {p.key: answer for p, answer in zip(unique, unique_answers, strict=True)}
            answers = [by_prompt[p.key] for p in prepared]
        return [
            with_read_order(answer, given, read)
            for answer, given, read in zip(answers, prompts, rewritten, strict=True)
        ]

    def stream(self, prompt: Prompt, **settings: Any) -> TextStream:
        """Iterate over text pieces as they are generated; `.result` holds the counts at the end."""
        request = self.prepare_stream(prompt, **settings)  # a bad prompt fails here, before streaming
        return TextStream(lambda put, cancel: self._start_streams([request], [StreamOutlet(put, cancel)]))

    def prepare_stream(self, prompt: Prompt, **settings: Any) -> StreamRequest:
        """Check a prompt for streaming (too long, no document spans, ... raise here) and settle
        its settings; `run_streams` then answers it, alone or batched with others."""
        config = GenerationSettings.of(settings)
        method = self._resolve_method(config.method)
        return StreamRequest(prompt, self._prepare(prompt, config, method), config, method)

    def run_streams(self, requests: Sequence[StreamRequest], outlets: Sequence[StreamOutlet]) -> None:
        """Answer requests of equal settings in one left-padded batch, each streamed to its outlet.

        Blocks until the batch ends. Each outlet gets its text pieces, then `End(result)` as soon
        as its own answer ends, or the exception that ended the batch. An outlet whose cancel event
        is set drops out of the batch at the next token; the others go on."""
        if not requests or len(requests) != len(outlets):
            raise ValueError("run_streams takes one outlet per request, and at least one request.")
        first = requests[0]
        if any(r.config != first.config or r.method != first.method for r in requests):
            raise ValueError("run_streams batches requests of equal settings only; run the others apart.")
        ended: set[int] = set()
        try:
            # A method that rewrites the prompt runs the model to do it: here, off the caller's
            # thread (an event loop, for astream).
            prompts = [request.prompt for request in requests]
            method, rewritten = self._rewritten(first.method, prompts, first.config.raw)
            ready = [
                request.prepared if new is request.prompt else self._prepare(new, first.config, method)
                for request, new in zip(requests, rewritten, strict=True)
            ]

            def end(row: int, result: GenerationResult) -> None:
                ended.add(row)
                outlets[row].put(End(with_read_order(result, prompts[row], rewritten[row])))

            self._run(ready, first.config, method, outlets=outlets, on_row_end=end, shown=first.method)
            for row, outlet in enumerate(outlets):
                if row not in ended:  # dropped by its cancel event: a reader still waiting learns why
                    outlet.put(GenerationCancelled("Cancelled by the stream's reader."))
        except BaseException as exc:  # handed to each consumer still reading, who re-raises it
            for row, outlet in enumerate(outlets):
                if row not in ended:
                    outlet.put(exc)

    def _start_streams(self, requests: list[StreamRequest], outlets: list[StreamOutlet]) -> None:
        threading.Thread(
            target=self.run_streams,
            args=(requests, outlets),
            name=f"rag-mspoe-stream-{self.name}",
            daemon=True,
        ).start()

    async def agenerate(
        self, prompt: Prompt, *, cancel: threading.Event | None = None, **settings: Any
    ) -> GenerationResult:
        return await asyncio.to_thread(self.generate, prompt, cancel=cancel, **settings)

    async def agenerate_batch(
        self, prompts: Sequence[Prompt], *, cancel: threading.Event | None = None, **settings: Any
    ) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate_batch, prompts, cancel=cancel, **settings)

    def astream(self, prompt: Prompt, **settings: Any) -> AsyncTextStream:
        """`async for piece in engine.astream(...)`; must be called inside a running event loop."""
        request = self.prepare_stream(prompt, **settings)  # a bad prompt fails here, before streaming
        return AsyncTextStream(
            lambda put, cancel: self._start_streams([request], [StreamOutlet(put, cancel)])
        )

    def _prepare(self, prompt: Prompt, config: GenerationSettings, method: Any) -> _Prepared:
        ids, spans = self._render_for(method, prompt, config.raw, config.prefix, config.tools)
        budget = self.context_window - config.max_new_tokens
        if budget < 1:
            raise PromptTooLongError(
                f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the context window "
                f"of {self.context_window} tokens; lower max_new_tokens."
            )
        if len(ids) <= budget:
            return _Prepared(ids, None, spans)
        if config.truncate == "error":
            raise PromptTooLongError(
                f"The prompt is {len(ids)} tokens; with max_new_tokens={config.max_new_tokens} it needs "
                f"{len(ids) + config.max_new_tokens} positions, but the context window of {self.name} is "
                f"{self.context_window}. Shorten the prompt, lower max_new_tokens, or pass truncate='middle' "
                "to cut the middle of the prompt."
            )
        head, tail_start, _ = middle_cut(len(ids), budget)
        removed = ids[head:tail_start]
        with self._tokenizer_lock:
            removed_text = self.tokenizer.decode(removed, skip_special_tokens=False)
        truncation = Truncation(removed_tokens=len(removed), at_token=head, removed_text=removed_text)
        kept = None if spans is None else spans_after_cut(spans, head, tail_start)
        return _Prepared(ids[:head] + ids[tail_start:], truncation, kept)

    def _run(
        self,
        prepared: list[_Prepared],
        config: GenerationSettings,
        method: Any,
        cancel: threading.Event | None = None,
        shown: Any = None,
        outlets: Sequence[StreamOutlet] = (),
        on_row_end: Callable[[int, GenerationResult], None] | None = None,
        after_prefill: Callable[[int, Any], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for prepared prompts under `method`; results name `shown` (the method the
        caller asked for, when it rewrote the prompts) or `method`. `after_prefill(row, output)`
        gets each row's own prefill (`prefill_apart`); the caller checked `joins_prefills`.

        With outlets (one per row), each row's text is streamed to its outlet's `put`, its cancel
        event drops the row alone, and `on_row_end(row, result)` gets each row's result as soon as
        the row ends (a row dropped by its cancel event gets none)."""
        deadline = None if config.timeout is None else time.monotonic() + config.timeout
        # Built before taking the model: compiling a grammar needs no model, and must not hold up others.
        constraints: list[Any] = (
            [] if config.grammar is None else [self._grammar_processor(config.grammar, len(prepared))]
        )
        # First, so it records the model's own distribution, before any grammar mask.
        recorder = None if config.logprobs is None else LogprobRecorder(config.logprobs, self._token_bytes())
        if recorder is not None:
            constraints.insert(0, recorder)
        if not self._wait_for_model(deadline, cancel, [outlet.cancel for outlet in outlets]):
            raise GenerationTimeout(
                f"Waited {config.timeout} s for the model, busy with other requests; raise timeout or retry."
            )
        trackers = [TextTracker(self.tokenizer, config.stop, self._eos_ids) for _ in prepared]
        results: dict[int, GenerationResult] = {}

        def finish(row: int) -> None:
            tracker = trackers[row]
            tracker.flush()
            if outlets:
                rest = tracker.take_rest()
                if rest or rest.tokens:
                    outlets[row].put(rest)
            results[row] = self._result(
                prepared[row], tracker, shown if shown is not None else method, recorder is not None
            )
            if on_row_end is not None:
                on_row_end(row, results[row])

        try:
            spans = [item.spans for item in prepared]
            joined = after_prefill is not None or (
                len(prepared) > 1 and self.joins_prefills(prepared, method)
            )
            kept = {} if joined else self._kept_start(prepared, method)
            drafted = self._drafts_from_prompt(prepared, config, method, joined)
            watch = GenerationWatch(
                trackers,
                outlets=outlets,
                on_row_end=finish,
                cancel=cancel,
                deadline=deadline,
                recorder=recorder,
                new_from=len(prepared[0].ids) if drafted else None,
            )
            with (
                self._method_applied(method, spans, give_spans=not joined),
                self._seeded(config.seed),
                torch.inference_mode(),
            ):
                cache = self._prefilled_apart(prepared, method, cancel, after_prefill) if joined else kept
                if drafted:
                    decode_with_drafts(
                        self.model,
                        prepared[0].ids,
                        cache=cache.get(CACHE_NAME),
                        max_new_tokens=config.max_new_tokens,
                        draft_tokens=self.prompt_lookup_tokens,
                        eos_ids=self._eos_ids,
                        finished=lambda sequence: bool(watch(sequence, None).all()),
                    )
                else:
                    self.model.generate(
                        **self._batch(prepared),
                        **cache,
                        **self._sampling(config),
                        max_new_tokens=config.max_new_tokens,
                        pad_token_id=self._pad_id,
                        stopping_criteria=[watch],
                        logits_processor=constraints,
                        **self._decoding(),
                    )
        finally:
            self._lock.release()
        if cancel is not None and cancel.is_set() and not all(tracker.done for tracker in trackers):
            raise GenerationCancelled(f"Cancelled after {trackers[0].n_tokens} tokens.")
        if watch.timed_out:
            raise GenerationTimeout(
                f"Generation passed timeout={config.timeout} s after {trackers[0].n_tokens} tokens; "
                "raise timeout or lower max_new_tokens."
            )
        for row in range(len(prepared)):
            if row not in results and not watch.row_cancelled(row):
                finish(row)
        return [results[row] for row in sorted(results)]

    def _drafts_from_prompt(
        self, prepared: Sequence[_Prepared], config: GenerationSettings, method: Any, joined: bool
    ) -> bool:
        """Whether this call decodes with prompt-lookup drafts (`prompt_lookup_tokens`): one greedy
        answer of the unmodified model, free text, no log-probabilities, eager decoding."""
        return (
            self.prompt_lookup_tokens > 0
            and len(prepared) == 1
            and not joined
            and method is None
            and config.temperature == 0
            and config.grammar is None
            and config.logprobs is None
            and self._compile_config is None
            and drafts_apply(self.model)
        )

    def _kept_start(self, prepared: Sequence[_Prepared], method: Any) -> dict[str, Any]:
        """generate's cache argument for one prompt the unmodified model answers: the rows of its
        longest start that the model has kept (`document_prefixes`), so that only the rest is
        prefilled. A calibrated reordering's ranking pass read the prompt through its documents;
        when the order stays, the answer reads only the question again (and is drafted from
        there, `decode_with_drafts`).

        Only a start of half the prompt or more is taken: a kept start's rows come from another
        forward, which rounds otherwise in bf16, so a short one (a template shared by unrelated
        prompts) would make answers depend on what was asked before, for little gain."""
        if len(prepared) != 1 or method is not None or not self.shared_prompt_starts:
            return {}
        if self._compile_config is not None:  # its static cache is allocated by generate
            return {}
        ids = prepared[0].ids
        with self._method_applied(None, give_spans=False):  # a start kept half-made is finished here
            found = self._document_prefixes.start_of(ids, max(MIN_SHARED_PREFIX, len(ids) // 2))
        return {} if found is None else cache_argument(found[0])

    def joins_prefills(self, prepared: Sequence[_Prepared], method: Any) -> bool:
        """Whether these prompts can be prefilled one at a time and decoded together under `method`
        (a one-token prompt has nothing to prefill before its last token)."""
        return (
            self.joined_decoding
            and min(len(item.ids) for item in prepared) > 1
            and joinable(self.model, method)
        )

    def _prefilled_apart(
        self,
        prepared: list[_Prepared],
        method: Any,
        cancel: threading.Event | None,
        after_prefill: Callable[[int, Any], None] | None = None,
    ) -> dict[str, Any]:
        """Each prompt prefilled alone under `method`, with its own document spans; the caches
        joined for `generate` (`joined_decode`)."""

        def not_cancelled() -> None:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("Cancelled before generating.")

        return prefill_apart(
            self.model,
            [item.ids for item in prepared],
            lambda row: self._spans_given(method, [prepared[row].spans]),
            not_cancelled,
            after_prefill,
            share_prefixes=method is None and self.shared_prompt_starts,
        )

    @staticmethod
    def _result(item: _Prepared, tracker: TextTracker, method: Any, logprobs: bool) -> GenerationResult:
        return GenerationResult(
            text=tracker.text,
            prompt_tokens=len(item.ids),
            completion_tokens=tracker.n_tokens,
            finish_reason="stop" if tracker.done else "length",
            method=method_name(method),
            truncation=item.truncation,
            logprobs=tracker.answer_tokens() if logprobs else None,
        )

    def _wait_for_model(
        self,
        deadline: float | None,
        cancel: threading.Event | None,
        row_cancels: Sequence[threading.Event] = (),
    ) -> bool:
        """Take the model's lock; False once the deadline passes. A cancelled caller (`cancel`, or
        every one of `row_cancels`) stops waiting (within 50 ms) and never starts its prefill."""

        def cancelled() -> bool:
            if cancel is not None and cancel.is_set():
                return True
            return bool(row_cancels) and all(event.is_set() for event in row_cancels)

        polled = cancel is not None or bool(row_cancels)
        while True:
            if cancelled():
                raise GenerationCancelled("Cancelled while waiting for the model.")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = min((t for t in (left, 0.05 if polled else None) if t is not None), default=-1)
            if self._lock.acquire(timeout=wait):
                if cancelled():
                    self._lock.release()
                    raise GenerationCancelled("Cancelled while waiting for the model.")
                return True
            if left == 0:
                return False

    def _grammar_processor(self, grammar: Grammar, rows: int) -> GrammarProcessor:
        with self._tokenizer_lock:
            tokenizer = grammar_tokenizer(self.tokenizer, self._vocab_size(), self._eos_ids)
        return GrammarProcessor(grammar, tokenizer, rows)

    def _batch(self, prepared: list[_Prepared]) -> dict[str, torch.Tensor]:
        """Left-padded input ids and attention mask, so every row ends where generation begins."""
        width = max(len(item.ids) for item in prepared)
        input_ids = torch.full((len(prepared), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prepared), width), dtype=torch.long)
        for row, item in enumerate(prepared):
            input_ids[row, width - len(item.ids) :] = torch.tensor(item.ids, dtype=torch.long)
            attention_mask[row, width - len(item.ids) :] = 1
        device = self.model.device
        return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}

    def _decoding(self) -> dict[str, Any]:
        """generate() arguments of the compiled path: a static cache and the compiled decode step."""
        if self._compile_config is None:
            return {"disable_compile": True}
        return {"cache_implementation": "static", "compile_config": self._compile_config}

    @staticmethod
    def _sampling(config: GenerationSettings) -> dict[str, Any]:
        if config.temperature == 0:
            # Clear sampling knobs a model's generation_config may carry, which greedy ignores.
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p}

    @contextlib.contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        """Seed sampling for this call only, leaving the global random state as it was."""
        if seed is None:
            yield
            return
        device = self.model.device
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield


def middle_cut(length: int, max_tokens: int) -> tuple[int, int, int]:
    """(head, tail_start, removed): tokens [head, tail_start) of `length` go to fit `max_tokens`.
    The head and the tail stay, as LongBench does (instructions tend to sit at both ends); the head
    keeps half."""
    if max_tokens < 1:
        raise ValueError(f"The prompt limit must be at least 1 token, got {max_tokens}.")
    if length <= max_tokens:
        return length, length, 0
    head = max_tokens // 2
    return head, length - (max_tokens - head), length - max_tokens


def spans_after_cut(spans: list[Span], head: int, tail_start: int) -> list[Span]:
    """Document spans of a prompt whose tokens [head, tail_start) were cut out: documents inside
    the cut are gone, those after it move up, a document the cut crosses keeps what is left."""

    def moved(index: int) -> int:
        return index if index <= head else max(index, tail_start) - (tail_start - head)

    cut = [(moved(start), moved(end)) for start, end in spans]
    return [(start, end) for start, end in cut if start < end]


def with_read_order(result: GenerationResult, given: Prompt, read: Prompt) -> GenerationResult:
    """The result, saying which given document each one the model read was, when a method rewrote
    the prompt (so the answer's 'Document [i]' can be mapped back)."""
    if read is given:
        return result
    return dataclasses.replace(result, documents_read=documents_read(given, read))
