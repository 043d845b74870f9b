"""Build multi-document QA examples the way the lost-in-the-middle paper did, with our retriever.

Each oracle record (a question, its answers, one gold passage) gets the passages of a pool that
our FAISS index and sentence-transformers model rank highest for the question, minus every
passage that contains an answer; the top `num_documents - 1` are the distractors, in retrieval
order, and the gold passage goes in at `gold_index`. Other gold positions of the same example
come from `with_gold_at`, which keeps the distractors in that order, as the paper's files do.
A record with too few answer-free passages in the pool (an answer like "S" is in nearly every
passage) is skipped and reported, not a failure of the whole build.

    pool = pool_from_examples(load_qa("nq-open-30_total_documents_gold_at_0.jsonl.gz"))
    examples = build_from_oracle(read_jsonl("nq-open-oracle.jsonl.gz"), pool, 10, index_path="pool-index")

`rag-mspoe build-qa` does this from the command line.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_mspoe.eval.data.records import Document, QAExample
from rag_mspoe.eval.scoring.metrics import normalize_answer
from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.embedding import DEFAULT_EMBEDDING_MODEL, Embedder
from rag_mspoe.pipelines.index import ChunkIndex, IndexSettings
from rag_mspoe.pipelines.indexing import embedding_text
from rag_mspoe.pipelines.retrieval import RetrievedChunk, Retriever

_SOURCE = "pool"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkippedRecord:
    """An oracle record left out of a build, and why."""

    id: str
    reason: str


def build_from_oracle(
    records: Sequence[dict[str, Any]],
    passage_pool: Sequence[Document],
    num_documents: int,
    *,
    gold_index: int = 0,
    embedding_model: str | Embedder = DEFAULT_EMBEDDING_MODEL,
    index_path: str | Path | None = None,
    skipped: list[SkippedRecord] | None = None,
) -> list[QAExample]:
    """One QA example per oracle record, with `num_documents` documents and the gold at `gold_index`.

    records: {"question", "answers", and the gold passage as "ctxs" (the one marked isgold, or
    the only one), "nq_annotated_gold" ({"title", "chunked_long_answer"}) or "gold" ({"title",
    "text"})}; an "id" names the example, else its index in `records`.
    index_path: a folder to keep the pool's index in, so later builds over the same pool skip
    the embedding; None builds it in memory.
    skipped: receives the records left out because fewer than `num_documents - 1` passages of
    the pool are free of their answers (also logged). When no record at all can be built, the
    pool is too small for `num_documents`: a ValueError.
    """
    if num_documents < 1:
        raise ValueError(f"num_documents must be at least 1 (the gold passage), got {num_documents}.")
    if not 0 <= gold_index < num_documents:
        raise ValueError(
            f"gold_index must be in [0, {num_documents - 1}] for {num_documents} documents, got {gold_index}."
        )
    oracles = [_parse_oracle(record, number) for number, record in enumerate(records)]
    if not oracles:
        return []
    needed = num_documents - 1
    if len(passage_pool) < needed:
        raise ValueError(
            f"The pool has {len(passage_pool)} passages; {num_documents} documents need at least {needed} "
            "distractors. Use a larger pool or fewer documents."
        )
    embedder = embedding_model if isinstance(embedding_model, Embedder) else Embedder.load(embedding_model)
    retriever = Retriever(_pool_index(passage_pool, embedder, index_path), embedder)
    # Fetch more than needed, since answer-bearing passages are dropped; fetch all if that is short.
    depth = min(len(passage_pool), 4 * needed + 16)
    hits = retriever.retrieve_many([oracle.question for oracle in oracles], k=depth) if needed else []
    examples, left_out = [], []
    for number, oracle in enumerate(oracles):
        distractors: list[Document] = []
        if needed:
            distractors = _distractors(oracle, _passages(passage_pool, hits[number]), needed)
            if len(distractors) < needed and depth < len(passage_pool):
                every = retriever.retrieve(oracle.question, k=len(passage_pool))
                distractors = _distractors(oracle, _passages(passage_pool, every), needed)
            if len(distractors) < needed:
                reason = (
                    f"only {len(distractors)} passages of the pool are free of its answers "
                    f"{list(oracle.answers)}, {needed} are needed"
                )
                left_out.append(SkippedRecord(oracle.id, reason))
                continue
        documents = distractors[:gold_index] + [oracle.gold] + distractors[gold_index:]
        examples.append(QAExample(oracle.id, oracle.question, oracle.answers, tuple(documents)))
    if left_out and not examples:
        raise ValueError(
            f"No record could be built; record {left_out[0].id!r}: {left_out[0].reason}. "
            "Use a larger pool or fewer documents."
        )
    if left_out:
        logger.warning(
            "Skipped %d of %d records with too few answer-free passages (first: %r, %s)",
            len(left_out),
            len(oracles),
            left_out[0].id,
            left_out[0].reason,
        )
    if skipped is not None:
        skipped.extend(left_out)
    return examples


def pool_from_examples(examples: Iterable[QAExample]) -> list[Document]:
    """Every distinct non-gold document of the examples, in first-seen order, as a passage pool."""
    seen: dict[tuple[str, str], Document] = {}
    for example in examples:
        for document in example.documents:
            if not document.is_gold and not document.has_answer:
                seen.setdefault((document.title, document.text), Document(document.title, document.text))
    return list(seen.values())


def split_by_question(
    examples: Sequence[QAExample], heldout_fraction: float, seed: int
) -> tuple[list[QAExample], list[QAExample]]:
    """(kept, held out): the questions drawn at random into two disjoint sets, so a question asked
    twice (in any wording that normalises the same) never sits on both sides. Order is kept."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"The held-out fraction must be between 0 and 1, got {heldout_fraction}.")
    questions = sorted({normalize_answer(example.question) for example in examples})
    random.Random(seed).shuffle(questions)
    heldout = set(questions[: round(heldout_fraction * len(questions))])
    kept = [e for e in examples if normalize_answer(e.question) not in heldout]
    return kept, [e for e in examples if normalize_answer(e.question) in heldout]


def pool_from_records(records: Iterable[dict[str, Any]]) -> list[Document]:
    """A passage pool from JSON records: a passage ({"title", "text"}) or a QA example in the paper's
    format ({"question", "answers", "ctxs"}), whose non-gold answer-free documents are taken.
    Distinct passages, in first-seen order."""
    seen: dict[tuple[str, str], Document] = {}
    for number, record in enumerate(records):
        if "ctxs" in record:
            passages = pool_from_examples([QAExample.from_dict(record, str(number))])
        elif isinstance(record.get("title"), str) and isinstance(record.get("text"), str):
            passages = [Document(record["title"], record["text"])]
        else:
            raise ValueError(
                f"Pool record {number} is neither a passage ('title' and 'text' strings) nor a QA "
                "example with 'ctxs'; fix or remove it."
            )
        for passage in passages:
            seen.setdefault((passage.title, passage.text), passage)
    return list(seen.values())


@dataclass(frozen=True)
class _Oracle:
    id: str
    question: str
    answers: tuple[str, ...]
    gold: Document


def _parse_oracle(record: dict[str, Any], number: int) -> _Oracle:
    where = f"Oracle record {number}"
    question, answers = record.get("question"), record.get("answers")
    if not isinstance(question, str) or not question:
        raise ValueError(f"{where} has no 'question' string; every record needs one.")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where} needs 'answers', a non-empty list of strings.")
    title, text = _gold_title_and_text(record)
    if title is None or text is None:
        raise ValueError(
            f"{where} has no gold passage; give 'ctxs' with the gold marked isgold, "
            "'nq_annotated_gold' with 'title' and 'chunked_long_answer', or 'gold' with 'title' and 'text'."
        )
    gold = Document(title, text, is_gold=True, has_answer=True)
    return _Oracle(str(record.get("id", number)), question, tuple(answers), gold)


def _gold_title_and_text(record: dict[str, Any]) -> tuple[Any, Any]:
    contexts = record.get("ctxs")
    if isinstance(contexts, list) and contexts:
        marked = [c for c in contexts if isinstance(c, dict) and c.get("isgold")]
        chosen = marked[0] if marked else contexts[0] if len(contexts) == 1 else None
        if isinstance(chosen, dict):
            return chosen.get("title"), chosen.get("text")
    annotated = record.get("nq_annotated_gold")
    if isinstance(annotated, dict):
        return annotated.get("title"), annotated.get("chunked_long_answer")
    gold = record.get("gold")
    if isinstance(gold, dict):
        return gold.get("title"), gold.get("text")
    return None, None


def _passages(pool: Sequence[Document], hits: list[RetrievedChunk]) -> list[Document]:
    return [pool[int(hit.chunk.location or 0)] for hit in hits]  # location holds the pool index


def _distractors(oracle: _Oracle, ranked: list[Document], needed: int) -> list[Document]:
    """The first `needed` passages that neither contain an answer nor repeat the gold or each other."""
    answers = [normalize_answer(answer) for answer in oracle.answers]
    seen = {oracle.gold.text}
    chosen = []
    for passage in ranked:
        if passage.text in seen:
            continue
        # The title is shown in the prompt too, so an answer there would give it away.
        content = normalize_answer(f"{passage.title} {passage.text}")
        if any(answer in content for answer in answers):
            continue
        seen.add(passage.text)
        chosen.append(Document(passage.title, passage.text))
        if len(chosen) == needed:
            break
    return chosen


def _pool_index(pool: Sequence[Document], embedder: Embedder, path: str | Path | None) -> ChunkIndex:
    """The pool's index: loaded from `path` when it holds this very pool, else built (and saved)."""
    # Chunk i is passage i of the pool; its location field carries the index back.
    digests = {str(i): _digest(passage) for i, passage in enumerate(pool)}
    if path is not None and ChunkIndex.exists(path):
        index = ChunkIndex.load(path)
        index.check_embedding_model(embedder.name, embedder.files)
        if index.documents != digests:
            raise ValueError(
                f"The index at {path} was built from another passage pool; "
                "delete that folder or pass another index_path."
            )
        return index
    settings = IndexSettings(
        embedding_model=embedder.name,
        dimension=embedder.dimension,
        embedding_files=None if embedder.files is None else embedder.files.digests,
    )
    index = ChunkIndex(path or "", settings)
    chunks = [
        Chunk(source=_SOURCE, title=p.title, text=p.text, start=0, end=len(p.text), location=str(i))
        for i, p in enumerate(pool)
    ]
    index.add(chunks, embedder.embed([embedding_text(chunk) for chunk in chunks]), digests)
    if path is not None:
        index.save()
    return index


def _digest(passage: Document) -> str:
    return hashlib.sha256(f"{passage.title}\n{passage.text}".encode()).hexdigest()
