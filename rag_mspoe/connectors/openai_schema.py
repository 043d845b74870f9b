"""Request bodies and response payloads of the OpenAI chat and text completion APIs (the subset we serve)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rag_mspoe.connectors.settings import read_order
from rag_mspoe.engine import GenerationResult
from rag_mspoe.engine.engine_types import MIN_SAMPLING_TEMPERATURE
from rag_mspoe.engine.token_logprobs import (
    MAX_TOP_LOGPROBS,
    TokenLogprob,
    chat_alternatives,
    openai_chat_logprobs,
    openai_text_logprobs,
)
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS
from rag_mspoe.tools.grammar import Grammar
from rag_mspoe.tools.json_output import check_schema
from rag_mspoe.tools.tool_calls import ToolAnswer
from rag_mspoe.tools.tool_stream import ToolCallDelta


class _Request(BaseModel):
    """Request parts refuse fields they do not know: a field silently dropped is a setting ignored."""

    model_config = ConfigDict(extra="forbid")


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls always follow the parameters schema here


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the answer always follows the schema here


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a tool message's tool; the chat templates have no place for others'
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Where the documents are in the content, as [start, end) characters (an extension, for
    # methods that read documents; 'Document [i]' lines are found without it).
    document_spans: list[tuple[int, int]] | None = None

    @field_validator("name")
    @classmethod
    def _name_only_for_tools(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if value is not None and role != "tool":
            raise ValueError(
                f"name is not read in a {role} message (the chat template has no place for it, so it "
                "would be dropped); leave it out, or write the name into the content"
            )
        return value

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class StreamOptions(_Request):
    include_usage: bool = False


class _CompletionParams(_Request):
    """Settings shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's logs; changes nothing here

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_temperature(self) -> float:
        """The engine's temperature: one so small that logits divided by it overflow (1e-38 gave
        NaN probabilities) samples what greedy decoding picks, so it is greedy decoding."""
        return self.temperature if self.temperature >= MIN_SAMPLING_TEMPERATURE else 0.0

    def logprob_alternatives(self) -> int | None:
        """The engine's `logprobs` setting: None, or how many alternatives each token shows."""
        raise NotImplementedError


class ChatCompletionRequest(_CompletionParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_alternatives(self) -> int | None:
        return chat_alternatives(self.logprobs, self.top_logprobs)

    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    def prompt(self) -> list[dict[str, Any]]:
        # "developer" is the newer name of the system role.
        messages = []
        for m in self.messages:
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.tool_calls:
                message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            if m.document_spans is not None:
                message[DOCUMENT_SPANS] = [list(span) for span in m.document_spans]
            messages.append(message)
        return messages

    def tool_list(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def chosen_tool(self) -> str | dict[str, Any]:
        """tool_choice in the engine's form; OpenAI's default is "auto" when tools are sent."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools sent, and tool_choice is not "none")."""
        return bool(self.tools) and self.chosen_tool() != "none"

    def constraints(self) -> dict[str, Any]:
        """Engine settings for response_format, and for tools the model may not call."""
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools; send the tools it chooses among.")
        if self.calls_tools() and self.response_format and self.response_format.type != "text":
            raise ValueError(
                "response_format json_object/json_schema cannot be combined with callable tools here; "
                "send one or the other (or tool_choice 'none')."
            )
        options: dict[str, Any] = {"tools": self.tool_list()} if self.tools and not self.calls_tools() else {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            options["grammar"] = Grammar.json_object()
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema: {name, schema}.")
            # Objects closed as the library closes them: extra keys would let the model wander off.
            options["grammar"] = check_schema(fmt.json_schema.schema_)
        return options


MAX_PROMPTS = 32  # prompts in one completions request; each is a choice


class CompletionRequest(_CompletionParams):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's limit

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[str]) -> str | list[str]:
        prompts = [value] if isinstance(value, str) else value
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"send 1 to {MAX_PROMPTS} prompts per request")
        if not all(prompts):
            raise ValueError("a prompt is empty; send some text to continue")
        return value

    def texts(self) -> list[str]:
        """The prompts, one choice each (`index` in the order sent)."""
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def openapi_bodies() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each endpoint's OpenAPI `requestBody`, and the schemas they refer to (for the document's
    components): the routes read their bodies themselves (strictly, with their own errors), so
    FastAPI does not know them, and /openapi.json would describe no body to clients and fuzzers."""
    bodies, components = {}, {}
    for path, model in (
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/completions", CompletionRequest),
    ):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        bodies[path] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return bodies, components


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(*results: GenerationResult) -> dict[str, int]:
    prompt = sum(result.prompt_tokens for result in results)
    completion = sum(result.completion_tokens for result in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_completion(result: GenerationResult, model: str) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": result.finish_reason,
                "logprobs": openai_chat_logprobs(result.logprobs),
                **read_order(result),  # an extra field OpenAI clients ignore
            }
        ],
        "usage": usage(result),
    }


def tool_call_completion(answer: ToolAnswer, model: str) -> dict[str, Any]:
    """A chat completion whose message may carry tool calls (content null when there is no text)."""
    body = chat_completion(answer.result, model)
    message: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
    if answer.tool_calls:
        message["tool_calls"] = [call.openai() for call in answer.tool_calls]
    body["choices"][0].update(message=message, finish_reason=answer.finish_reason)
    return body


def tool_stream_delta(event: str | ToolCallDelta) -> dict[str, Any]:
    """The stream delta of a piece of a tool-calling answer: text, or one whole call (index, id,
    type, name and arguments), in the shape the OpenAI API streams them."""
    if isinstance(event, str):
        return {"content": event}
    function = {"name": event.name, "arguments": event.arguments}
    return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": function}]}


def after_prefix(tokens: tuple[TokenLogprob, ...], prefix: str) -> tuple[TokenLogprob, ...]:
    """Answer tokens with their offsets in a choice's text that starts with `prefix` (the echo)."""
    return tuple(dataclasses.replace(t, text_offset=(t.text_offset or 0) + len(prefix)) for t in tokens)


@dataclass(frozen=True)
class TextChoice:
    """One prompt's answer in a completions response; with echo its text starts with `prefix`
    (the prompt), and its logprobs with the prompt's tokens when they were scored."""

    result: GenerationResult
    prefix: str = ""
    prompt_tokens: tuple[TokenLogprob, ...] | None = None

    def payload(self, index: int) -> dict[str, Any]:
        tokens = None
        if self.result.logprobs is not None:
            tokens = (*(self.prompt_tokens or ()), *after_prefix(self.result.logprobs, self.prefix))
        return {
            "index": index,
            "text": self.prefix + self.result.text,
            "finish_reason": self.result.finish_reason,
            "logprobs": openai_text_logprobs(tokens),
            **read_order(self.result),  # an extra field OpenAI clients ignore
        }


def text_completion(choices: Sequence[TextChoice], model: str) -> dict[str, Any]:
    """A text completion: a choice per prompt, their token counts summed."""
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice.payload(index) for index, choice in enumerate(choices)],
        "usage": usage(*(choice.result for choice in choices)),
    }


def chat_chunk(
    chunk_id: str, model: str, delta: dict[str, Any], logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": logprobs}],
    }


def final_chat_chunk(
    chunk_id: str, model: str, result: GenerationResult, finish_reason: str
) -> dict[str, Any]:
    """The chunk that closes a streamed chat answer: its finish reason and, when a method reordered
    the documents, which given document each one read was (as in the non-streamed choice)."""
    chunk = chat_chunk(chunk_id, model, {})
    chunk["choices"][0].update(finish_reason=finish_reason, **read_order(result))
    return chunk


def text_chunk(
    chunk_id: str, model: str, text: str, logprobs: dict[str, Any] | None = None, index: int = 0
) -> dict[str, Any]:
    return {
        "id": chunk_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": None, "logprobs": logprobs}],
    }


def final_text_chunk(chunk_id: str, model: str, result: GenerationResult, index: int = 0) -> dict[str, Any]:
    """The chunk that closes one prompt's streamed text completion (see `final_chat_chunk`)."""
    chunk = text_chunk(chunk_id, model, "", index=index)
    chunk["choices"][0].update(finish_reason=result.finish_reason, **read_order(result))
    return chunk


def usage_chunk(chunk_id: str, model: str, results: Sequence[GenerationResult], obj: str) -> dict[str, Any]:
    return {
        "id": chunk_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(*results),
    }


def error_body(
    message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
