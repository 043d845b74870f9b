"""LangChain adapters over the one engine: a chat model and a text-completion LLM.

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    chat = ChatRagMsPoE(method="mspoe", max_tokens=128)      # the embedded model, loaded once
    chat.invoke("What is the capital of France?").content   # 'The capital of France is Paris.'
    chat.invoke("...", method="none")                        # another rescaling method for one call

Both adapters are thin: every call goes to `rag_mspoe.engine.Engine`, which owns the chat
template, stop strings, streaming, token counts and the lock that keeps concurrent calls apart.
Tool calling is not offered: the adapter does not put tools in the prompt, so it would only
pretend. Structured output (`with_structured_output`) is schema-guided JSON: the schema writes
the structure and the model fills the values (see `rag_mspoe.json_output`), so the answer always
parses, whichever of LangChain's structured-output methods is asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

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
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field

from rag_mspoe.connectors.settings import EngineFields, aretrying, engine_settings, retrying
from rag_mspoe.engine import GenerationResult
from rag_mspoe.json_output import check_schema, generate_json

PROVIDER = "rag_mspoe"
_ROLES = {HumanMessage: "user", SystemMessage: "system", AIMessage: "assistant"}
# LangChain's structured-output methods; all are served by schema-guided JSON here.
STRUCTURED_OUTPUT_METHODS = ("json_schema", "json_mode", "function_calling")


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


class EngineParams(EngineFields):
    """The shared fields, with LangChain's `model` alias and its per-call helpers."""

    model_name: str = Field(default="", alias="model", description="Display name; defaults to the engine's.")

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Engine settings for one call: per-call keyword arguments over the instance fields."""
        requested_model = kwargs.pop("model", None)
        if requested_model not in (None, self.model_name):
            raise ValueError(
                f"This adapter serves {self.model_name!r}; it cannot switch to model {requested_model!r} per "
                "call. Build another adapter for another model (the rescaling method can change per call)."
            )
        return engine_settings(self, kwargs if stop is None else {**kwargs, "stop": stop})

    def _response_metadata(self, result: GenerationResult) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "model_name": self.model_name,
            "method": result.method,
            "finish_reason": result.finish_reason,
        }
        if result.truncation is not None:
            metadata["truncated_tokens"] = result.truncation.removed_tokens
        return metadata

    def _ls_params(
        self, model_type: Literal["chat", "llm"], stop: list[str] | None, kwargs: Any
    ) -> LangSmithParams:
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
        from rag_mspoe import method_name

        method = self.engine.method if self.method is None else self.engine.method_config(self.method)
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

    streaming: bool = Field(default=False, description="Run invoke through the streaming path.")

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
        result = retrying(lambda: self._answer(messages, stop, dict(kwargs)), self.max_retries)
        return self._chat_result(result)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = await aretrying(
            lambda: asyncio.to_thread(self._answer, messages, stop, dict(kwargs)), self.max_retries
        )
        return self._chat_result(result)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if "json_schema" in kwargs:  # a partial object would not validate: send the JSON whole
            yield from self._whole(self._answer(messages, stop, kwargs))
            return
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
        if "json_schema" in kwargs:
            for chunk in self._whole(await asyncio.to_thread(self._answer, messages, stop, kwargs)):
                yield chunk
            return
        stream = self.engine.astream(to_chat_messages(messages), **self._settings(stop, kwargs))
        async for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield self._last_chunk(stream.result)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, Any]:
        """A runnable answering with an object of `schema` (pydantic class, TypedDict or JSON schema).

        Every `method` is served by schema-guided JSON, which is always strict: the answer has
        every key of the schema and parses. Pydantic classes come back as instances, the rest as dicts.
        """
        if kwargs:
            raise TypeError(f"Unknown argument(s) {sorted(kwargs)} for with_structured_output.")
        if method not in STRUCTURED_OUTPUT_METHODS:
            raise ValueError(f"method must be one of {STRUCTURED_OUTPUT_METHODS}, got {method!r}.")
        json_schema = convert_to_json_schema(schema)
        check_schema(json_schema)
        llm = self.bind(
            json_schema=json_schema,
            ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict},
                "schema": json_schema,
            },
        )
        parser: Runnable[Any, Any] = (
            PydanticOutputParser(pydantic_object=schema)
            if isinstance(schema, type) and is_basemodel_subclass(schema)
            else JsonOutputParser()
        )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    def _answer(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> GenerationResult:
        """One blocking answer: plain text, or schema-guided JSON when a schema is bound."""
        schema = kwargs.pop("json_schema", None)
        settings = self._settings(stop, kwargs)
        prompt = to_chat_messages(messages)
        if schema is None:
            return self.engine.generate(prompt, **settings)
        del settings["stop"]  # the schema decides where each value ends
        return generate_json(self.engine, prompt, schema, **settings)

    def _whole(self, result: GenerationResult) -> Iterator[ChatGenerationChunk]:
        yield ChatGenerationChunk(message=AIMessageChunk(content=result.text))
        yield self._last_chunk(result)

    def _chat_result(self, result: GenerationResult) -> ChatResult:
        message = AIMessage(
            content=result.text,
            usage_metadata=usage_metadata(result),
            response_metadata=self._response_metadata(result),
        )
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})
            ]
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

    use_chat_template: bool = Field(
        default=False, description="Wrap each prompt as a user turn of the chat template."
    )

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
        results = retrying(
            lambda: self.engine.generate_batch(prompts, raw=not self.use_chat_template, **settings),
            self.max_retries,
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
        results = await aretrying(
            lambda: self.engine.agenerate_batch(prompts, raw=not self.use_chat_template, **settings),
            self.max_retries,
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
            generations=[
                [Generation(text=r.text, generation_info=self._generation_info(r))] for r in results
            ],
            llm_output={
                "model_name": self.model_name,
                "token_usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        )
