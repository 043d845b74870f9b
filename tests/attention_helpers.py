"""Prompts made of token blocks (prefix, documents, question), and four titled documents with a
question one of them answers, for the attention-method and reordering tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rag_mspoe.attention import document_spans
from rag_mspoe.rope.hooks import cache_argument

# The gold one is "France" (index 1).
DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps."),
    ("Deserts", "The Sahara is the largest hot desert in the world."),
]
QUESTION = "What is the capital of France?"


def block_prompt(
    prefix: Sequence[int], documents: Sequence[Sequence[int]], suffix: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids prefix + documents + suffix, and each document's span."""
    ids = list(prefix)
    spans = []
    for document in documents:
        spans.append((len(ids), len(ids) + len(document)))
        ids.extend(document)
    return ids + list(suffix), spans


def unnumbered_documents_prompt(
    tokenizer: Any, documents: Sequence[tuple[str, str]], question: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """The benchmark's layout with each (title, text) on a line 'Document (Title: ...) ...' (no
    numbers, so reordering the documents only reorders text), through the real chat template:
    token ids and each document's token span."""
    from rag_mspoe.prompts.document_prompts import document_message, lines_with_spans, render_with_spans

    lines = [f"Document (Title: {title}) {text}" for title, text in documents]
    text, char_spans = lines_with_spans("Answer from the search results.\n\n", lines)
    message = document_message(f"{text}\n\nQuestion: {question}", char_spans)
    ids, spans = render_with_spans(tokenizer, [message])
    return ids, spans or []


def random_blocks(lengths: Sequence[int], seed: int, vocab: int = 96) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def left_padded(rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids of rows padded on the left (pad id 0)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def logits(model: Any, ids: Sequence[int], spans: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    with document_spans(model, [spans or []]), torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0]


def answer_loglikelihood(
    model: Any, ids: Sequence[int], spans: Sequence[tuple[int, int]], answer: int
) -> float:
    """Log-likelihood of the last `answer` tokens of `ids` given the rest."""
    out = logits(model, ids, spans).float().log_softmax(-1)
    targets = torch.tensor(list(ids)[-answer:])
    return float(out[-answer - 1 : -1].gather(-1, targets[:, None]).sum())


def incremental_logits(
    model: Any, ids: Sequence[int], spans: Sequence[tuple[int, int]], prompt: int
) -> torch.Tensor:
    """Logits of every token after the first `prompt`, from a prefill and then one token at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    rows = []
    with document_spans(model, [spans]), torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids[:prompt])]), **cache_argument(cache), use_cache=True)
        rows.append(out.logits[0, -1])
        for token in ids[prompt:-1]:
            out = model(input_ids=torch.tensor([[token]]), **cache_argument(cache), use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


@contextlib.contextmanager
def in_dtype(model: Any, dtype: torch.dtype) -> Iterator[Any]:
    """`model` in `dtype` inside the block and exactly as before after it: a round trip through
    `model.to` alone would leave its fp32 buffers (RoPE's inverse frequencies) rounded to bf16."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    original = model.dtype
    model.to(dtype)
    try:
        yield model
    finally:
        model.to(original)
        for name, buffer in buffers.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer
