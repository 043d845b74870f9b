"""Follow generated tokens as text: stop strings of any length, and text that is safe to stream.

`TextTracker` decodes one sequence incrementally, finds the earliest stop string, and holds back
any tail that could still grow into a stop string, so a stream never shows part of one.
`GenerationWatch` is the transformers stopping criterion that feeds one tracker per batch row
and ends rows on stop strings (a streamed row also when its reader leaves), and the whole batch
on cancellation or a deadline.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria

from rag_mspoe.engine.text_stream import StreamOutlet, TextPiece
from rag_mspoe.engine.token_logprobs import LogprobRecorder, TokenLogprob
from rag_mspoe.tools.text_markers import unfinished_tail

_INCOMPLETE_CHAR = "\ufffd"  # what decode gives for a multi-byte character cut in the middle


class TextTracker:
    """The decoded text of one generated sequence, cut at the earliest stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), eos_ids: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._eos_ids = eos_ids
        self._ids: list[int] = []
        # Decode from a recent offset rather than from the start: decoding a token depends on its
        # neighbours (leading spaces, multi-byte characters), and a window keeps each step cheap.
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._stop_at: int | None = None
        self._emitted = 0
        self.ended_by_eos = False
        # Where each token's text starts in `_text` (a token holding part of a character starts
        # where the character will), and the tokens' log-probabilities when they are recorded.
        self._starts: list[int] = []
        self._entries: list[TokenLogprob] = []
        self._tokens_handed = 0

    @property
    def n_tokens(self) -> int:
        """Tokens generated up to and including the one that ended the sequence."""
        return len(self._ids)

    @property
    def done(self) -> bool:
        return self.ended_by_eos or self._stop_at is not None

    @property
    def hit_stop_string(self) -> bool:
        return self._stop_at is not None

    @property
    def text(self) -> str:
        """The final text so far: everything decoded, cut before the first stop string."""
        return self._text if self._stop_at is None else self._text[: self._stop_at]

    def push(self, token_id: int, entry: TokenLogprob | None = None) -> None:
        if self.done:
            return
        self._ids.append(token_id)
        self._starts.append(len(self._text))
        if entry is not None:
            self._entries.append(entry)
        if token_id in self._eos_ids:
            self.ended_by_eos = True
            return
        self._append(self._decode_new(final=False))

    def flush(self) -> None:
        """Decode what is still pending (a character whose bytes never completed), at the end."""
        if not self.done:
            self._append(self._decode_new(final=True))

    def take_streamable(self) -> TextPiece:
        """Text not handed out before that can no longer change or turn out to be a stop string."""
        limit = len(self.text) if self.done else len(self._text) - unfinished_tail(self._text, self._stop)
        return self._take(limit)

    def take_rest(self) -> TextPiece:
        """Everything not handed out yet; call once generation has ended (after `flush`). Its
        tokens include those that wrote no text (the end of turn, the rest of a stop string)."""
        return self._take(len(self.text), every_token=True)

    def answer_tokens(self) -> tuple[TokenLogprob, ...]:
        """The recorded tokens, one per token `n_tokens` counts: the one that ended the answer
        included (the end of turn, the last of a stop string). Tokens past the final text have
        the text's length as their offset."""
        return self._with_offsets(0, len(self._entries))

    def _take(self, end: int, every_token: bool = False) -> TextPiece:
        """The text from the last piece handed out to `end`, with the recorded tokens starting in
        it (with `every_token`, all those not handed out yet)."""
        text = self.text[self._emitted : end]
        first = self._tokens_handed
        while self._tokens_handed < len(self._entries) and (
            every_token or self._starts[self._tokens_handed] < end
        ):
            self._tokens_handed += 1
        self._emitted = max(self._emitted, end)
        return TextPiece(text, self._with_offsets(first, self._tokens_handed))

    def _with_offsets(self, first: int, end: int) -> tuple[TokenLogprob, ...]:
        return tuple(
            dataclasses.replace(entry, text_offset=min(start, len(self.text)))
            for entry, start in zip(self._entries[first:end], self._starts[first:end], strict=True)
        )

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_new(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith(_INCOMPLETE_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before) :]

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        # A stop string not found before must end inside the new text.
        search_from = max(0, len(self._text) - self._longest_stop + 1)
        self._text += new_text
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self._stop_at = min(hits)


class GenerationWatch(StoppingCriteria):
    """Feeds each new token to its row's tracker and tells `generate` which rows are finished.

    outlets: none, or one per row, when the rows are streamed: each row's streamable text goes to
    its outlet's `put` as it appears, and its outlet's `cancel` event ends that row alone (its
    reader has gone). on_row_end(row) is called once for each row that ends before the batch does
    (by EOS or a stop string), so its stream can close without waiting for the longest answer.
    Setting `cancel` or passing the deadline (time.monotonic() seconds) ends every row at the
    next step. With a recorder (the call's first logits processor), each row's tokens get their
    log-probabilities, in the result and in the streamed pieces. new_from: the prompt's width, when
    a step may add several tokens (speculative decoding); else each step adds one.
    """

    def __init__(
        self,
        trackers: Sequence[TextTracker],
        *,
        outlets: Sequence[StreamOutlet] = (),
        on_row_end: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
        recorder: LogprobRecorder | None = None,
        new_from: int | None = None,
    ):
        self.trackers = list(trackers)
        self._seen = new_from
        self._recorder = recorder
        self._outlets = list(outlets)
        if self._outlets and len(self._outlets) != len(self.trackers):
            raise ValueError(f"outlets need one entry per row ({len(self.trackers)}), or none.")
        self._on_row_end = on_row_end
        self._cancel = cancel
        self._deadline = deadline
        self.timed_out = False
        self.ended: set[int] = set()  # rows handed to on_row_end

    def row_cancelled(self, row: int) -> bool:
        return bool(self._outlets) and self._outlets[row].cancel.is_set()

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        start = input_ids.shape[1] - 1 if self._seen is None else self._seen
        if self._seen is not None:
            self._seen = input_ids.shape[1]
        new_tokens = input_ids[:, start:].tolist()
        for row, (tracker, token_ids) in enumerate(zip(self.trackers, new_tokens, strict=True)):
            for token_id in token_ids:
                entry = None
                if self._recorder is not None and not tracker.done:  # a finished row gets padding
                    entry = self._recorder.entry(row, token_id)
                tracker.push(token_id, entry)
        for row, outlet in enumerate(self._outlets):
            if not outlet.cancel.is_set():
                piece = self.trackers[row].take_streamable()
                if piece:
                    outlet.put(piece)
        if self._deadline is not None and time.monotonic() > self._deadline:
            self.timed_out = True
        finished = [tracker.done or self.row_cancelled(row) for row, tracker in enumerate(self.trackers)]
        if self.timed_out or (self._cancel is not None and self._cancel.is_set()):
            return torch.ones(len(finished), dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
        if self._on_row_end is not None and not all(finished):  # the last rows end with the batch
            for row, tracker in enumerate(self.trackers):
                if tracker.done and row not in self.ended and not self.row_cancelled(row):
                    self.ended.add(row)
                    self._on_row_end(row)
        return torch.tensor(finished, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
