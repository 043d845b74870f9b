"""LangChain adapters over the one engine: a chat model and a text-completion LLM.

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    chat = ChatRagMsPoE(method="mspoe", max_tokens=128)      # the embedded model, loaded once
    chat.invoke("What is the capital of France?").content   # 'The capital of France is Paris.'
    chat.invoke("...", method="none")                        # another rescaling method for one call

Both adapters are thin: every call goes to `rag_mspoe.engine.Engine`, which owns the chat
template, stop strings, streaming, token counts and the lock that keeps concurrent calls apart.

Tools (`bind_tools`) reach the model through its chat template, and its calls are decoded under
a grammar that admits only calls with arguments valid for their tool (`rag_mspoe.tools.tool_calls`);
they come back as `AIMessage.tool_calls`, and `ToolMessage`s carry the results back in.
Streaming with bound tools sends text as it is written and each call as one `tool_call_chunks`
entry once it is written whole; the chunks add up to `invoke`'s calls, cut off by max_tokens or not.
Structured output (`with_structured_output`) is grammar-constrained too: "json_schema" and
"json_mode" decode JSON valid for the schema (`rag_mspoe.tools.json_output`), "function_calling" forces
a call of the schema as a tool, so the answer always parses.

    chat.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?").tool_calls
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextvars import ContextVar
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    BaseCallbackHandler,
    CallbackManagerForLLMRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, BaseLLM, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolCall,
    ToolCallChunk,
    ToolMessage,
    UsageMetadata,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.tracers.context import register_configure_hook
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, model_validator

from rag_mspoe.connectors.document_finder import RETRIEVED, LocatedPrompt, with_documents_read
from rag_mspoe.connectors.langchain_vector_stores import listen_to_vector_stores
from rag_mspoe.connectors.settings import EngineFields, aretrying, engine_settings, read_order, retrying
from rag_mspoe.engine import ENGINE_DEFAULT, GenerationResult
from rag_mspoe.engine.text_stream import TextPiece
from rag_mspoe.engine.token_logprobs import TokenLogprob, openai_chat_logprobs, openai_text_logprobs
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS
from rag_mspoe.tools.json_output import check_schema, generate_json
from rag_mspoe.tools.tool_calls import ToolAnswer, astream_with_tools, generate_with_tools, stream_with_tools
from rag_mspoe.tools.tool_stream import ToolCallDelta

PROVIDER = "rag_mspoe"
_ROLES = {HumanMessage: "user", SystemMessage: "system", AIMessage: "assistant", ToolMessage: "tool"}
# LangChain's structured-output methods, all grammar-constrained here.
STRUCTURED_OUTPUT_METHODS = ("json_schema", "json_mode", "function_calling")
# Call arguments that turn a chat call into a tool-calling one (set by bind_tools).
_TOOL_ARGUMENTS = ("tools", "tool_choice", "parallel_tool_calls")


class RetrievedDocumentsListener(BaseCallbackHandler):
    """Keeps the texts of the documents every retriever of every chain returns, so that a method
    reading documents finds them in the prompt the chain stuffs them into."""

    run_inline = True  # before the model of the same chain runs, async chains included

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        RETRIEVED.add(document.page_content for document in documents)


# One listener for every thread and task: LangChain adds a hook's handler where its variable is set,
# and a default is seen everywhere, where a value set would be seen in one context only.
_LISTENER: ContextVar[BaseCallbackHandler | None] = ContextVar(
    "rag_mspoe_retrieved_documents",
    default=RetrievedDocumentsListener(),  # noqa: B039
)
_listening = False


def listen_to_retrievers() -> None:
    """Add the listener to every LangChain run of the process (once): a chain needs no change."""
    global _listening
    if not _listening:
        register_configure_hook(_LISTENER, inheritable=True)
        _listening = True


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as chat-template dicts; AI tool calls and tool results included."""
    converted = []
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        else:
            role = next((r for cls, r in _ROLES.items() if isinstance(message, cls)), "")
        if not role:
            raise ValueError(
                f"{type(message).__name__} is not supported. "
                "Send system, human, AI and tool messages with text content."
            )
        if not isinstance(message.content, str):
            kinds = {block.get("type") for block in message.content if isinstance(block, dict)}
            # Call blocks in an AI message's content repeat its tool_calls, which are rendered.
            readable = {"text", "tool_use", "tool_call"} if isinstance(message, AIMessage) else {"text"}
            if kinds - readable:
                raise ValueError(
                    f"Message content of type {sorted(k for k in kinds - readable if k)} is not supported: "
                    "this model reads text only."
                )
        entry: dict[str, Any] = {"role": role, "content": message.text}
        if isinstance(message, AIMessage) and message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["args"]},
                }
                for call in message.tool_calls
            ]
        if isinstance(message, ToolMessage):
            entry["tool_call_id"] = message.tool_call_id
        if message.additional_kwargs.get(DOCUMENT_SPANS) is not None:
            # Where the documents are in the content, for methods that read them.
            entry[DOCUMENT_SPANS] = message.additional_kwargs[DOCUMENT_SPANS]
        converted.append(entry)
    return converted


def openai_tool_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> Any:
    """LangChain's tool_choice spellings ("any", True, a name, a dict) in the OpenAI form."""
    if tool_choice is None:
        return "auto"
    if tool_choice == "any" or (tool_choice is True and len(tools) > 1):
        return "required"
    if tool_choice is True:
        return tools[0]["function"]["name"]
    if tool_choice is False:
        return "none"
    return tool_choice


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )


class EngineParams(EngineFields):
    """The shared fields, with LangChain's `model` alias and its per-call helpers."""

    @model_validator(mode="after")
    def _listen_to_retrievers(self) -> EngineParams:
        listen_to_retrievers()
        listen_to_vector_stores()
        return self

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Engine settings for one call: per-call keyword arguments over the instance fields."""
        requested_model = kwargs.pop("model", None)
        if requested_model not in (None, self.model_name):
            raise ValueError(
                f"This adapter serves {self.model_name!r}; it cannot switch to model {requested_model!r} per "
                "call. Build another adapter for another model (the rescaling method can change per call)."
            )
        return engine_settings(self, kwargs if stop is None else {**kwargs, "stop": stop})

    def _response_metadata(
        self, answer: GenerationResult | ToolAnswer, streamed: bool = False
    ) -> dict[str, Any]:
        """What answered and how it ended; the tokens' log-probabilities unless each streamed
        chunk carried its own."""
        result = answer.result if isinstance(answer, ToolAnswer) else answer
        metadata: dict[str, Any] = {
            "model_name": self.model_name,
            "method": result.method,
            "finish_reason": answer.finish_reason,
        }
        if result.truncation is not None:
            metadata["truncated_tokens"] = result.truncation.removed_tokens
        metadata.update(read_order(result))
        if result.logprobs is not None and not streamed:
            metadata["logprobs"] = self._logprobs(result.logprobs)
        return metadata

    def _logprobs(self, tokens: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
        """Token log-probabilities in the shape langchain-openai's chat model gives."""
        return openai_chat_logprobs(tokens)

    @staticmethod
    def _asks_logprobs(settings: dict[str, Any]) -> bool:
        return settings["logprobs"] is not None

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

        method = self.engine.method if self.method_config is ENGINE_DEFAULT else self.method_config
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
        if "json_schema" in kwargs:  # a partial object would not validate: send it whole
            yield from self._whole(self._answer(messages, stop, kwargs))
            return
        if kwargs.get("tools"):
            tool_stream = self._tool_stream(stream_with_tools, messages, stop, kwargs)
            for event in tool_stream:
                chunk = self._event_chunk(event)
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            assert tool_stream.answer is not None
            yield self._last_chunk(tool_stream.answer)
            return
        settings = self._settings(stop, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        stream = self.engine.stream(located.messages, **settings)
        for piece in stream:
            chunk = self._piece_chunk(piece, self._asks_logprobs(settings))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        result = with_documents_read(stream.result, located)
        yield self._last_chunk(ToolAnswer(result.text, (), result), streamed=True)

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
        if kwargs.get("tools"):
            tool_stream = self._tool_stream(astream_with_tools, messages, stop, kwargs)
            async for event in tool_stream:
                chunk = self._event_chunk(event)
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            assert tool_stream.answer is not None
            yield self._last_chunk(tool_stream.answer)
            return
        settings = self._settings(stop, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        stream = self.engine.astream(located.messages, **settings)
        async for piece in stream:
            chunk = self._piece_chunk(piece, self._asks_logprobs(settings))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        result = with_documents_read(stream.result, located)
        yield self._last_chunk(ToolAnswer(result.text, (), result), streamed=True)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """The model with tools it may call (LangChain tools, functions, pydantic classes, dicts).

        tool_choice: None or "auto" (the model decides), "any"/"required" (at least one call),
        a tool's name (that tool), "none" (text only). Every call's arguments validate against
        its tool's schema.
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        options: dict[str, Any] = {
            "tools": formatted,
            "tool_choice": openai_tool_choice(tool_choice, formatted),
        }
        if parallel_tool_calls is not None:
            options["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**options, **kwargs)

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

        "json_schema" and "json_mode" decode JSON valid for the schema; "function_calling" forces
        one call of the schema as a tool. All are strict: the answer parses and has every
        required key. Pydantic classes come back as instances, the rest as dicts.
        """
        if kwargs:
            raise TypeError(f"Unknown argument(s) {sorted(kwargs)} for with_structured_output.")
        if method not in STRUCTURED_OUTPUT_METHODS:
            raise ValueError(f"method must be one of {STRUCTURED_OUTPUT_METHODS}, got {method!r}.")
        json_schema = convert_to_json_schema(schema)
        check_schema(json_schema)
        traced = {
            "ls_structured_output_format": {
                "kwargs": {"method": method, "strict": strict},
                "schema": json_schema,
            }
        }
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable[Any, Any]
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind(tools=[tool], tool_choice=name, parallel_tool_calls=False, **traced)
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        else:
            llm = self.bind(json_schema=json_schema, **traced)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    def _answer(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> ToolAnswer:
        """One blocking answer: plain text, JSON for a bound schema, or tool calls for bound tools."""
        schema = kwargs.pop("json_schema", None)
        tool_options = {key: kwargs.pop(key) for key in _TOOL_ARGUMENTS if key in kwargs}
        settings = self._settings(stop, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        if tool_options.get("tools"):
            answer = generate_with_tools(self._model_engine(), located.messages, **tool_options, **settings)
            return dataclasses.replace(answer, result=with_documents_read(answer.result, located))
        if schema is None:
            result = self.engine.generate(located.messages, **settings)
        else:
            del settings["stop"]  # the schema decides where the answer ends
            result = generate_json(self._model_engine(), located.messages, schema, **settings)
        result = with_documents_read(result, located)
        return ToolAnswer(result.text, (), result)

    def _tool_stream(
        self,
        start: Callable[..., Any],
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """A tool-calling stream (`stream_with_tools` or `astream_with_tools`) for bound tools."""
        tool_options = {key: kwargs.pop(key) for key in _TOOL_ARGUMENTS if key in kwargs}
        settings = self._settings(stop, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        return start(self._model_engine(), located.messages, **tool_options, **settings)

    @staticmethod
    def _event_chunk(event: str | ToolCallDelta) -> ChatGenerationChunk:
        """A piece of text, or a piece of a call (LangChain joins the pieces of one index)."""
        if isinstance(event, str):
            return ChatGenerationChunk(message=AIMessageChunk(content=event))
        piece = ToolCallChunk(name=event.name, args=event.arguments, id=event.id, index=event.index)
        return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[piece]))

    def _whole(self, answer: ToolAnswer) -> Iterator[ChatGenerationChunk]:
        yield ChatGenerationChunk(message=AIMessageChunk(content=answer.content))
        yield self._last_chunk(answer)

    def _chat_result(self, answer: ToolAnswer) -> ChatResult:
        message = AIMessage(
            content=answer.content,
            tool_calls=[ToolCall(name=c.name, args=c.arguments, id=c.id) for c in answer.tool_calls],
            usage_metadata=usage_metadata(answer.result),
            response_metadata=self._response_metadata(answer),
        )
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": answer.finish_reason})
            ]
        )

    def _piece_chunk(self, piece: TextPiece, logprobs: bool) -> ChatGenerationChunk:
        """A streamed piece of text, with its tokens' log-probabilities when asked (LangChain
        joins them as the chunks add up, as langchain-openai's are)."""
        metadata = {"logprobs": self._logprobs(piece.tokens)} if logprobs else {}
        return ChatGenerationChunk(message=AIMessageChunk(content=piece, response_metadata=metadata))

    def _last_chunk(self, answer: ToolAnswer, streamed: bool = False) -> ChatGenerationChunk:
        """An empty chunk closing the stream, carrying the token counts and metadata once."""
        message = AIMessageChunk(
            content="",
            usage_metadata=usage_metadata(answer.result),
            response_metadata=self._response_metadata(answer, streamed),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": answer.finish_reason})


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
        located = [self._located_text(prompt, settings) for prompt in prompts]
        results = retrying(
            lambda: self.engine.generate_batch(
                [p.messages for p in located], raw=not self.use_chat_template, **settings
            ),
            self.max_retries,
        )
        return self._llm_result([with_documents_read(r, p) for r, p in zip(results, located, strict=True)])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        settings = self._settings(stop, kwargs)
        located = [self._located_text(prompt, settings) for prompt in prompts]
        results = await aretrying(
            lambda: self.engine.agenerate_batch(
                [p.messages for p in located], raw=not self.use_chat_template, **settings
            ),
            self.max_retries,
        )
        return self._llm_result([with_documents_read(r, p) for r, p in zip(results, located, strict=True)])

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        settings = self._settings(stop, kwargs)
        located = self._located_text(prompt, settings)
        stream = self.engine.stream(located.messages, raw=not self.use_chat_template, **settings)
        for piece in stream:
            chunk = self._piece_chunk(piece, self._asks_logprobs(settings))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        result = with_documents_read(stream.result, located)
        yield GenerationChunk(text="", generation_info=self._generation_info(result, streamed=True))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        settings = self._settings(stop, kwargs)
        located = self._located_text(prompt, settings)
        stream = self.engine.astream(located.messages, raw=not self.use_chat_template, **settings)
        async for piece in stream:
            chunk = self._piece_chunk(piece, self._asks_logprobs(settings))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert stream.result is not None
        result = with_documents_read(stream.result, located)
        yield GenerationChunk(text="", generation_info=self._generation_info(result, streamed=True))

    def _located_text(self, prompt: str, settings: dict[str, Any]) -> LocatedPrompt:
        """A text prompt as one user message, its retrieved documents marked (see `_located`)."""
        return self._located([{"role": "user", "content": prompt}], settings)

    def _logprobs(self, tokens: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
        """As langchain-openai's completion model gives them (the legacy completions shape)."""
        return openai_text_logprobs(tokens)

    def _piece_chunk(self, piece: TextPiece, logprobs: bool) -> GenerationChunk:
        return GenerationChunk(
            text=piece, generation_info={"logprobs": self._logprobs(piece.tokens)} if logprobs else None
        )

    def _generation_info(self, result: GenerationResult, streamed: bool = False) -> dict[str, Any]:
        return {**self._response_metadata(result, streamed), "usage": dict(usage_metadata(result))}

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
