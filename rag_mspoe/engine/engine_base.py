"""What every engine job shares: the model and tokenizer, the default method and how a call's
method is applied, one lock per model, the chat template, and the compiled decode setup."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self, cast

import torch

from rag_mspoe.attention.spans import Span, document_spans
from rag_mspoe.calibrated.measured_losses import warn_measured_loss
from rag_mspoe.engine.document_prefix import DocumentPrefixCache
from rag_mspoe.engine.engine_types import ENGINE_DEFAULT, CallMethod
from rag_mspoe.methods.method_config import MethodConfig, method_name
from rag_mspoe.methods.method_spec import MethodSpec, parse_method
from rag_mspoe.methods.prompt_rewriting import PromptRewriting
from rag_mspoe.methods.validated_documents import warn_outside_validated
from rag_mspoe.models import loading
from rag_mspoe.models.quantization import (
    INT4_DECODING,
    INT8_DECODING,
    INT8_PROMPT_INT4,
    INT8_PROMPT_INT4_DECODING,
    quantization_of,
)
from rag_mspoe.prompts.chat_template import Prompt, render
from rag_mspoe.prompts.document_prompts import MissingDocumentSpans, render_with_spans
from rag_mspoe.rope.rescaling import current_method, rescaled
from rag_mspoe.tools.grammar import grammar_tokenizer

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
from rag_mspoe.prompts.template_encoding import SpecialTextMask

# One lock per model object, shared by every engine that wraps it: rescaling hooks and the
# KV cache are model state, so two generations on one model must never overlap.
_model_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()


def _lock_for(model: Any) -> threading.Lock:
    with _model_locks_guard:
        return _model_locks.setdefault(model, threading.Lock())


# Tokens of the prompt drafted ahead per forward on the CPU (transformers' prompt lookup); measured
# by benchmarks/bench_answer.py.
PROMPT_LOOKUP_TOKENS = 10
# Fewer where decoding runs on codes, by scheme: those kernels' time grows with the tokens a check
# reads (11 cost what 5 single steps cost on the 1.5B's Q4_K layers; int8 on an AVX2 CPU, 1.9x). In
# float32 four: 0.5B int8-decoding on AVX2, 3 answers, 0.270, 0.242, 0.231 s a token for 10, none,
# 4. On the bf16 schemes one, since steps attend in float32 products (`step_attention`) and so cost
# little beside a check: 8 real 1.5B answers took 93.3 s in all with 1-token drafts, 96.7 with none,
# 104.0 with 4 (docs/cpu-inference.md).
CODES_LOOKUP_TOKENS = {INT8_PROMPT_INT4: 1, INT8_PROMPT_INT4_DECODING: 1, INT8_DECODING: 4, INT4_DECODING: 4}


class EngineBase:
    """The model an engine wraps and what generation and scoring both use (`rag_mspoe.engine.Engine`
    documents the arguments)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        method: CallMethod = ENGINE_DEFAULT,
        name: str | None = None,
        compile: bool | Literal["auto"] = "auto",
        compile_backend: str | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or loading.model_display_name(model)
        # Not given: the method the model has now (what `rescale` applied to it, or nothing).
        self._method = current_method(model) if method is ENGINE_DEFAULT else self.method_config(method)
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
        # generate_batch on the CPU prefills each prompt alone and decodes the rows together
        # (`joined_decode`: a padded batch's prefill costs the singles' or more there); compiled
        # or on a GPU, one left-padded batch does both. Set it to choose.
        self.joined_decoding = self._compile_config is None and model.device.type == "cpu"
        # There, a prompt that starts as an earlier one of the batch does (the unmodified model's
        # rows) prefills only the rest; a prefix's rows then come from another forward, which
        # rounds otherwise in bf16. Set it to False to prefill every prompt whole.
        self.shared_prompt_starts = True
        # Greedy answers of the unmodified model (a reordering's answers too) drafted from the
        # prompt (prompt-lookup speculative decoding: n-grams of the prompt proposed and checked
        # in one forward): RAG answers copy the documents. 0: off. Set it to choose.
        self.prompt_lookup_tokens = 0
        # The unmodified model's caches through each prompt's documents, for the methods that keep
        # those rows (scoring only).
        self._document_prefixes = DocumentPrefixCache(model)

    @classmethod
    def load(
        cls,
        source: str | os.PathLike[str] | None = None,
        method: CallMethod = ENGINE_DEFAULT,
        dtype: torch.dtype | str | None = None,
        threads: int | None = None,
        device: str | torch.device | None = "auto",
        compile: bool | Literal["auto"] = "auto",
        quantize: str | None = "auto",
    ) -> Self:
        """Load a model (None: the embedded SmolLM2-135M-Instruct) and wrap it, to answer.

        device ("auto", "cpu", "cuda", "cuda:N"), dtype and quantize as `load_model` takes them;
        compile as `Engine` takes it. On the CPU its greedy answers are drafted from the prompt
        (`prompt_lookup_tokens`), the same answers in less time where they copy the documents, and
        quantize="auto" loads the scheme measured for the model (`EmbeddedModel.answering_quantize`:
        on a bf16 CPU the Qwen models read the prompt in int8, the 1.5B decodes on its file's 4-bit
        codes too; in float32, on a CPU without native bf16, they decode on int8 codes, the 1.5B on
        its file's 4-bit codes where it has them; "none" keeps every layer as loaded).
        """
        model, tokenizer = loading.load_model(
            source, dtype=dtype, device=device, threads=threads, quantize=quantize
        )
        engine = cls(model, tokenizer, method=method, compile=compile)
        if model.device.type == "cpu":
            scheme = quantization_of(model)
            engine.prompt_lookup_tokens = CODES_LOOKUP_TOKENS.get(scheme or "", PROMPT_LOOKUP_TOKENS)
        return engine

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
    def method(self) -> MethodConfig | None:
        """The default method config, or None for the unmodified model."""
        return self._method

    def method_config(self, spec: MethodSpec) -> MethodConfig | None:
        """The config a method spec means for this engine's model ("calibrated": the one shipped for it)."""
        return parse_method(spec, loading.model_display_name(self.model))

    def set_method(self, spec: MethodSpec) -> None:
        """Change the default method; None or "none" means the unmodified model."""
        with self._lock:
            self._method = self.method_config(spec)

    def count_tokens(self, prompt: Prompt, *, raw: bool = False) -> int:
        """Tokens the model reads for a prompt, chat template included unless raw."""
        return len(self._render(prompt, raw, ""))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens (a tokenizer for token budgets); text
        that spells an added token ('<|im_start|>', '<tool_call>') counts as the plain text the
        engine sends."""
        with self._tokenizer_lock:
            return SpecialTextMask(self.tokenizer).encode_plain(text)

    def token_starts(self, text: str) -> list[int]:
        """Where each of `encode(text)`'s tokens starts in the text (to cut it between tokens)."""
        with self._tokenizer_lock:
            _, offsets = SpecialTextMask(self.tokenizer).encode_plain_with_offsets(text)
        return [start for start, _ in offsets]

    # -- internals shared by generation and scoring ------------------------------------------------
    def _collect_eos_ids(self) -> set[int]:
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        ids = set(configured if isinstance(configured, list) else [configured])
        ids.add(self.tokenizer.eos_token_id)
        return {int(i) for i in ids if i is not None}

    def _resolve_method(self, spec: CallMethod) -> MethodConfig | None:
        """A call's method config: the engine's default for ENGINE_DEFAULT, else the spec's (None:
        the unmodified model). A method measured to lose on this model is warned about once."""
        method = self._method if spec is ENGINE_DEFAULT else self.method_config(spec)
        if method is not None:
            warn_measured_loss(self.name, method_name(method))
        return method

    def _render(
        self, prompt: Prompt, raw: bool, prefix: str, tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        with self._tokenizer_lock:
            return render(self.tokenizer, prompt, raw=raw, prefix=prefix, tools=tools)

    def _render_for(
        self,
        method: Any,
        prompt: Prompt,
        raw: bool,
        prefix: str,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[list[int], list[Span] | None]:
        """A prompt's token ids and, when `method` reads documents, their token spans. A method
        validated at some document counts only is warned about on prompts with other counts."""
        checks_count = method is not None and method.validated_documents is not None
        if method is None or not (method.needs_document_spans() or checks_count):
            return self._render(prompt, raw, prefix, tools), None
        with self._tokenizer_lock:
            ids, spans = render_with_spans(self.tokenizer, prompt, raw=raw, prefix=prefix, tools=tools)
        if checks_count and spans is not None:
            warn_outside_validated(method, len(spans), self.name)
        if not method.needs_document_spans():
            return ids, None
        if spans is None:
            if method.applies_at(0):
                raise MissingDocumentSpans.of(method_name(method))
            spans = []  # a method that leaves prompts without documents alone ("auto") reads one here
        return ids, spans

    def _token_bytes(self) -> Callable[[int], bytes]:
        """A token id's bytes: exact from a fast tokenizer (a token may hold part of a character),
        else what decoding the token alone gives."""
        if getattr(self.tokenizer, "is_fast", False):
            with self._tokenizer_lock:
                vocabulary = grammar_tokenizer(self.tokenizer, self._vocab_size(), self._eos_ids)
            return lambda token_id: vocabulary.decode_bytes([token_id])
        return lambda token_id: self.tokenizer.decode([token_id]).encode("utf-8")

    def _vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().out_features)  # the width of the logits

    @property
    def document_prefixes(self) -> DocumentPrefixCache:
        """The unmodified model's caches through each prompt's documents (see `document_prefix`)."""
        return self._document_prefixes

    def document_spans_of(
        self, method: Any, prompt: Prompt, *, raw: bool = False
    ) -> tuple[list[int], list[Span]]:
        """A prompt's token ids and its documents' token spans; MissingDocumentSpans (naming
        `method`) when it does not say where they are."""
        ids, spans = self._render_for(method, prompt, raw, "")
        return ids, spans or []

    def rewritten(
        self, prompts: Sequence[Prompt], *, method: CallMethod = ENGINE_DEFAULT, raw: bool = False
    ) -> tuple[MethodConfig | None, list[Prompt]]:
        """The prompts the model reads under `method` and the method it reads them with: the prompts
        as given and the method itself, except for a method that rewrites prompts (calibrated
        reordering), which runs the model to rewrite them and then leaves it unmodified (None)."""
        return self._rewritten(self._resolve_method(method), prompts, raw)

    def _rewritten(
        self, method: MethodConfig | None, prompts: Sequence[Prompt], raw: bool
    ) -> tuple[MethodConfig | None, list[Prompt]]:
        """The prompts a method that rewrites them gives (it may run the model: the lock is taken),
        and the method the model then runs: the unmodified model for such methods."""
        if not isinstance(method, PromptRewriting):
            return method, list(prompts)
        with self._lock:
            # Called from Engine's own calls: `self` is the whole engine the method may run.
            engine = cast("EngineLike", self)
            return None, [method.rewrite(engine, prompt, raw=raw) for prompt in prompts]

    def _method_applied(
        self,
        method: MethodConfig | None,
        spans: Sequence[Sequence[Span] | None] = (),
        *,
        give_spans: bool = True,
    ) -> contextlib.AbstractContextManager[Any]:
        """`method` on the model for the block and, if it reads documents and `give_spans`, the
        spans of each prompt of the batch (as `_render_for` gave them)."""
        stack = contextlib.ExitStack()
        if method is not None:
            method.prepare(self.model, self.tokenizer, spans)
        if current_method(self.model) != method:
            stack.enter_context(rescaled(self.model, method))
        if give_spans:
            stack.enter_context(self._spans_given(method, spans))
        return stack

    def _spans_given(
        self, method: MethodConfig | None, spans: Sequence[Sequence[Span] | None]
    ) -> contextlib.AbstractContextManager[Any]:
        """The prompts' document spans given to `method` for the block, if it reads them."""
        if method is None or not method.needs_document_spans():
            return contextlib.nullcontext()
        return document_spans(self.model, [row or [] for row in spans])

    def __repr__(self) -> str:
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
