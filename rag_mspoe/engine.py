"""The one generation engine every adapter uses: chat template, left-padded batches, stop strings,
streaming, token counting, a per-call rescaling method, and one lock per model.

    engine = Engine.load(method="mspoe")
    engine.generate("What is the capital of France?").text        # 'The capital of France is Paris.'
    for piece in engine.stream("Tell me a story", stop=["THE END"]):
        print(piece, end="")

Calls run one at a time per model, so concurrent callers (threads or asyncio tasks) get exactly
the answers they would get one after another. Async calls run the model in a worker thread and
never block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rag_mspoe import prefix_scoring
from rag_mspoe.chat_template import Prompt, render
from rag_mspoe.grammar import Grammar, GrammarProcessor, grammar_tokenizer
from rag_mspoe.methods import MethodSpec
from rag_mspoe.stopping import GenerationWatch, TextTracker

FinishReason = Literal["stop", "length"]


class EngineDefault(enum.Enum):
    """The type of `ENGINE_DEFAULT` (an enum member: one value, kept by pickling and copying)."""

    ENGINE_DEFAULT = "the engine's default method"


# A call's `method` that means "the engine's default method" (`Engine(method=...)`,
# `set_method`). Every other spec, None included, is resolved as `parse_method` resolves it,
# except that a call's method=None also means the engine's default: the adapters' `method`
# field and older callers pass None for that.
ENGINE_DEFAULT = EngineDefault.ENGINE_DEFAULT
CallMethod = MethodSpec | EngineDefault

# One lock per model object, shared by every engine that wraps it: rescaling hooks and the
# KV cache are model state, so two generations on one model must never overlap.
_model_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()

_shared_engines: dict[tuple[str, str, str], Engine] = {}
_shared_engines_guard = threading.Lock()


def _lock_for(model: Any) -> threading.Lock:
    with _model_locks_guard:
        return _model_locks.setdefault(model, threading.Lock())


def shared_engine(
    source: str | os.PathLike[str] | None = None,
    device: str | None = "auto",
    dtype: torch.dtype | str | None = None,
) -> Engine:
    """The process-wide engine for a model source (None: the embedded model) on a device and in a
    dtype (as `load_model` takes them), loaded on first use.

    Adapters built from a source name share it, so a second chat model does not load the
    weights again.
    """
    key = (str(source) if source is not None else "", str(device), str(dtype))
    with _shared_engines_guard:
        if key not in _shared_engines:
            _shared_engines[key] = Engine.load(source, device=device, dtype=dtype)
        return _shared_engines[key]


class PromptTooLongError(ValueError):
    """The prompt and the requested output do not fit in the model's context window."""


class GenerationTimeout(TimeoutError):
    """A call did not finish within its timeout (waiting for the model included)."""


class GenerationCancelled(Exception):
    """The caller set the call's `cancel` event: it stopped waiting for the model, or between tokens."""


@dataclass(frozen=True)
class Truncation:
    """What middle truncation removed from one prompt."""

    removed_tokens: int
    at_token: int  # index in the prompt where the removed span started
    removed_text: str


@dataclass(frozen=True)
class GenerationResult:
    """One answer. completion_tokens counts every generated token, the one that ended the answer
    (end of turn, or the last token of a stop string) included."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    method: str
    truncation: Truncation | None = None


@dataclass(frozen=True)
class GenerationSettings:
    """Per-call settings, checked once. temperature == 0 means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    method: CallMethod = ENGINE_DEFAULT  # None means the engine's default too (see ENGINE_DEFAULT)
    raw: bool = False  # plain text continuation, without the chat template
    prefix: str = ""  # text the answer is made to start with; the result holds only what follows
    truncate: Literal["error", "middle"] = "error"
    timeout: float | None = None  # seconds for the whole call, waiting for the model included
    grammar: Grammar | None = None  # what the answer must match (rag_mspoe.grammar); None: free text
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI-style tools shown to the model by the chat template

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}.")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.truncate not in ("error", "middle"):
            raise ValueError(f"truncate must be 'error' or 'middle', got {self.truncate!r}.")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {self.timeout}.")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TypeError(
                f"grammar must be a rag_mspoe.grammar.Grammar, got {type(self.grammar).__name__}."
            )
        if self.grammar is not None and self.prefix:
            raise ValueError(
                "prefix cannot be combined with grammar: the grammar decides how the answer starts."
            )
        if isinstance(self.tools, Mapping) or not all(isinstance(t, Mapping) for t in self.tools or ()):
            raise TypeError(f"tools must be a list of tool dicts, got {self.tools!r}.")
        object.__setattr__(self, "tools", tuple(self.tools or ()))

    @classmethod
    def of(cls, settings: dict[str, Any]) -> GenerationSettings:
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            valid = ", ".join(f.name for f in dataclasses.fields(cls))
            raise TypeError(f"Unknown generation setting(s) {unknown}; valid settings are: {valid}.")
        return cls(**settings)


@dataclass(frozen=True)
class Prefill:
    """What one prompt's forward left behind, for calibration."""

    tokens: int
    hidden_states: tuple[torch.Tensor, ...] | None  # embeddings then each layer's output, [T, hidden]
    head_scores: dict[int, torch.Tensor]  # per layer, position-awareness per head (Ms-PoE per prompt)


def _is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(t, int) for t in prompt)
    )


@dataclass(frozen=True)
class _Prepared:
    ids: list[int]
    truncation: Truncation | None


class _End:
    """Marks the end of a stream in its queue, carrying the result."""

    def __init__(self, result: GenerationResult) -> None:
        self.result = result


class TextStream:
    """Text pieces of one generation as they are produced; `.result` is set once it ends.

    Generation runs in a worker thread. Leaving the loop early (or `close()`) stops it at the
    next token.
    """

    def __init__(self, start: Callable[[Callable[[object], None], threading.Event], None]) -> None:
        self.result: GenerationResult | None = None
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._cancel = threading.Event()
        start(self._queue.put, self._cancel)

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                item = self._queue.get()
                if isinstance(item, _End):
                    self.result = item.result
                    return
                if isinstance(item, BaseException):
                    raise item
                yield str(item)
        finally:
            self._cancel.set()

    def close(self) -> None:
        self._cancel.set()

    def __del__(self) -> None:  # a stream dropped unread must not keep the model busy
        self._cancel.set()


class AsyncTextStream:
    """The async form of `TextStream`: `async for piece in stream`, then `.result`."""

    def __init__(self, start: Callable[[Callable[[object], None], threading.Event], None]) -> None:
        self.result: GenerationResult | None = None
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._cancel = threading.Event()
        loop, items, cancel = asyncio.get_running_loop(), self._queue, self._cancel

        def put(item: object) -> None:  # called from the worker thread; holds no reference to self
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                cancel.set()

        start(put, self._cancel)

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, _End):
                    self.result = item.result
                    return
                if isinstance(item, BaseException):
                    raise item
                yield str(item)
        finally:
            self._cancel.set()

    def close(self) -> None:
        self._cancel.set()

    def __del__(self) -> None:  # a stream dropped unread must not keep the model busy
        self._cancel.set()


class Engine:
    """Generation over one loaded causal LM and its tokenizer.

    method: the default rescaling method, any spec `parse_method` takes ("mspoe", "pi:2",
    "layerwise+pi", a config, a saved config's path). None keeps the model as it was handed over
    (whatever `rescale` applied to it, or nothing); "none" forces the unmodified model. Each call
    can pass its own `method`; it applies for that call only, and ENGINE_DEFAULT (the default)
    or None there means this default.

    compile: decode on a static KV cache with a compiled forward (the prompt's prefill stays
    eager, where Ms-PoE ranks heads). "auto" turns it on for models on a CUDA GPU and off on
    the CPU, where compiling costs more than it saves. The first call per batch size, and the
    first call under each other method, compiles (seconds to a minute); later ones reuse it.
    Past torch's recompile limit (8 by default) decoding falls back to eager.
    compile_backend: torch.compile's backend (default inductor, with CUDA graphs on a GPU).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        method: MethodSpec = None,
        name: str | None = None,
        compile: bool | Literal["auto"] = "auto",
        compile_backend: str | None = None,
    ) -> None:
        from rag_mspoe import current_method, model_display_name

        self.model = model
        self.tokenizer = tokenizer
        self.name = name or model_display_name(model)
        self._method = current_method(model) if method is None else self.method_config(method)
        self._lock = _lock_for(model)
        # Fast tokenizers refuse concurrent use while their padding/truncation state changes.
        self._tokenizer_lock = threading.Lock()
        self._eos_ids = frozenset(self._collect_eos_ids())
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(
                "The tokenizer has neither a pad nor an eos token; set tokenizer.pad_token first."
            )
        self._pad_id = int(pad)
        self._compile_config = _compile_config(model, compile, compile_backend)

    @classmethod
    def load(
        cls,
        source: str | os.PathLike[str] | None = None,
        method: MethodSpec = None,
        dtype: torch.dtype | str | None = None,
        threads: int | None = None,
        device: str | torch.device | None = "auto",
        compile: bool | Literal["auto"] = "auto",
    ) -> Engine:
        """Load a model (None: the embedded SmolLM2-135M-Instruct) and wrap it.

        device ("auto", "cpu", "cuda", "cuda:N") and dtype as `load_model` takes them; compile
        as `Engine` takes it.
        """
        from rag_mspoe import load_model

        model, tokenizer = load_model(source, dtype=dtype, device=device, threads=threads)
        return cls(model, tokenizer, method=method, compile=compile)

    # -- facts -------------------------------------------------------------------------------------
    @property
    def context_window(self) -> int:
        """Positions the model was trained for (config.max_position_embeddings)."""
        return int(self.model.config.max_position_embeddings)

    @property
    def compiled(self) -> bool:
        """Whether generation decodes on a static cache with a compiled forward."""
        return self._compile_config is not None

    @property
    def method(self) -> Any:
        """The default method config, or None for the unmodified model."""
        return self._method

    def method_config(self, spec: MethodSpec) -> Any:
        """The config a method spec means for this engine's model ("calibrated": the one shipped for it)."""
        from rag_mspoe import model_display_name, parse_method

        return parse_method(spec, model_display_name(self.model))

    def set_method(self, spec: MethodSpec) -> None:
        """Change the default method; None or "none" means the unmodified model."""
        with self._lock:
            self._method = self.method_config(spec)

    def count_tokens(self, prompt: Prompt, *, raw: bool = False) -> int:
        """Tokens the model reads for a prompt, chat template included unless raw."""
        return len(self._render(prompt, raw, ""))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens (a tokenizer for token budgets)."""
        with self._tokenizer_lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- generation --------------------------------------------------------------------------------
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
        """Generate answers for several prompts in one left-padded batch (`cancel`: see `generate`)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise TypeError(
                "generate_batch takes a non-empty list of prompts; use generate() for a single one."
            )
        config = GenerationSettings.of(settings)
        method = self._resolve_method(config.method)
        prepared = [self._prepare(prompt, config) for prompt in prompts]
        return self._run(prepared, config, method, cancel=cancel)

    def stream(self, prompt: Prompt, **settings: Any) -> TextStream:
        """Iterate over text pieces as they are generated; `.result` holds the counts at the end."""
        config = GenerationSettings.of(settings)
        method = self._resolve_method(config.method)
        prepared = self._prepare(prompt, config)
        return TextStream(lambda put, cancel: self._start_worker(prepared, config, method, put, cancel))

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
        from rag_mspoe import frozen_head_order

        request = self._continuations(prompt, continuations, raw, prefix)
        resolved = self._resolve_method(method)
        with self._lock, self._method_applied(resolved), torch.inference_mode():
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
        resolved = self._resolve_method(method)
        if not prefix_scoring.shares_prefixes(resolved, self.model.config):
            return [self.score_continuations(p, texts, method=method) for p, texts in items]
        requests = [self._continuations(p, texts, False, "") for p, texts in items]
        with self._lock, self._method_applied(resolved), torch.inference_mode():
            return prefix_scoring.score(self.model, requests, self._pad_id)

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
        from rag_mspoe import head_scores

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
        config = GenerationSettings.of(settings)
        method = self._resolve_method(config.method)
        prepared = self._prepare(prompt, config)
        return AsyncTextStream(lambda put, cancel: self._start_worker(prepared, config, method, put, cancel))

    # -- internals ---------------------------------------------------------------------------------
    def _collect_eos_ids(self) -> set[int]:
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        ids = set(configured if isinstance(configured, list) else [configured])
        ids.add(self.tokenizer.eos_token_id)
        return {int(i) for i in ids if i is not None}

    def _resolve_method(self, spec: CallMethod) -> Any:
        """A call's method config: the engine's default for ENGINE_DEFAULT (or None), else the spec's."""
        if spec is ENGINE_DEFAULT or spec is None:
            return self._method
        return self.method_config(spec)

    def _render(
        self, prompt: Prompt, raw: bool, prefix: str, tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        with self._tokenizer_lock:
            return render(self.tokenizer, prompt, raw=raw, prefix=prefix, tools=tools)

    def _continuations(
        self, prompt: Prompt, continuations: Sequence[str], raw: bool, prefix: str
    ) -> prefix_scoring.Continuations:
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
        return prefix_scoring.Continuations(context, candidates)

    def _prepare(self, prompt: Prompt, config: GenerationSettings) -> _Prepared:
        ids = self._render(prompt, config.raw, config.prefix, config.tools)
        budget = self.context_window - config.max_new_tokens
        if budget < 1:
            raise PromptTooLongError(
                f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the context window "
                f"of {self.context_window} tokens; lower max_new_tokens."
            )
        if len(ids) <= budget:
            return _Prepared(ids, None)
        if config.truncate == "error":
            raise PromptTooLongError(
                f"The prompt is {len(ids)} tokens; with max_new_tokens={config.max_new_tokens} it needs "
                f"{len(ids) + config.max_new_tokens} positions, but the context window of {self.name} is "
                f"{self.context_window}. Shorten the prompt, lower max_new_tokens, or pass truncate='middle' "
                "to cut the middle of the prompt."
            )
        # Keep the head and the tail, as LongBench does: instructions tend to sit at both ends.
        head = budget // 2
        tail_start = len(ids) - (budget - head)
        removed = ids[head:tail_start]
        with self._tokenizer_lock:
            removed_text = self.tokenizer.decode(removed, skip_special_tokens=False)
        truncation = Truncation(removed_tokens=len(removed), at_token=head, removed_text=removed_text)
        return _Prepared(ids[:head] + ids[tail_start:], truncation)

    def _start_worker(
        self,
        prepared: _Prepared,
        config: GenerationSettings,
        method: Any,
        put: Callable[[object], None],
        cancel: threading.Event,
    ) -> None:
        def work() -> None:
            try:
                (result,) = self._run([prepared], config, method, on_text=put, cancel=cancel)
                put(_End(result))
            except BaseException as exc:  # handed to the consumer, who re-raises it
                put(exc)

        threading.Thread(target=work, name=f"rag-mspoe-stream-{self.name}", daemon=True).start()

    def _run(
        self,
        prepared: list[_Prepared],
        config: GenerationSettings,
        method: Any,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[GenerationResult]:
        from rag_mspoe import method_name

        deadline = None if config.timeout is None else time.monotonic() + config.timeout
        # Built before taking the model: compiling a grammar needs no model, and must not hold up others.
        constraints = (
            [] if config.grammar is None else [self._grammar_processor(config.grammar, len(prepared))]
        )
        if not self._wait_for_model(deadline, cancel):
            raise GenerationTimeout(
                f"Waited {config.timeout} s for the model, busy with other requests; raise timeout or retry."
            )
        try:
            trackers = [TextTracker(self.tokenizer, config.stop, self._eos_ids) for _ in prepared]
            watch = GenerationWatch(trackers, on_text=on_text, cancel=cancel, deadline=deadline)
            with self._method_applied(method), self._seeded(config.seed), torch.inference_mode():
                self.model.generate(
                    **self._batch(prepared),
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
        results = []
        for item, tracker in zip(prepared, trackers, strict=True):
            tracker.flush()
            if on_text is not None:
                rest = tracker.take_rest()
                if rest:
                    on_text(rest)
            results.append(
                GenerationResult(
                    text=tracker.text,
                    prompt_tokens=len(item.ids),
                    completion_tokens=tracker.n_tokens,
                    finish_reason="stop" if tracker.done else "length",
                    method=method_name(method),
                    truncation=item.truncation,
                )
            )
        return results

    def _wait_for_model(self, deadline: float | None, cancel: threading.Event | None) -> bool:
        """Take the model's lock; False once the deadline passes. A cancelled caller stops waiting
        (within 50 ms) and never starts its prefill."""
        while True:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("Cancelled while waiting for the model.")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = min((t for t in (left, 0.05 if cancel is not None else None) if t is not None), default=-1)
            if self._lock.acquire(timeout=wait):
                if cancel is not None and cancel.is_set():
                    self._lock.release()
                    raise GenerationCancelled("Cancelled while waiting for the model.")
                return True
            if left == 0:
                return False

    def _grammar_processor(self, grammar: Grammar, rows: int) -> GrammarProcessor:
        vocab_size = int(self.model.get_output_embeddings().weight.shape[0])  # the width of the logits
        with self._tokenizer_lock:
            tokenizer = grammar_tokenizer(self.tokenizer, vocab_size, self._eos_ids)
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

    def _method_applied(self, method: Any) -> contextlib.AbstractContextManager[Any]:
        from rag_mspoe import current_method, rescaled

        if current_method(self.model) == method:
            return contextlib.nullcontext()
        return rescaled(self.model, method)

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

    def __repr__(self) -> str:
        from rag_mspoe import method_name

        method = method_name(self._method)
        return f"Engine(name={self.name!r}, method={method!r}, context_window={self.context_window})"


def _compile_config(model: Any, compile: bool | str, backend: str | None) -> Any:
    """transformers' CompileConfig for the compiled decode path, or None for eager decoding."""
    from transformers import CompileConfig

    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}.")
    on_gpu = model.device.type == "cuda"
    if not (on_gpu if compile == "auto" else compile):
        return None
    # CUDA graphs ("reduce-overhead") remove the per-kernel launch cost that dominates decoding.
    mode = "reduce-overhead" if on_gpu and backend in (None, "inductor") else "default"
    config = CompileConfig(fullgraph=True, backend=backend or "inductor", mode=mode)
    config._compile_all_devices = True  # type: ignore[assignment]  # else transformers compiles on GPUs only
    return config
