"""LlamaIndex adapter over the one engine.

    from llama_index.core import Settings
    from rag_mspoe.connectors.llamaindex import RagMsPoE
    llm = RagMsPoE(method="mspoe", max_tokens=128)   # the embedded model, loaded once
    Settings.llm, Settings.tokenizer = llm, llm.tokenizer
    llm.complete("The capital of France is").text

`metadata` tells LlamaIndex the truth: the context window comes from the model config, and the
model is a chat model, so query engines send chat messages through its chat template.
`complete` continues plain text unless `use_chat_template=True`.

It is a `FunctionCallingLLM`: tools reach the model through its chat template and its calls are
decoded under a grammar of the tools' schemas (`rag_mspoe.tools.tool_calls`), so `predict_and_call`
and agents (`FunctionAgent`) get calls whose arguments validate. `structured_predict` decodes
JSON valid for the output class (`rag_mspoe.tools.json_output`) in one generation. `stream_chat` with
tools (what `stream_chat_with_tools` and agents use) streams the text as it is written; each
response lists the calls finished so far in `additional_kwargs["tool_calls"]`, the last one all.

    llm.predict_and_call([FunctionTool.from_defaults(fn=add)], "What is 2 + 3?", tool_required=True)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import MetadataMode
from llama_index.core.tools import BaseTool
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rag_mspoe.connectors.document_finder import RETRIEVED, LocatedPrompt, with_documents_read
from rag_mspoe.connectors.settings import EngineFields, aretrying, engine_settings, read_order, retrying
from rag_mspoe.engine import Engine, GenerationResult
from rag_mspoe.engine.text_stream import TextPiece
from rag_mspoe.engine.token_logprobs import TokenLogprob
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS
from rag_mspoe.tools.json_output import generate_json
from rag_mspoe.tools.tool_calls import ToolAnswer, astream_with_tools, generate_with_tools, stream_with_tools
from rag_mspoe.tools.tool_stream import ToolCallDelta

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.TOOL: "tool",
}
# Call arguments that turn a chat call into a tool-calling one (set by _prepare_chat_with_tools).
_TOOL_ARGUMENTS = ("tools", "tool_choice", "parallel_tool_calls")
Model = TypeVar("Model", bound=BaseModel)


class RetrievedNodesListener(BaseEventHandler):
    """Keeps the texts of the nodes every retriever returns (as query engines and chat engines
    stuff them into prompts: with their metadata, and bare), so that a method reading documents
    finds them in the prompt."""

    @classmethod
    def class_name(cls) -> str:
        return "RetrievedNodesListener"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            for scored in event.nodes:
                node = scored.node
                RETRIEVED.add([node.get_content(metadata_mode=MetadataMode.LLM), node.get_content()])


_listening = False


def listen_to_retrievers() -> None:
    """Add the listener to LlamaIndex's root dispatcher (once), which every retriever's events reach."""
    global _listening
    if not _listening:
        get_dispatcher().add_event_handler(RetrievedNodesListener())
        _listening = True


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex chat messages as chat-template dicts; assistant tool calls and tool results included."""
    converted = []
    for message in messages:
        if message.role not in _ROLES:
            raise ValueError(
                f"Messages with role {message.role.value!r} are not supported. "
                "Send system, user, assistant and tool messages."
            )
        others = sorted(
            {
                type(block).__name__
                for block in message.blocks
                if not isinstance(block, (TextBlock, ToolCallBlock))
            }
        )
        if others:
            raise ValueError(f"Message blocks {others} are not supported: this model reads text only.")
        entry: dict[str, Any] = {"role": _ROLES[message.role], "content": message.content or ""}
        calls = list(message.additional_kwargs.get("tool_calls") or [])
        calls += [
            {
                "id": b.tool_call_id,
                "type": "function",
                "function": {"name": b.tool_name, "arguments": b.tool_kwargs},
            }
            for b in message.blocks
            if isinstance(b, ToolCallBlock)
        ]
        if calls and message.role == MessageRole.ASSISTANT:
            entry["tool_calls"] = calls
        if message.role == MessageRole.TOOL and message.additional_kwargs.get("tool_call_id"):
            entry["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        if message.additional_kwargs.get(DOCUMENT_SPANS) is not None:
            # Where the documents are in the content, for methods that read them.
            entry[DOCUMENT_SPANS] = message.additional_kwargs[DOCUMENT_SPANS]
        converted.append(entry)
    return converted


class RagMsPoE(EngineFields, FunctionCallingLLM):
    """A LlamaIndex LLM over a local model with rescaled RoPE (Ms-PoE, per layer, ...)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    use_chat_template: bool = Field(
        default=False, description="complete(): wrap the prompt as a user turn of the chat template."
    )

    @classmethod
    def class_name(cls) -> str:
        return "RagMsPoE"

    @model_validator(mode="after")
    def _listen_to_retrievers(self) -> RagMsPoE:
        listen_to_retrievers()
        return self

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.context_window,
            num_output=self.max_tokens,
            is_chat_model=True,
            # Tool calls are grammar-constrained decoding, which needs the model here.
            is_function_calling_model=isinstance(self.engine, Engine),
            model_name=self.model_name,
        )

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """The model's own tokenizer as LlamaIndex wants it: `Settings.tokenizer = llm.tokenizer`."""
        return self.engine.encode

    # -- chat ----------------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        answer = retrying(lambda: self._answer(messages, dict(kwargs)), self.max_retries)
        return self._chat_response(answer.content, "", answer)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        answer = await aretrying(
            lambda: asyncio.to_thread(self._answer, messages, dict(kwargs)), self.max_retries
        )
        return self._chat_response(answer.content, "", answer)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        if kwargs.get("tools"):
            tool_stream = self._tool_stream(stream_with_tools, messages, dict(kwargs))

            def tool_responses() -> ChatResponseGen:
                so_far = _StreamedAnswer()
                for event in tool_stream:
                    yield self._chat_response(so_far.text, so_far.add(event), None, so_far.finished_calls())
                assert tool_stream.answer is not None
                yield self._chat_response(tool_stream.answer.content, "", tool_stream.answer)

            return tool_responses()
        settings = engine_settings(self, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        stream = self.engine.stream(located.messages, **settings)

        def responses() -> ChatResponseGen:
            so_far = _Written(settings["logprobs"] is not None)
            for piece in stream:
                so_far.add(piece)
                yield self._chat_response(so_far.text, piece, None, tokens=so_far.tokens)
            assert stream.result is not None
            yield self._chat_response(so_far.text, "", with_documents_read(stream.result, located))

        return responses()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        if kwargs.get("tools"):
            tool_stream = self._tool_stream(astream_with_tools, messages, dict(kwargs))

            async def tool_responses() -> ChatResponseAsyncGen:
                so_far = _StreamedAnswer()
                async for event in tool_stream:
                    yield self._chat_response(so_far.text, so_far.add(event), None, so_far.finished_calls())
                assert tool_stream.answer is not None
                yield self._chat_response(tool_stream.answer.content, "", tool_stream.answer)

            return tool_responses()
        settings = engine_settings(self, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        stream = self.engine.astream(located.messages, **settings)

        async def responses() -> ChatResponseAsyncGen:
            so_far = _Written(settings["logprobs"] is not None)
            async for piece in stream:
                so_far.add(piece)
                yield self._chat_response(so_far.text, piece, None, tokens=so_far.tokens)
            assert stream.result is not None
            yield self._chat_response(so_far.text, "", with_documents_read(stream.result, located))

        return responses()

    # -- tools and structured output ----------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """chat() arguments offering `tools`; tool_choice as in OpenAI ("auto", "required", a name)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg)
                if isinstance(user_msg, str)
                else user_msg
            )
        return {
            "messages": messages,
            "tools": [tool.metadata.to_openai_tool() for tool in tools] or None,
            "tool_choice": tool_choice or ("required" if tool_required else "auto"),
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"The model answered without calling a tool: {response.message.content!r}.")
        return [
            ToolSelection(
                tool_id=call["id"],
                tool_name=call["function"]["name"],
                tool_kwargs=json.loads(call["function"]["arguments"]),
            )
            for call in calls
        ]

    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """An `output_cls` instance from one generation constrained to its JSON schema."""
        messages = to_chat_messages(prompt.format_messages(llm=self, **prompt_args))
        settings = engine_settings(self, dict(llm_kwargs or {}))
        del settings["stop"]  # the schema decides where the answer ends
        result = retrying(
            lambda: generate_json(self._model_engine(), messages, output_cls.model_json_schema(), **settings),
            self.max_retries,
        )
        return output_cls.model_validate_json(result.text)

    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        return await asyncio.to_thread(
            lambda: self.structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        )

    def _tool_stream(
        self, start: Callable[..., Any], messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> Any:
        """A tool-calling stream (`stream_with_tools` or `astream_with_tools`) for the offered tools."""
        tool_options = {key: kwargs.pop(key) for key in _TOOL_ARGUMENTS if key in kwargs}
        settings = engine_settings(self, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        return start(self._model_engine(), located.messages, **tool_options, **settings)

    def _answer(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ToolAnswer:
        """One blocking answer: plain text, or tool calls when tools are offered."""
        tool_options = {key: kwargs.pop(key) for key in _TOOL_ARGUMENTS if key in kwargs}
        settings = engine_settings(self, kwargs)
        located = self._located(to_chat_messages(messages), settings)
        if tool_options.get("tools"):
            answer = generate_with_tools(self._model_engine(), located.messages, **tool_options, **settings)
            return dataclasses.replace(answer, result=with_documents_read(answer.result, located))
        result = with_documents_read(self.engine.generate(located.messages, **settings), located)
        return ToolAnswer(result.text, (), result)

    # -- completion ----------------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        settings = self._completion_settings(kwargs)
        located = self._completion_prompt(prompt, formatted, settings)
        result = retrying(lambda: self.engine.generate(located.messages, **settings), self.max_retries)
        return self._completion_response(result.text, "", with_documents_read(result, located))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        settings = self._completion_settings(kwargs)
        located = self._completion_prompt(prompt, formatted, settings)
        result = await aretrying(
            lambda: self.engine.agenerate(located.messages, **settings), self.max_retries
        )
        return self._completion_response(result.text, "", with_documents_read(result, located))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        settings = self._completion_settings(kwargs)
        located = self._completion_prompt(prompt, formatted, settings)
        stream = self.engine.stream(located.messages, **settings)

        def responses() -> CompletionResponseGen:
            so_far = _Written(settings["logprobs"] is not None)
            for piece in stream:
                so_far.add(piece)
                yield self._completion_response(so_far.text, piece, None, so_far.tokens)
            assert stream.result is not None
            yield self._completion_response(so_far.text, "", with_documents_read(stream.result, located))

        return responses()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        settings = self._completion_settings(kwargs)
        located = self._completion_prompt(prompt, formatted, settings)
        stream = self.engine.astream(located.messages, **settings)

        async def responses() -> CompletionResponseAsyncGen:
            so_far = _Written(settings["logprobs"] is not None)
            async for piece in stream:
                so_far.add(piece)
                yield self._completion_response(so_far.text, piece, None, so_far.tokens)
            assert stream.result is not None
            yield self._completion_response(so_far.text, "", with_documents_read(stream.result, located))

        return responses()

    # -- helpers -------------------------------------------------------------------------------------
    def _completion_prompt(self, prompt: str, formatted: bool, settings: dict[str, Any]) -> LocatedPrompt:
        """The prompt as one message, its retrieved documents marked (see `_located`)."""
        # LlamaIndex convention: an unformatted prompt goes through completion_to_prompt first.
        convert = self.completion_to_prompt
        text = prompt if formatted or convert is None else convert(prompt)
        return self._located([{"role": "user", "content": text}], settings)

    def _completion_settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**engine_settings(self, kwargs), "raw": not self.use_chat_template}

    def _raw(self, answer: GenerationResult | ToolAnswer | None) -> dict[str, Any]:
        """Token counts in the OpenAI shape LlamaIndex's token counter reads, and what answered."""
        if answer is None:
            return {}
        result = answer.result if isinstance(answer, ToolAnswer) else answer
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }
        raw: dict[str, Any] = {
            "model": self.model_name,
            "method": result.method,
            "finish_reason": answer.finish_reason,
            "usage": usage,
        }
        if result.truncation is not None:
            raw["truncated_tokens"] = result.truncation.removed_tokens
        raw.update(read_order(result))
        return raw

    def _chat_response(
        self,
        text: str,
        delta: str,
        answer: GenerationResult | ToolAnswer | None,
        calls: list[dict[str, Any]] | None = None,
        tokens: list[TokenLogprob] | None = None,
    ) -> ChatResponse:
        """calls: the OpenAI-shaped calls of a response mid-stream; by default the answer's.
        tokens: the tokens so far of a response mid-stream, when log-probabilities were asked for."""
        if calls is None:
            calls = [call.openai() for call in answer.tool_calls] if isinstance(answer, ToolAnswer) else []
        message = ChatMessage(
            role=MessageRole.ASSISTANT, content=text, additional_kwargs={"tool_calls": calls} if calls else {}
        )
        logprobs = _logprobs(answer, tokens)
        return ChatResponse(message=message, delta=delta, raw=self._raw(answer), logprobs=logprobs)

    def _completion_response(
        self, text: str, delta: str, result: GenerationResult | None, tokens: list[TokenLogprob] | None = None
    ) -> CompletionResponse:
        logprobs = _logprobs(result, tokens)
        return CompletionResponse(text=text, delta=delta, raw=self._raw(result), logprobs=logprobs)


class _Written:
    """A plain streamed answer so far: its text and, when they were asked for, its tokens."""

    def __init__(self, logprobs: bool) -> None:
        self.text = ""
        self.tokens: list[TokenLogprob] | None = [] if logprobs else None

    def add(self, piece: TextPiece) -> None:
        self.text += piece
        if self.tokens is not None:
            self.tokens.extend(piece.tokens)


def _logprobs(
    answer: GenerationResult | ToolAnswer | None, so_far: list[TokenLogprob] | None = None
) -> list[list[LogProb]] | None:
    """The answer's tokens (or, mid-stream, those so far) as LlamaIndex holds them: per token, the
    chosen one, then the likeliest others at its step."""
    result = answer.result if isinstance(answer, ToolAnswer) else answer
    tokens = result.logprobs if result is not None else so_far
    if tokens is None:
        return None

    def one(token: TokenLogprob) -> LogProb:
        assert token.logprob is not None  # only a prompt's first token has none
        return LogProb(token=token.token, logprob=token.logprob, bytes=list(token.bytes))

    return [[one(token), *(one(other) for other in token.top if other.id != token.id)] for token in tokens]


class _StreamedAnswer:
    """A tool-calling answer as its stream goes: the text so far, and the calls written so far
    (LlamaIndex reads calls from every streamed response; `tool_stream` sends each call whole)."""

    def __init__(self) -> None:
        self.text = ""
        self._calls: list[dict[str, Any]] = []

    def add(self, event: str | ToolCallDelta) -> str:
        """Take one event of the stream; returns its text (empty for a call)."""
        if isinstance(event, str):
            self.text += event
            return event
        function = {"name": event.name, "arguments": event.arguments}
        self._calls.append({"id": event.id, "type": "function", "function": function})
        return ""

    def finished_calls(self) -> list[dict[str, Any]]:
        return list(self._calls)
