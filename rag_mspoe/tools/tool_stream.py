"""Streamed tool calls: an answer's text split, as it arrives, into text and tool-call chunks.

    splitter = CallSplitter()
    for piece in engine.stream(prompt, tools=tools, grammar=grammar):
        for event in splitter.feed(piece):
            ...    # str: answer text; ToolCallDelta: a piece of one call
    events = splitter.finish()

A tagged call (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) comes out as a
first chunk with its index, id and name, then its arguments' JSON text in fragments as they are
generated, as the OpenAI API streams calls. The constrained grammar writes the name before the
arguments, so the name is known early; a call written otherwise comes out whole once it closes.
An answer that starts like a call's bare JSON (the llama3 and mistral formats, or a ```json
fence) is held back and comes out at its end, as calls if `tool_format.parse_calls` reads it as
calls, else as text. The text outside calls comes out stripped at both ends, as `parse_calls`
returns it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from rag_mspoe.engine.stopping import unfinished_tail
from rag_mspoe.tools.tool_format import (
    BARE_MARKERS,
    CALL_CLOSE,
    CALL_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    bare_calls,
    call_of,
    split_thinking,
)

# How an answer that is a call's bare JSON starts, whitespace removed (markers dropped or not).
_BARE_OPENINGS = tuple(
    start + body for start in ("", "```json", "```", *BARE_MARKERS) for body in ('{"name":', '[{"name":')
)

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

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.ids: list[str] = []  # the id of each call, in order
        self._tool_names = tool_names  # bare JSON is a call only of these tools (any, if None)
        # The answer's start, held back while it may be a call's bare JSON (after any <think> block).
        self._held: str | None = ""
        self._buffer = ""  # text outside calls not yet sent: maybe the start of a call tag
        self._space = ""  # whitespace held back: it goes out only if more text follows it
        self._text_started = False
        self._call: _OpenCall | None = None

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
        if self._held is not None:
            thinking, answer = split_thinking(self._held)
            calls = bare_calls(answer, self._tool_names)
            if calls:
                self._text(thinking, events)
                for name, arguments in calls:
                    self._whole_call(name, arguments, events)
                self._held = None
                return events
            held, self._held = answer, None
            self._text(thinking, events)
            events += self.feed(held)
        if self._call is not None and self._call.arguments_at is None:
            parsed = call_of(self._call.body.strip())  # an unclosed call at the very end
            if parsed is None:  # whose name never came, and whose JSON is not a call: text
                self._text(CALL_OPEN + self._call.body, events)
            else:
                self._whole_call(*parsed, events)
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
        parsed = call_of(body)
        if parsed is None:
            self._text(CALL_OPEN + body + CALL_CLOSE, events)  # not a call: parse_calls keeps it as text
            return
        self._whole_call(*parsed, events)

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
        squeezed = "".join(split_thinking(self._held)[1].split())
        return any(o.startswith(squeezed) or squeezed.startswith(o) for o in _BARE_OPENINGS)

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
