"""What the framework adapters share: per-call settings over instance fields, and retries.

Kept free of LangChain and LlamaIndex imports, so each adapter needs only its own extra.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from rag_mspoe.connectors.document_finder import LocatedPrompt, locate_documents
from rag_mspoe.engine import ENGINE_DEFAULT, Engine, GenerationResult, GenerationTimeout, shared_engine
from rag_mspoe.engine.remote_engine import NEEDS_THE_MODEL, RemoteEngine
from rag_mspoe.engine.token_logprobs import MAX_TOP_LOGPROBS, chat_alternatives

# Settings a single call may override, by the names the adapters use for their fields.
PER_CALL_SETTINGS = (
    "temperature",
    "max_tokens",
    "top_p",
    "seed",
    "stop",
    "method",
    "truncate",
    "timeout",
    "logprobs",
    "top_logprobs",
)

T = TypeVar("T")


def engine_settings(adapter: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments for one call: the overrides given, else the adapter's fields."""
    unknown = sorted(set(overrides) - set(PER_CALL_SETTINGS))
    if unknown:
        raise TypeError(
            f"Unknown call argument(s) {unknown}; per-call settings are: {list(PER_CALL_SETTINGS)}."
        )
    value = {
        name: overrides[name] if name in overrides else getattr(adapter, name) for name in PER_CALL_SETTINGS
    }
    if "method" not in overrides:
        value["method"] = adapter.method_config  # resolved once, when the adapter was made
    value["max_new_tokens"] = value.pop("max_tokens")
    if not isinstance(value["logprobs"], bool):
        raise TypeError(
            f"logprobs is True or False (top_logprobs says how many alternatives), got {value['logprobs']!r}."
        )
    value["logprobs"] = chat_alternatives(value["logprobs"], value.pop("top_logprobs"))
    return value


def read_order(result: GenerationResult) -> dict[str, list[int]]:
    """The response field `documents_read` when a method reordered the prompt's documents (which
    given document each one the model read was, so the answer's 'Document [i]' can be cited back);
    nothing otherwise."""
    return {} if result.documents_read is None else {"documents_read": list(result.documents_read)}


def retrying(call: Callable[[], T], max_retries: int) -> T:
    """Run call, again up to max_retries times while it times out."""
    for _ in range(max_retries):
        try:
            return call()
        except GenerationTimeout:
            continue
    return call()


async def aretrying(call: Callable[[], Awaitable[T]], max_retries: int) -> T:
    for _ in range(max_retries):
        try:
            return await call()
        except GenerationTimeout:
            continue
    return await call()


class EngineFields(BaseModel):
    """Fields shared by both adapters: which engine, which method, and the generation settings."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    engine: Engine | RemoteEngine = Field(
        default=None,  # type: ignore[assignment]  # filled from `source` by the validator
        exclude=True,
        description="The engine to generate with; by default the shared engine of `source`. A "
        "RemoteEngine (RemoteEngine.connect(url, model, ...)) answers through an OpenAI-compatible "
        "server, with the methods that need only text and log-probabilities.",
    )
    source: str | None = Field(
        default=None,
        description="Model to load without an engine: None (the embedded model), a folder or a .gguf file.",
    )
    device: str = Field(
        default="auto",
        description="Where a model loaded from `source` runs: 'auto' (the GPU when there is one), 'cpu', "
        "'cuda' or 'cuda:N'.",
    )
    dtype: str | None = Field(
        default=None,
        description="dtype of a model loaded from `source`: None or 'auto' (the device's best), 'bfloat16', "
        "'float16' or 'float32'.",
    )
    model_name: str = Field(
        default="",
        alias="model",
        description="The model, as other integrations take it: an embedded model's name (`rag-mspoe "
        "models`), a folder or a .gguf file, loaded once per process. With `engine` or `source`, only "
        "the name responses show (by default the engine's).",
    )
    method: Any = Field(
        default=None,
        description="Rescaling method for every call: a short name ('mspoe', 'pi', 'none', 'calibrated', "
        "'auto'), a method config or a saved JSON path. None uses the engine's default: for an engine the "
        "adapter loads, 'auto' (the model's shipped method on prompts of the document counts it was "
        "validated at, the unmodified model elsewhere and where none ships).",
    )
    temperature: float = Field(default=0.0, ge=0, description="0 is greedy decoding.")
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate per call.")
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, description="Seed for sampling, per call.")
    stop: list[str] | None = Field(default=None, description="Stop strings of any length.")
    truncate: Literal["error", "middle"] = Field(
        default="error", description="Too-long prompts: raise, or cut their middle as LongBench does."
    )
    timeout: float | None = Field(default=None, gt=0, description="Seconds per attempt, waiting included.")
    max_retries: int = Field(default=0, ge=0, description="Retries of a non-streaming call that timed out.")
    logprobs: bool = Field(
        default=False,
        description="Give each answer token's log-probability (before temperature, top_p and grammar), in "
        "the OpenAI shape.",
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="With logprobs: the likeliest tokens at each step.",
    )

    _method_config: Any = PrivateAttr(default=ENGINE_DEFAULT)

    @model_validator(mode="after")
    def _attach_engine(self) -> EngineFields:
        if self.engine is None:
            if self.source is None and self.model_name:
                self.source, self.model_name = self.model_name, ""  # model= says what to load
            self.engine = shared_engine(self.source, device=self.device, dtype=self.dtype)
        if not self.model_name:
            self.model_name = self.engine.name
        # Resolved here, once: a bad method name fails now, not on the first call.
        if self.method is not None:
            self._method_config = self.engine.method_config(self.method)
        return self

    def _model_engine(self) -> Engine:
        """The local engine, for what constrains the model's own decoding (tool calls, structured
        output); a remote engine is refused here, before anything is sent."""
        if isinstance(self.engine, RemoteEngine):
            raise ValueError(NEEDS_THE_MODEL)
        return self.engine

    def _located(self, messages: list[dict[str, Any]], settings: dict[str, Any]) -> LocatedPrompt:
        """The call's messages with the documents its retriever returned marked, for a method that
        reads documents (`rag_mspoe.connectors.document_finder`)."""
        spec = settings["method"]
        method = self.engine.method if spec is ENGINE_DEFAULT else self.engine.method_config(spec)
        return locate_documents(messages, method)

    @property
    def method_config(self) -> Any:
        """The method every call uses: a config, None (unmodified) or ENGINE_DEFAULT."""
        return self._method_config
