"""Calibrated reordering: the model ranks its documents by calibrated attention, then reads them again
with the most relevant one where it reads best.

"Found in the Middle" (Hsieh et al., 2024) shows that the attention a document gets from the
question is its relevance plus a positional bias, and that attention minus the bias of its slot
(`rag_mspoe.attention.bias`) ranks documents by relevance. Rescaling attention inside the model
by that relevance (`AttentionCalibration`) moves a small model's answers little; the ranking
itself is sharp. This method uses it the other way: one pass scores each document by its
calibrated attention from the question rows (in the upper layers by default), the documents are
put in that order, and the model answers from the new prompt, unmodified.

Every row the first pass reads through the documents is the unmodified model's, and it reads
them only up to the highest ranking layer (`rag_mspoe.engine.document_prefix`); when the order
stays, the answer starts from those rows, finished through the upper layers. The second pass is
an ordinary prompt. The engine runs the method wherever it runs one (generation, scoring, sweeps,
the adapters, the server).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from rag_mspoe.attention.bias import PositionalBias, bias_cache_path
from rag_mspoe.methods.method_config import (
    check_finite,
    check_layers,
    chosen_layers,
    method_name,
)
from rag_mspoe.methods.prompt_rewriting import PromptRewriting
from rag_mspoe.models.decoder_stack import cuts_at, first_layers
from rag_mspoe.models.loading import model_display_name
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS, Prompt, as_messages
from rag_mspoe.rope.hooks import cache_argument
from rag_mspoe.rope.rescaling import rescaled

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.methods.document_orders import RecordedRanking

Placement = Literal["first", "sorted", "last", "repeat"]
_NUMBER = re.compile(r"^Document \[\d+\]")


class DocumentReordering(PromptRewriting):
    """What every method that reorders a prompt's documents declares: it needs their spans, it
    rewrites the prompt (the unmodified model reads the result), and `rescale` cannot apply it."""

    alone_because: ClassVar[str] = (
        "it rewrites the prompt and the unmodified model answers; to answer its prompt with another "
        "method, rewrite with Engine.rewritten([prompt], method=<this method>) (its second item is "
        "the prompts) and generate from that with the other method"
    )

    def hooks_class(self) -> Any:
        raise rewrites_not_rescales(method_name(self))

    def needs_document_spans(self) -> bool:
        return True

    def reorders_documents(self) -> bool:
        return True


@dataclass
class CalibratedReorder(DocumentReordering):
    """Rank the documents by calibrated attention, then answer from them reordered.

    layers: the layers whose attention ranks (None: the upper half, where the ranking is sharpest
    on the models measured). strength: the factor on the positional bias subtracted (0: raw
    attention, which favours the ends). place: "first" moves the top-ranked document to the front
    and keeps the others in their order; "last" moves it to the end (for models that read the end
    best); "sorted" orders every document by rank, best first; "repeat" keeps every document in
    its place and reads the top-ranked one again after the last, its number unchanged (the answer
    then starts from the rows the ranking pass read, so it costs little more than the unmodified
    answer). 'Document [i]' numbers are rewritten to run 1, 2, ... in a new order. min_margin:
    reorder only when the top document's relevance leads the runner-up's by at least this share of
    the attention the documents get (0: always); on the rankings measured the wrong ones mostly
    lead by little, and a wrong move costs the answers whose gold was already read well.
    """

    kind: ClassVar[str] = "calibrated-reorder"
    presets: ClassVar[dict[str, dict[str, Any]]] = {"calibrated-reorder": {}}
    layers: list[int] | None = None
    strength: float = 1.0
    place: Placement = "first"
    min_margin: float = 0.0

    def __post_init__(self) -> None:
        check_layers(self.layers)
        for name in ("strength", "min_margin"):
            check_finite(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.place not in ("first", "sorted", "last", "repeat"):
            raise ValueError(f"place must be 'first', 'sorted', 'last' or 'repeat', got {self.place!r}")

    def recorded_ranking(self) -> RecordedRanking:
        return self  # its ranking pass (`ranking_attention`) is what a sweep records

    def rewrite(self, engine: EngineLike, prompt: Prompt, *, raw: bool = False) -> Prompt:
        ids, spans = engine.document_spans_of(self, prompt, raw=raw)
        # Nothing above the highest ranking layer is read, so the ranking stops there.
        read = max(self.ranking_layers(int(engine.model.config.num_hidden_layers))) + 1
        attention = self._attention_over(engine, ids, spans, read)
        return prompt if attention is None else self._reordered_by(engine.model, prompt, attention, raw)

    def ranking_attention(
        self, engine: EngineLike, prompt: Prompt, *, raw: bool = False
    ) -> torch.Tensor | None:
        """The ranking pass: [layers, documents], the attention the rows after the last document put
        on each document in every layer, averaged over heads (None with fewer than two documents).
        Every layer is kept, so any band's ranking can be read from it later (sweeps record it)."""
        layers = int(engine.model.config.num_hidden_layers)
        return self._attention_over(engine, *engine.document_spans_of(self, prompt, raw=raw), layers)

    def reordered(
        self, engine: EngineLike, prompt: Prompt, attention: torch.Tensor, *, raw: bool = False
    ) -> Prompt:
        """The prompt reordered by the ranking that `attention` (as `ranking_attention` gives it) makes."""
        _, spans = engine.document_spans_of(self, prompt, raw=raw)
        self.prepare(engine.model, engine.tokenizer, [spans])
        return self._reordered_by(engine.model, prompt, attention, raw)

    def _attention_over(
        self, engine: EngineLike, ids: Sequence[int], spans: Sequence[tuple[int, int]], read: int
    ) -> torch.Tensor | None:
        """[layers, documents] for the first `read` layers (`ranking_attention`)."""
        if len(spans) < 2:
            return None
        self.prepare(engine.model, engine.tokenizer, [spans])
        model = engine.model
        with rescaled(model, None):
            cache = engine.document_prefixes.first_layers_of(ids[: spans[-1][1]], read)
        with first_layers(model, read) if cuts_at(model, read) else nullcontext():
            return document_attention(model, cache, ids, spans, range(read)).mean(dim=1)

    def _reordered_by(self, model: Any, prompt: Prompt, attention: torch.Tensor, raw: bool) -> Prompt:
        order = self.order(self.relevance(model, attention))
        if len(order) > attention.shape[-1]:  # "repeat": the given order, then one document again
            # Its copy breaks the 1, 2, ... numbering that finds documents in plain text, so a raw
            # prompt stays one message that says where its documents are.
            return prompt_with_copy(prompt, order[-1])
        reordered = reordered_prompt(prompt, order)
        return reordered[0]["content"] if raw else reordered

    def relevance(self, model: Any, attention: torch.Tensor) -> list[float]:
        """Each document's calibrated relevance from its ranking attention (`relevance_shares`)."""
        layers = self.ranking_layers(int(model.config.num_hidden_layers))
        bias = positional_bias(model, attention.shape[-1]).mean(dim=1) if self.strength else None
        shares = relevance_shares(attention, bias, layers, self.strength).tolist()
        return [value if math.isfinite(value) else -math.inf for value in shares]

    def prepare(self, model: Any, tokenizer: Any, spans: Sequence[Sequence[tuple[int, int]] | None]) -> None:
        if self.strength:
            from rag_mspoe.attention.attention_calibration import ensure_reference_bias

            ensure_reference_bias(model, tokenizer, spans)

    def ranking_layers(self, num_layers: int) -> list[int]:
        if self.layers is None:
            return list(range(num_layers // 2, num_layers))
        return chosen_layers("CalibratedReorder", self.layers, num_layers)

    def order(self, relevance: Sequence[float]) -> list[int]:
        """The new order of the documents (indices into the old one) given their relevance; under
        "repeat", the given order followed by the top-ranked document again."""
        count = len(relevance)
        ranked = sorted(range(count), key=lambda k: (-relevance[k], k))
        if count > 1 and relevance[ranked[0]] - relevance[ranked[1]] < self.min_margin:
            return list(range(count))
        if self.place == "sorted":
            return ranked
        best = ranked[0]
        if self.place == "repeat":
            return [*range(count), best]
        others = [k for k in range(count) if k != best]
        return [best, *others] if self.place == "first" else [*others, best]


def relevance_shares(
    attention: torch.Tensor, bias: torch.Tensor | None, layers: Sequence[int], strength: float
) -> torch.Tensor:
    """[..., documents]: each document's attention minus `strength` times its slot's bias, averaged
    over `layers`, as a share of the attention all the documents get there. attention: [...,
    layers, documents], head-averaged; bias: [layers, documents], head-averaged (unused at
    strength 0). The head average of the difference is the difference of the head averages, so
    the ranking is the one per-head calibration gives."""
    band = attention[..., list(layers), :]
    total = band.sum(dim=-1).mean(dim=-1, keepdim=True).clamp(min=1e-30)
    if strength:
        assert bias is not None
        band = band - strength * bias[list(layers)]
    return band.mean(dim=-2) / total


def document_attention(
    model: Any, cache: Any, ids: Sequence[int], spans: Sequence[tuple[int, int]], layers: Sequence[int]
) -> torch.Tensor:
    """[layers, heads, documents]: the attention mass each document gets from the rows after the
    last document, per layer of `layers` and head. `cache` holds the unmodified model's rows through
    the last document (a copy is used up); the model must have no method applied."""
    from rag_mspoe.attention.attention_calibration import AttentionCalibration
    from rag_mspoe.attention.spans import document_spans
    from rag_mspoe.rope.rescaling import STATE_ATTR

    end = spans[-1][1]
    with rescaled(model, AttentionCalibration(bias="zero", layers=list(layers))), torch.inference_mode():
        state = getattr(model, STATE_ATTR)
        state.recorded = {}
        with document_spans(model, [list(spans)]):
            rest = torch.tensor([list(ids[end:])], device=model.device)
            model(rest, **cache_argument(cache), logits_to_keep=1)
        mass = torch.stack([state.recorded[layer].float().cpu() for layer in layers])
        state.recorded = None
    return mass


def positional_bias(model: Any, documents: int) -> torch.Tensor:
    """[layers, heads, documents]: the model's estimated positional bias for this many documents."""
    path = bias_cache_path(model_display_name(model))
    config: Any = model.config
    table = PositionalBias.load(path).table(documents, config.num_hidden_layers, config.num_attention_heads)
    if table is None:
        raise ValueError(
            f"No positional-bias estimate for {documents} documents in {path}; estimate it with "
            "rag_mspoe.attention.estimate_positional_bias."
        )
    return table


def rewrites_not_rescales(name: str) -> TypeError:
    """The error for applying a method that rewrites prompts with `rescale`."""
    return TypeError(
        f"{name} rewrites the prompt before the model reads it (it reorders the documents), so it is "
        f"not applied to a model with rescale(); run it where prompts are read: "
        f"Engine.load(model, method='{name}'), ChatRagMsPoE(model=..., method='{name}'), "
        f"RagMsPoE(model=..., method='{name}'), `rag-mspoe serve --method {name}`, `rag-mspoe sweep`."
    )


def reordered_prompt(prompt: Prompt, order: Sequence[int]) -> list[dict[str, Any]]:
    """The prompt with its documents in `order` (old indices, one per document, across the messages
    in turn), each message's document spans updated; 'Document [i]' numbers run 1, 2, ... again."""
    count = len(_located_documents(as_messages(prompt)))
    if sorted(order) != list(range(count)):
        raise ValueError(f"An order of {count} documents is a permutation of 0..{count - 1}.")
    return prompt_with_documents(prompt, order)


def prompt_with_documents(prompt: Prompt, chosen: Sequence[int]) -> list[dict[str, Any]]:
    """The prompt with only the documents `chosen` (old indices, each at most once), in that order:
    they fill the document slots from the first, each slot keeping the separator before it; the
    slots left over go with theirs. Spans are updated; 'Document [i]' numbers run 1, 2, ... again."""
    messages = as_messages(prompt)
    located = _located_documents(messages)
    if len(set(chosen)) != len(chosen) or not all(0 <= k < len(located) for k in chosen):
        raise ValueError(
            f"Choose documents by distinct indices in 0..{len(located) - 1}, got {list(chosen)}."
        )
    texts = [messages[i]["content"][start:end] for i, (start, end) in located]
    moved = [texts[k] for k in chosen]
    result = [dict(message) for message in messages]
    slot = 0
    for index, message in enumerate(messages):
        own = [span for i, span in located if i == index]
        if not own:
            continue
        content = message["content"]
        pieces, spans = [content[: own[0][0]]], []
        for number, (start, _) in enumerate(own):
            if slot == len(moved):
                break
            if number:
                pieces.append(content[own[number - 1][1] : start])  # the separator before the slot
            text = _NUMBER.sub(f"Document [{slot + 1}]", moved[slot], count=1)
            begin = sum(len(p) for p in pieces)
            spans.append([begin, begin + len(text)])
            pieces.append(text)
            slot += 1
        result[index] = {**message, "content": "".join(pieces) + content[own[-1][1] :], DOCUMENT_SPANS: spans}
    return result


def prompt_with_copy(prompt: Prompt, index: int) -> list[dict[str, Any]]:
    """The prompt with document `index` (in prompt order) read once more right after the last
    document, as it is (its 'Document [i]' number kept), after the separator that comes before the
    last document (a newline when it is the only one in its message). Spans are updated."""
    messages = as_messages(prompt)
    located = _located_documents(messages)
    if not 0 <= index < len(located):
        raise ValueError(f"The prompt has {len(located)} documents, so it has no document {index}.")
    source, (start, end) = located[index]
    text = messages[source]["content"][start:end]
    last = located[-1][0]
    own = [span for i, span in located if i == last]
    content = messages[last]["content"]
    separator = content[own[-2][1] : own[-1][0]] if len(own) > 1 else "\n"
    after = own[-1][1]
    begin = after + len(separator)
    result = [dict(message) for message in messages]
    result[last] = {
        **messages[last],
        "content": content[:after] + separator + text + content[after:],
        DOCUMENT_SPANS: [[s, e] for s, e in own] + [[begin, begin + len(text)]],
    }
    return result


def moved_slot(original: Prompt, reordered: Prompt, slot: int) -> int | None:
    """Where the document at `slot` of `original` is in `reordered` (its documents, reordered, some
    perhaps left out), the documents compared without their 'Document [i]' numbers; None when it
    was left out."""
    count = len(document_texts(original))
    if not 0 <= slot < count:
        raise ValueError(f"The original prompt has {count} documents, so it has no document {slot}.")
    read = documents_read(original, reordered)
    return read.index(slot) if slot in read else None


def documents_read(given: Prompt, rewritten: Prompt) -> tuple[int, ...]:
    """The index in `given` of each document of `rewritten` (its documents, reordered, some perhaps
    left out or read again), in order; equal texts are matched in turn, and a document read again
    once they are used up gives the index it was last matched to."""
    slots: dict[str, list[int]] = {}
    for index, text in enumerate(document_texts(given)):
        slots.setdefault(text, []).append(index)
    read: list[int] = []
    matched: dict[str, int] = {}
    for text in document_texts(rewritten):
        if slots.get(text):
            matched[text] = slots[text].pop(0)
        elif text not in matched:
            raise ValueError("The rewritten prompt holds a document the given prompt does not.")
        read.append(matched[text])
    return tuple(read)


def document_texts(prompt: Prompt) -> list[str]:
    """The prompt's documents in order, without their 'Document [i]' numbers."""
    messages = as_messages(prompt)
    return [
        _NUMBER.sub("", messages[index]["content"][start:end], count=1)
        for index, (start, end) in _located_documents(messages)
    ]


def _located_documents(messages: Sequence[dict[str, Any]]) -> list[tuple[int, tuple[int, int]]]:
    """(message index, character span) of every document, in prompt order."""
    from rag_mspoe.prompts.document_prompts import find_document_lines

    located = []
    for index, message in enumerate(messages):
        spans = message.get(DOCUMENT_SPANS)
        if spans is None and message["role"] in ("user", "system"):
            spans = find_document_lines(message["content"])
        located += [(index, (int(start), int(end))) for start, end in spans or []]
    return located
