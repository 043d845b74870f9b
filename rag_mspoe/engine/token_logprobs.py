"""Log-probabilities of tokens, and the shapes the OpenAI APIs give them in.

Generated tokens' are recorded while `generate` runs; a prompt's own tokens are scored by
`Engine.prompt_logprobs` with the same recorder. In generation the recorder is the first logits
processor of a call, so it sees the model's own distribution:
before temperature, top_p and any grammar mask (a constrained answer's tokens keep the
probability the model gave them, not 1). It keeps one step's distribution; the stopping
criterion, which runs once the step's token is chosen, asks it for that token's entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import LogitsProcessor

MAX_TOP_LOGPROBS = 20  # as the OpenAI API allows; each alternative costs a lookup per token


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its id, text, UTF-8 bytes (a token may hold part of a character; `token` then
    reads 'bytes:\\xe4\\xb8'), its log-probability (nats), and the likeliest tokens at its step
    (most likely first; the chosen one among them when it is one of them). text_offset is where
    the token starts in the answer's text, in characters; alternatives have none. A prompt's
    first token (`Engine.prompt_logprobs`) has logprob None: nothing predicts it."""

    id: int
    token: str
    bytes: bytes
    logprob: float | None
    top: tuple[TokenLogprob, ...] = ()
    text_offset: int | None = None


def check_top_logprobs(value: int | None) -> int | None:
    """The `logprobs` generation setting: None records nothing; 0-20 records each token's
    log-probability and that many alternatives."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"logprobs must be None or an int (alternatives per token), got {value!r}.")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"logprobs must be between 0 and {MAX_TOP_LOGPROBS} (alternatives per token), got {value}."
        )
    return value


def chat_alternatives(logprobs: bool, top_logprobs: int | None) -> int | None:
    """The OpenAI chat API's two fields as the engine's one `logprobs` setting."""
    return (top_logprobs or 0) if logprobs else None


def token_text(data: bytes) -> str:
    """A token's bytes as text; bytes that are not whole UTF-8 characters are written out."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


class LogprobRecorder(LogitsProcessor):
    """Keeps the last step's log-probabilities (and its top alternatives) of every batch row.

    token_bytes maps a token id to its bytes (special tokens to their written form)."""

    def __init__(self, top: int, token_bytes: Callable[[int], bytes]) -> None:
        self._top = top
        self._token_bytes = token_bytes
        self._step: torch.Tensor | None = None  # [rows, vocab] log-probabilities, fp32
        self._alternatives: list[list[tuple[int, float]]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.record(scores)
        return scores

    def record(self, scores: torch.Tensor) -> None:
        """Keep the log-probabilities of one step's logits ([rows, vocab])."""
        self._step = torch.log_softmax(scores.float(), dim=-1)
        if self._top:
            values, ids = self._step.topk(self._top, dim=-1)
            self._alternatives = [
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
            ]

    def entry(self, row: int, token_id: int) -> TokenLogprob:
        """The entry of the token just chosen for `row` (its offset is set by the text tracker)."""
        if self._step is None:
            raise RuntimeError("LogprobRecorder.entry called before any step was scored.")
        top = tuple(self._token(i, value) for i, value in self._alternatives[row]) if self._top else ()
        return replace(self._token(token_id, float(self._step[row, token_id])), top=top)

    def unpredicted(self, token_id: int) -> TokenLogprob:
        """The entry of a prompt's first token, which nothing predicts."""
        return self._token(token_id, None)

    def _token(self, token_id: int, logprob: float | None) -> TokenLogprob:
        data = self._token_bytes(token_id)
        return TokenLogprob(id=token_id, token=token_text(data), bytes=data, logprob=logprob)


def openai_chat_logprobs(tokens: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
    """Token log-probabilities as the chat API gives them (None when not asked for)."""
    if tokens is None:
        return None

    def entry(token: TokenLogprob) -> dict[str, Any]:
        return {"token": token.token, "logprob": token.logprob, "bytes": list(token.bytes)}

    content = [{**entry(token), "top_logprobs": [entry(other) for other in token.top]} for token in tokens]
    return {"content": content, "refusal": None}


def openai_text_logprobs(tokens: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
    """Token log-probabilities as the legacy completions API gives them: parallel lists, the
    alternatives as {token: logprob} (null when none were asked for), offsets in the choice's text."""
    if tokens is None:
        return None
    alternatives = [
        None if token.logprob is None else {other.token: other.logprob for other in token.top}
        for token in tokens
    ]
    return {
        "tokens": [token.token for token in tokens],
        "token_logprobs": [token.logprob for token in tokens],
        "top_logprobs": alternatives if any(alternatives) else None,
        "text_offset": [token.text_offset for token in tokens],
    }
