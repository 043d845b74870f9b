"""What the code around the engine needs of one: the `EngineLike` protocol.

Methods that rewrite prompts, calibration, the sweeps, the evaluation suites and the pipelines
drive a model through these members only. `Engine` has them all; a test double or a wrapper
needs only the ones the code it is handed to calls, and the type checker says which.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rag_mspoe.engine.engine_types import CallMethod, GenerationResult, Prefill
from rag_mspoe.prompts.chat_template import Prompt

if TYPE_CHECKING:
    # Type-only: the method configs' module imports this one's users (methods that rewrite prompts).
    from rag_mspoe.attention.spans import Span
    from rag_mspoe.engine.document_prefix import DocumentPrefixCache
    from rag_mspoe.methods.method_config import MethodConfig


class AnswersPrompts(Protocol):
    """What answering prompts in batches needs of an engine, whether its model runs here (`Engine`)
    or on a server (`RemoteEngine`)."""

    def generate_batch(
        self, prompts: Sequence[Prompt], *, cancel: threading.Event | None = None, **settings: Any
    ) -> list[GenerationResult]: ...


@runtime_checkable
class ScoresWhileGenerating(Protocol):
    """An engine that scores continuations from the prefill its generation makes (`Engine`); one
    whose model runs on a server gets its answers without them."""

    def generate_and_score(
        self,
        items: Sequence[tuple[Prompt, Sequence[str]]],
        *,
        cancel: threading.Event | None = None,
        **settings: Any,
    ) -> list[tuple[GenerationResult, list[tuple[float, int]]]]: ...


class EngineLike(AnswersPrompts, ScoresWhileGenerating, Protocol):
    """An engine: a model and its tokenizer, a default method, generation and scoring."""

    @property
    def model(self) -> Any:
        """The transformers model (a PreTrainedModel, typed loosely as transformers' own classes are)."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""

    @property
    def name(self) -> str:
        """The name results and server model names use."""

    @property
    def method(self) -> MethodConfig | None:
        """The default method, None for the unmodified model."""

    @property
    def context_window(self) -> int:
        """Tokens the model reads at most."""

    @property
    def document_prefixes(self) -> DocumentPrefixCache:
        """The unmodified model's caches through each prompt's documents."""

    def count_tokens(self, prompt: Prompt, *, raw: bool = False) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def token_starts(self, text: str) -> list[int]: ...

    def document_spans_of(
        self, method: Any, prompt: Prompt, *, raw: bool = False
    ) -> tuple[list[int], list[Span]]: ...

    def rewritten(
        self, prompts: Sequence[Prompt], *, method: CallMethod = ..., raw: bool = False
    ) -> tuple[MethodConfig | None, list[Prompt]]: ...

    def generate(
        self, prompt: Prompt, *, cancel: threading.Event | None = None, **settings: Any
    ) -> GenerationResult: ...

    def score_continuations(
        self,
        prompt: Prompt,
        continuations: Sequence[str],
        *,
        prefix: str = "",
        raw: bool = False,
        method: CallMethod = ...,
    ) -> list[tuple[float, int]]: ...

    def score_prompts(
        self, items: Sequence[tuple[Prompt, Sequence[str]]], *, method: CallMethod = ...
    ) -> list[list[tuple[float, int]]]: ...

    def prefill(
        self,
        prompt: Prompt | Sequence[int],
        *,
        method: CallMethod = ...,
        raw: bool = False,
        hidden_states: bool = False,
    ) -> Prefill: ...
