"""Shared pieces of the evaluation runner tests: a tiny chat model with the embedded tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tiny_models import tiny_model

from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.models.loading import resolve_source


@functools.cache
def embedded_tokenizer() -> Any:
    """The embedded model's tokenizer (with its chat template), without loading its weights."""
    from transformers import AutoTokenizer

    folder, _ = resolve_source(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_chat_model(max_position_embeddings: int = 2048, seed: int = 0) -> tuple[Any, Any]:
    """A randomly initialised 4-layer Llama over the embedded tokenizer's vocabulary: fast mechanics."""
    tokenizer = embedded_tokenizer()
    model = tiny_model(
        "llama", seed=seed, vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings
    )
    model._rag_mspoe_name = "tiny-llama"
    return model, tokenizer


def save_tiny_chat_model(folder: Path, max_position_embeddings: int = 2048) -> Path:
    """The tiny model saved as a Hugging Face folder, for commands that load a model themselves."""
    model, tokenizer = tiny_chat_model(max_position_embeddings)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_e2e_inputs(
    folder: Path, questions: int, documents: int, seed: int
) -> tuple[Path, Path, list[dict[str, Any]]]:
    """A corpus of Markdown files (one per document of invented-fact QA examples) and the
    questions file of `rag-mspoe e2e`, each question naming its gold document's file."""
    corpus = folder / "corpus"
    corpus.mkdir()
    records = []
    for example in generate_invented_qa(questions, documents, seed=seed):
        for number, document in enumerate(example.documents):
            name = f"{example.id}-{number}.md"
            (corpus / name).write_text(f"# {document.title}\n\n{document.text}\n")
            if document.is_gold:
                gold = name
        records.append(
            {
                "id": example.id,
                "question": example.question,
                "answers": list(example.answers),
                "gold_source": gold,
            }
        )
    questions_file = folder / "questions.jsonl"
    questions_file.write_text("".join(json.dumps(q) + "\n" for q in records))
    return corpus, questions_file, records
