"""LangChain adapters over the one engine: a chat model and a text-completion LLM.

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    chat = ChatRagMsPoE(method="mspoe", max_tokens=128)      # the embedded model, loaded once
    chat.invoke("What is the capital of France?").content   # 'The capital of France is Paris.'
    chat.invoke("...", method="none")                        # another rescaling method for one call

Both adapters are thin: every call goes to `rag_mspoe.engine.Engine`, which owns the chat
template, stop strings, streaming, token counts and the lock that keeps concurrent calls apart.
Tool calling is not offered: the adapter does not put tools in the prompt, so it would only
pretend. Structured output is served by schema-guided JSON generation (see `structured_output`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, BaseLLM, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    UsageMetadata,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation, GenerationChunk
from langchain_core.outputs import LLMResult
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rag_mspoe.engine import Engine, GenerationResult, GenerationTimeout, shared_engine

PROVIDER = "rag_mspoe"
# Settings a single call may override, by their LangChain names.
PER_CALL_SETTINGS = ("temperature", "max_tokens", "top_p", "seed", "method", "truncate", "timeout")
_ROLES = {HumanMessage: "user", SystemMessage: "system", AIMessage: "assistant"}

T = TypeVar("T")


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as {"role", "content"} dicts for the chat template."""
    converted = []
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        else:
            role = next((r for cls, r in _ROLES.items() if isinstance(message, cls)), "")
        if not role or getattr(message, "tool_calls", None):
            raise ValueError(
                f"{type(message).__name__} is not supported: this model has no tool calling. "
                "Send system, human and AI messages with text content."
            )
        if not isinstance(message.content, str):
            kinds = {block.get("type") for block in message.content if isinstance(block, dict)}
            if kinds - {"text"}:
                raise ValueError(
                    f"Message content of type {sorted(k for k in kinds - {'text'} if k)} is not supported: "
                    "this model reads text only."
                )
        converted.append({"role": role, "content": message.text})
    return converted


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )


class EngineParams(BaseModel):
    """Fields shared by both adapters: which engine, which method, and the generation settings."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    engine: Engine = Field(
        default=None,  # type: ignore[assignment]  # filled from `source` by the validator
        exclude=True,
        description="The engine to generate with; by default the shared engine of `source`.",
    )
    source: str | None = Field(
        default=None,
        description="Model to load when no engine is given: None for the embedded model, a folder, a .gguf file.",
    )
    model_name: str = Field(default="", alias="model", description="Display name; defaults to the engine's.")
    method: Any = Field(
        default=None,
        description="Rescaling method for every call: a short name ('mspoe', 'pi', 'none'), a method config "
        "or a saved JSON path. None uses the engine's default.",
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
    streaming: bool = Field(default=False, description="Run invoke through the streaming path.")

    @model_validator(mode="after")
    def _attach_engine(self) -> EngineParams:
        from rag_mspoe import parse_method

        if self.engine is None:
            self.engine = shared_engine(self.source)
        if not self.model_name:
            self.model_name = self.engine.name
        parse_method(self.method)  # a bad method name fails here, not on the first call
        return self

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Engine settings for one call: per-call keyword arguments over the instance fields."""
        requested_model = kwargs.pop("model", None)
        if requested_model not in (None, self.model_name):
            raise ValueError(
                f"This adapter serves {self.model_name!r}; it cannot switch to model {requested_model!r} per "
                "call. Build another adapter for another model (the rescaling method can change per call)."
            )
        unknown = sorted(set(kwargs) - set(PER_CALL_SETTINGS))
        if unknown:
            raise TypeError(f"Unknown call argument(s) {unknown}; per-call settings are: {list(PER_CALL_SETTINGS)}.")
        value = {name: kwargs.get(name, getattr(self, name)) for name in PER_CALL_SETTINGS}
        return {
            "max_new_tokens": value["max_tokens"],
            "temperature": value["temperature"],
            "top_p": value["top_p"],
            "seed": value["seed"],
            "stop": stop if stop is not None else self.stop,
            "method": value["method"],
            "truncate": value["truncate"],
            "timeout": value["timeout"],
        }

    def _retrying(self, call: Callable[[], T]) -> T:
        for attempt in range(self.max_retries + 1):
            try:
                return call()
            except GenerationTimeout:
                if attempt == self.max_retries:
                    raise
        raise AssertionError("unreachable")

    async def _aretrying(self, call: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(self.max_retries + 1):
            try:
                return await call()
            except GenerationTimeout:
                if attempt == self.max_retries:
                    raise
        raise AssertionError("unreachable")

    def _response_metadata(self, result: GenerationResult) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "model_name": self.model_name,
            "method": result.method,
            "finish_reason": result.finish_reason,
        }
        if result.truncation is not None:
            metadata["truncated_tokens"] = result.truncation.removed_tokens
        return metadata

    def _ls_params(self, model_type: Literal["chat", "llm"], stop: list[str] | None, kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type=model_type,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    @property
    def _identifying_params(self) -> dict[str, Any]:
        from rag_mspoe import method_name, parse_method

        method = self.engine.method if self.method is None else parse_method(self.method)
        return {
            "model_name": self.model_name,
            "method": method_name(method),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
        }


class ChatRagMsPoE(EngineParams, BaseChatModel):
    """A LangChain chat model over a local model with rescaled RoPE (Ms-PoE, per layer, ...)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "rag-mspoe-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("chat", stop, kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        settings = self._settings(stop, kwargs)
        prompt = to_chat_messages(messages)
        result = self._retrying(lambda: self.engine.generate(prompt, **settings))
        return self._chat_result(result)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        settings = self._settings(stop, kwargs)
        prompt = to_chat_messages(messages)
        result = await self._aretrying(lambda: self.engine.agenerate(prompt, **settings))
        return self._chat_result(result)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream = self.engine.stream(to_chat_messages(messages), **self._settings(stop, kwargs))
        for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield self._last_chunk(stream.result)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        stream = self.engine.astream(to_chat_messages(messages), **self._settings(stop, kwargs))
        async for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield self._last_chunk(stream.result)

    def _chat_result(self, result: GenerationResult) -> ChatResult:
        message = AIMessage(
            content=result.text,
            usage_metadata=usage_metadata(result),
            response_metadata=self._response_metadata(result),
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})]
        )

    def _last_chunk(self, result: GenerationResult) -> ChatGenerationChunk:
        """An empty chunk closing the stream, carrying the token counts and metadata once."""
        message = AIMessageChunk(
            content="",
            usage_metadata=usage_metadata(result),
            response_metadata=self._response_metadata(result),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


class RagMsPoELLM(EngineParams, BaseLLM):
    """A LangChain text LLM (string in, string out) over the same engine.

    By default a prompt is continued as plain text; `use_chat_template=True` sends each prompt as
    one user turn of the chat template instead, which instruction-tuned models answer better.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    use_chat_template: bool = Field(default=False, description="Wrap each prompt as a user turn of the chat template.")

    @property
    def _llm_type(self) -> str:
        return "rag-mspoe"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("llm", stop, kwargs)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        settings = self._settings(stop, kwargs)
        results = self._retrying(
            lambda: self.engine.generate_batch(prompts, raw=not self.use_chat_template, **settings)
        )
        return self._llm_result(results)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        settings = self._settings(stop, kwargs)
        results = await self._aretrying(
            lambda: self.engine.agenerate_batch(prompts, raw=not self.use_chat_template, **settings)
        )
        return self._llm_result(results)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        stream = self.engine.stream(prompt, raw=not self.use_chat_template, **self._settings(stop, kwargs))
        for piece in stream:
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield GenerationChunk(text="", generation_info=self._generation_info(stream.result))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        stream = self.engine.astream(prompt, raw=not self.use_chat_template, **self._settings(stop, kwargs))
        async for piece in stream:
            chunk = GenerationChunk(text=piece)
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield GenerationChunk(text="", generation_info=self._generation_info(stream.result))

    def _generation_info(self, result: GenerationResult) -> dict[str, Any]:
        return {**self._response_metadata(result), "usage": dict(usage_metadata(result))}

    def _llm_result(self, results: list[GenerationResult]) -> LLMResult:
        prompt_tokens = sum(r.prompt_tokens for r in results)
        completion_tokens = sum(r.completion_tokens for r in results)
        return LLMResult(
            generations=[[Generation(text=r.text, generation_info=self._generation_info(r))] for r in results],
            llm_output={
                "model_name": self.model_name,
                "token_usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        )
