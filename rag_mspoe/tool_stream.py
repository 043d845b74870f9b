"""Streamed tool calls: an answer's text split, as it arrives, into text and tool-call chunks.

    splitter = CallSplitter()
    for piece in engine.stream(prompt, tools=tools, grammar=grammar):
        for event in splitter.feed(piece):
            ...    # str: answer text; ToolCallDelta: a piece of one call
    events = splitter.finish()

A call (`tool_format`'s `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) comes out as a
first chunk with its index, id and name, then its arguments' JSON text in fragments as they are
generated, as the OpenAI API streams calls. The constrained grammar writes the name before the
arguments, so the name is known early; a call written otherwise comes out whole once it closes.
The text outside calls comes out stripped at both ends, as `tool_format.parse_calls` returns it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from rag_mspoe.stopping import unfinished_tail
from rag_mspoe.tool_format import CALL_CLOSE, CALL_OPEN

# The start of a call's JSON up to its arguments, in the order the constrained grammar writes it.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call at `index`: its first piece carries id and name, every piece a
    fragment of the arguments' JSON text (all fragments of a call join into valid JSON)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class _OpenCall:
    """The call being written: its text so far and how much of its arguments went out."""

    def __init__(self) -> None:
        self.body = ""
        self.arguments_at: int | None = None  # where the arguments start in body, once the name is read
        self.scanned = 0  # body[arguments_at:scanned] has gone out
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.arguments_done = False

    def arguments_fragment(self, end: int) -> str:
        """The arguments' text from where the last fragment stopped up to `end` (or their end)."""
        assert self.arguments_at is not None
        start = self.scanned
        for position in range(start, end):
            if self.arguments_done:
                break
            char = self.body[position]
            self.scanned = position + 1
            if self.depth == 0 and char.isspace():  # before the arguments' opening brace
                start = self.scanned
            elif self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.arguments_done = self.depth == 0
        return self.body[start : self.scanned]


class CallSplitter:
    """Turns the pieces of a streamed answer into text and `ToolCallDelta` events."""

    def __init__(self) -> None:
        self.ids: list[str] = []  # the id of each call, in order
        self._buffer = ""  # text outside calls not yet sent: maybe the start of a call tag
        self._space = ""  # whitespace held back: it goes out only if more text follows it
        self._text_started = False
        self._call: _OpenCall | None = None

    def feed(self, piece: str) -> list[str | ToolCallDelta]:
        events: list[str | ToolCallDelta] = []
        if self._call is None:
            self._buffer += piece
        else:
            self._call.body += piece
        while True:
            if self._call is None:
                opened = self._buffer.find(CALL_OPEN)
                if opened < 0:
                    keep = unfinished_tail(self._buffer, (CALL_OPEN,))
                    self._text(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._text(self._buffer[:opened], events)
                self._call = _OpenCall()
                self._call.body, self._buffer = self._buffer[opened + len(CALL_OPEN) :], ""
            closed = self._call.body.find(CALL_CLOSE)
            self._call_events(closed if closed >= 0 else len(self._call.body), events)
            if closed < 0:
                return events
            self._close_call(events)
            self._buffer = self._call.body[closed + len(CALL_CLOSE) :]
            self._call = None

    def finish(self) -> list[str | ToolCallDelta]:
        """The events of what is left at the end of the answer."""
        events: list[str | ToolCallDelta] = []
        if self._call is not None and self._call.arguments_at is None:
            # An unclosed call whose name never came stays text, as parse_calls leaves it.
            self._text(CALL_OPEN + self._call.body, events)
        self._text(self._buffer, events)
        self._call, self._buffer = None, ""
        return events

    def _call_events(self, end: int, events: list[str | ToolCallDelta]) -> None:
        call = self._call
        assert call is not None
        if call.arguments_at is None:
            header = _HEADER.match(call.body, 0, end)
            if header is None:
                return
            call.arguments_at = call.scanned = header.end()
            self.ids.append(new_call_id())
            name = json.loads(header.group(1))
            events.append(ToolCallDelta(len(self.ids) - 1, self.ids[-1], name, ""))
        fragment = call.arguments_fragment(end)
        if fragment:
            events.append(ToolCallDelta(len(self.ids) - 1, None, None, fragment))

    def _close_call(self, events: list[str | ToolCallDelta]) -> None:
        """A call that closed before its name was read (keys in another order) goes out whole."""
        call = self._call
        assert call is not None
        if call.arguments_at is not None:
            return
        body = call.body[: call.body.find(CALL_CLOSE)]
        try:
            payload = json.loads(body)
        except json.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            self._text(CALL_OPEN + body + CALL_CLOSE, events)  # not a call: parse_calls keeps it as text
            return
        arguments = payload.get("arguments", payload.get("parameters", {}))
        self.ids.append(new_call_id())
        text = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        events.append(ToolCallDelta(len(self.ids) - 1, self.ids[-1], payload["name"], text))

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
