"""What the engine takes and gives: per-call settings, results, errors, and the marker of a
call that uses the engine's default method."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rag_mspoe.engine.token_logprobs import TokenLogprob, check_top_logprobs
from rag_mspoe.methods.method_spec import MethodSpec
from rag_mspoe.tools.grammar import Grammar

FinishReason = Literal["stop", "length"]


class EngineDefault(enum.Enum):
    """The type of `ENGINE_DEFAULT` (an enum member: one value, kept by pickling and copying)."""

    ENGINE_DEFAULT = "the engine's default method"


# The method nobody named: for a call, the engine's default method (`Engine(method=...)`,
# `set_method`); for a new engine, the method its model has (what `rescale` applied, or nothing).
# Every other spec is resolved as `parse_method` resolves it: None is always the unmodified model.
ENGINE_DEFAULT = EngineDefault.ENGINE_DEFAULT
CallMethod = MethodSpec | EngineDefault


class PromptTooLongError(ValueError):
    """The prompt and the requested output do not fit in the model's context window."""


class GenerationTimeout(TimeoutError):
    """A call did not finish within its timeout (waiting for the model included)."""


class GenerationCancelled(Exception):
    """The caller set the call's `cancel` event: it stopped waiting for the model, or between tokens."""


@dataclass(frozen=True)
class Truncation:
    """What middle truncation removed from one prompt."""

    removed_tokens: int
    at_token: int  # index in the prompt where the removed span started
    removed_text: str


@dataclass(frozen=True)
class GenerationResult:
    """One answer. completion_tokens counts every generated token, the one that ended the answer
    (end of turn, or the last token of a stop string) included."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    method: str
    truncation: Truncation | None = None
    # When the method rewrote the prompt (reordering methods): for each document the model read, in
    # its order, the index of that document in the prompt given; cite by it ('Document [1]' of the
    # answer is documents_read[0] of the given documents).
    documents_read: tuple[int, ...] | None = None
    # With the `logprobs` setting: one per token `completion_tokens` counts, with its log-probability.
    logprobs: tuple[TokenLogprob, ...] | None = None


# Below this temperature sampling is greedy decoding in all but name: two tokens whose logits
# differ by 1e-3 are drawn 1 : e^100 apart.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class GenerationSettings:
    """Per-call settings, checked once. temperature == 0 means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    method: CallMethod = ENGINE_DEFAULT  # None: the unmodified model
    raw: bool = False  # plain text continuation, without the chat template
    prefix: str = ""  # text the answer is made to start with; the result holds only what follows
    truncate: Literal["error", "middle"] = "error"
    timeout: float | None = None  # seconds for the whole call, waiting for the model included
    grammar: Grammar | None = None  # what the answer must match (rag_mspoe.tools.grammar); None: free text
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI-style tools shown to the model by the chat template
    # None: no log-probabilities; k (0-20): each answer token's, and its step's k likeliest tokens.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}.")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.temperature < MIN_SAMPLING_TEMPERATURE:
            # Sampling that cold is greedy decoding in all but name, and would overflow the softmax.
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.truncate not in ("error", "middle"):
            raise ValueError(f"truncate must be 'error' or 'middle', got {self.truncate!r}.")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {self.timeout}.")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TypeError(
                f"grammar must be a rag_mspoe.tools.grammar.Grammar, got {type(self.grammar).__name__}."
            )
        if self.grammar is not None and self.prefix:
            raise ValueError(
                "prefix cannot be combined with grammar: the grammar decides how the answer starts."
            )
        if isinstance(self.tools, Mapping) or not all(isinstance(t, Mapping) for t in self.tools or ()):
            raise TypeError(f"tools must be a list of tool dicts, got {self.tools!r}.")
        object.__setattr__(self, "tools", tuple(self.tools or ()))
        check_top_logprobs(self.logprobs)

    @classmethod
    def of(cls, settings: dict[str, Any]) -> GenerationSettings:
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            valid = ", ".join(f.name for f in dataclasses.fields(cls))
            raise TypeError(f"Unknown generation setting(s) {unknown}; valid settings are: {valid}.")
        return cls(**settings)


@dataclass(frozen=True)
class Prefill:
    """What one prompt's forward left behind, for calibration."""

    tokens: int
    hidden_states: tuple[torch.Tensor, ...] | None  # embeddings then each layer's output, [T, hidden]
    head_scores: dict[int, torch.Tensor]  # per layer, position-awareness per head (Ms-PoE per prompt)
