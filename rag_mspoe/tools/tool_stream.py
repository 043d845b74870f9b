"""Streamed tool calls: an answer's text split, as it arrives, into text and tool-call chunks.

    splitter = CallSplitter()
    for piece in engine.stream(prompt, tools=tools, grammar=grammar):
        for event in splitter.feed(piece):
            ...    # str: answer text; ToolCallDelta: one call
    events = splitter.finish(cut=result.finish_reason == "length")

Text outside calls comes out as it is written. A tagged call (`<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`) comes out as one chunk with its index, id, name and arguments'
JSON once it has closed: a chunk cannot be taken back, and a call the token limit cuts off is no
call (finish reason "length", as the OpenAI API answers it), so a call goes out only once it is
whole. An answer that starts like a call's bare JSON (the llama3 and mistral formats, or a ```json
fence) is held back and comes out at its end, as calls if `tool_format.parse_calls` reads it as
calls, else as text. The events always add up to what `parse_calls` reads in the whole answer (the
text outside calls stripped at both ends), cut or not.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from rag_mspoe.tools.text_markers import unfinished_tail
from rag_mspoe.tools.tool_format import (
    CALL_CLOSE,
    CALL_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    bare_calls,
    call_of,
    may_be_bare_call,
    split_thinking,
    unclosed_call,
    unfinished_bare_call,
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """One call of a streamed answer, whole, as an OpenAI stream's `delta.tool_calls` entry: its
    index among the answer's calls, id, name and arguments' JSON text."""

    index: int
    id: str
    name: str
    arguments: str


class CallSplitter:
    """Turns the pieces of a streamed answer into text and `ToolCallDelta` events."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.ids: list[str] = []  # the id of each call, in order
        self._tool_names = tool_names  # bare JSON is a call only of these tools (any, if None)
        # The answer's start, held back while it may be a call's bare JSON (after any <think> block).
        self._held: str | None = ""
        self._buffer = ""  # text outside calls not yet sent: maybe the start of a call tag
        self._space = ""  # whitespace held back: it goes out only if more text follows it
        self._text_started = False
        self._call: str | None = None  # the text of the tagged call being written, once opened

    def feed(self, piece: str) -> list[str | ToolCallDelta]:
        events: list[str | ToolCallDelta] = []
        if self._held is not None:
            self._held += piece
            if self._undecided():
                return events
            thinking, piece = split_thinking(self._held)
            self._held = None
            self._text(thinking, events)
        if self._call is None:
            self._buffer += piece
        else:
            self._call += piece
        while True:
            if self._call is None:
                opened = self._buffer.find(CALL_OPEN)
                if opened < 0:
                    keep = unfinished_tail(self._buffer, (CALL_OPEN,))
                    self._text(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._text(self._buffer[:opened], events)
                self._call, self._buffer = self._buffer[opened + len(CALL_OPEN) :], ""
            closed = self._call.find(CALL_CLOSE)
            if closed < 0:
                return events
            body = self._call[:closed]
            parsed = call_of(body.strip())
            if parsed is None:  # not a call: parse_calls keeps it as text
                self._text(CALL_OPEN + body + CALL_CLOSE, events)
            else:
                self._whole_call(*parsed, events)
            self._buffer, self._call = self._call[closed + len(CALL_CLOSE) :], None

    def finish(self, cut: bool = False) -> list[str | ToolCallDelta]:
        """The events of what is left at the end of the answer; cut: the token limit ended it, so
        a call it was still writing is dropped (`parse_calls(..., cut=True)`)."""
        events: list[str | ToolCallDelta] = []
        if self._held is not None:
            held, self._held = self._held, None
            if cut:
                held = held[: len(held) - unfinished_tail(held, (CALL_OPEN,))]
            thinking, answer = split_thinking(held)
            calls = bare_calls(answer, self._tool_names)
            if calls or (cut and unfinished_bare_call(answer)):
                self._text(thinking, events)
                for name, arguments in calls:
                    self._whole_call(name, arguments, events)
                return events
            self._text(thinking, events)
            events += self.feed(answer)
        if self._call is not None:
            parsed = unclosed_call(self._call)  # an unclosed call at the very end
            if parsed is not None:
                self._whole_call(*parsed, events)
            elif not cut:  # whose JSON is not a call: text, unless it was cut off
                self._text(CALL_OPEN + self._call, events)
        elif cut:
            self._buffer = self._buffer[: len(self._buffer) - unfinished_tail(self._buffer, (CALL_OPEN,))]
        self._text(self._buffer, events)
        self._call, self._buffer = None, ""
        return events

    def _whole_call(self, name: str, arguments: dict[str, Any], events: list[str | ToolCallDelta]) -> None:
        self.ids.append(new_call_id())
        text = json.dumps(arguments, ensure_ascii=False)
        events.append(ToolCallDelta(len(self.ids) - 1, self.ids[-1], name, text))

    def _undecided(self) -> bool:
        """Whether the held start of the answer may still be, or is, a call's bare JSON."""
        assert self._held is not None
        start = self._held.lstrip()
        thinking = start.startswith(THINK_OPEN) and THINK_CLOSE not in start
        if thinking or (start and THINK_OPEN.startswith(start)):
            return True  # inside (or maybe opening) a thinking block
        return may_be_bare_call(split_thinking(self._held)[1])

    def _text(self, text: str, events: list[str | ToolCallDelta]) -> None:
        if not self._text_started:
            text = text.lstrip()
        if not text:
            return
        held = self._space + text
        body = held.rstrip()
        self._space = held[len(body) :]
        if body:
            events.append(body)
            self._text_started = True
