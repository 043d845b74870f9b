"""LlamaIndex adapter over the one engine.

    from llama_index.core import Settings
    from rag_mspoe.connectors.llamaindex import RagMsPoE
    llm = RagMsPoE(method="mspoe", max_tokens=128)   # the embedded model, loaded once
    Settings.llm, Settings.tokenizer = llm, llm.tokenizer
    llm.complete("The capital of France is").text

`metadata` tells LlamaIndex the truth: the context window comes from the model config, and the
model is a chat model, so query engines send chat messages through its chat template.
`complete` continues plain text unless `use_chat_template=True`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.llms import LLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from pydantic import ConfigDict, Field

from rag_mspoe.chat_template import Prompt
from rag_mspoe.connectors.settings import EngineFields, aretrying, engine_settings, retrying
from rag_mspoe.engine import GenerationResult

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages as {"role", "content"} dicts for the chat template."""
    converted = []
    for message in messages:
        if message.role not in _ROLES:
            raise ValueError(
                f"Messages with role {message.role.value!r} are not supported: this model has no tool "
                "calling. Send system, user and assistant messages."
            )
        others = sorted(
            {type(block).__name__ for block in message.blocks if not isinstance(block, TextBlock)}
        )
        if others:
            raise ValueError(f"Message blocks {others} are not supported: this model reads text only.")
        converted.append({"role": _ROLES[message.role], "content": message.content or ""})
    return converted


class RagMsPoE(EngineFields, LLM):
    """A LlamaIndex LLM over a local model with rescaled RoPE (Ms-PoE, per layer, ...)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    use_chat_template: bool = Field(
        default=False, description="complete(): wrap the prompt as a user turn of the chat template."
    )

    @classmethod
    def class_name(cls) -> str:
        return "RagMsPoE"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.context_window,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self.model_name,
        )

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """The model's own tokenizer as LlamaIndex wants it: `Settings.tokenizer = llm.tokenizer`."""
        return self.engine.encode

    # -- chat ----------------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, settings = to_chat_messages(messages), engine_settings(self, kwargs)
        result = retrying(lambda: self.engine.generate(prompt, **settings), self.max_retries)
        return self._chat_response(result.text, "", result)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, settings = to_chat_messages(messages), engine_settings(self, kwargs)
        result = await aretrying(lambda: self.engine.agenerate(prompt, **settings), self.max_retries)
        return self._chat_response(result.text, "", result)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self.engine.stream(to_chat_messages(messages), **engine_settings(self, kwargs))

        def responses() -> ChatResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield self._chat_response(text, piece, None)
            yield self._chat_response(text, "", stream.result)

        return responses()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream = self.engine.astream(to_chat_messages(messages), **engine_settings(self, kwargs))

        async def responses() -> ChatResponseAsyncGen:
            text = ""
            async for piece in stream:
                text += piece
                yield self._chat_response(text, piece, None)
            yield self._chat_response(text, "", stream.result)

        return responses()

    # -- completion ----------------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, settings = self._completion_prompt(prompt, formatted), self._completion_settings(kwargs)
        result = retrying(lambda: self.engine.generate(text, **settings), self.max_retries)
        return self._completion_response(result.text, "", result)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, settings = self._completion_prompt(prompt, formatted), self._completion_settings(kwargs)
        result = await aretrying(lambda: self.engine.agenerate(text, **settings), self.max_retries)
        return self._completion_response(result.text, "", result)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self.engine.stream(
            self._completion_prompt(prompt, formatted), **self._completion_settings(kwargs)
        )

        def responses() -> CompletionResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield self._completion_response(text, piece, None)
            yield self._completion_response(text, "", stream.result)

        return responses()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        stream = self.engine.astream(
            self._completion_prompt(prompt, formatted), **self._completion_settings(kwargs)
        )

        async def responses() -> CompletionResponseAsyncGen:
            text = ""
            async for piece in stream:
                text += piece
                yield self._completion_response(text, piece, None)
            yield self._completion_response(text, "", stream.result)

        return responses()

    # -- helpers -------------------------------------------------------------------------------------
    def _completion_prompt(self, prompt: str, formatted: bool) -> Prompt:
        # LlamaIndex convention: an unformatted prompt goes through completion_to_prompt first.
        convert = self.completion_to_prompt
        return prompt if formatted or convert is None else convert(prompt)

    def _completion_settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**engine_settings(self, kwargs), "raw": not self.use_chat_template}

    def _raw(self, result: GenerationResult | None) -> dict[str, Any]:
        """Token counts in the OpenAI shape LlamaIndex's token counter reads, and what answered."""
        if result is None:
            return {}
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }
        raw: dict[str, Any] = {
            "model": self.model_name,
            "method": result.method,
            "finish_reason": result.finish_reason,
            "usage": usage,
        }
        if result.truncation is not None:
            raw["truncated_tokens"] = result.truncation.removed_tokens
        return raw

    def _chat_response(self, text: str, delta: str, result: GenerationResult | None) -> ChatResponse:
        message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
        return ChatResponse(message=message, delta=delta, raw=self._raw(result))

    def _completion_response(
        self, text: str, delta: str, result: GenerationResult | None
    ) -> CompletionResponse:
        return CompletionResponse(text=text, delta=delta, raw=self._raw(result))
