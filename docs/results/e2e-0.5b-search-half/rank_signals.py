"""Per search-half question: the dense top-20 chunks (MiniLM), a BM25 ranking over every chunk,
which chunks hold an answer, and the 0.5B's ranking attention over the dense top 20 in retrieval
order (every layer, head-averaged: the ranking pass of the shipped `calibrated` method).
Appends to OUT and resumes where it stopped.

    python rank_signals.py INDEX QUESTIONS OUT LIMIT

BM25 here is the textbook one (k1 = 1.2, b = 0.75, words of \\w+, no stop words), written out so
the records do not depend on a library's version; the package's `--first-stage lexical` uses
bm25s (Lucene's variant, English stop words).
"""

import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from rag_mspoe.attention.reorder import CalibratedReorder, positional_bias
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import read_jsonl
from rag_mspoe.eval.scoring.metrics import normalize_answer
from rag_mspoe.pipelines.retrieval import Retriever
from rag_mspoe.prompts.document_prompts import document_message
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

K = 20
WORD = re.compile(r"\w+")


def bm25_scorer(chunks):
    tokens = [Counter(WORD.findall((c.title + " " + c.text).lower())) for c in chunks]
    lengths = [sum(t.values()) for t in tokens]
    average = sum(lengths) / len(lengths)
    frequency = Counter(w for t in tokens for w in t)
    count = len(chunks)

    def scores(query):
        result = [0.0] * count
        for word in set(WORD.findall(query.lower())):
            if word not in frequency:
                continue
            idf = math.log(1 + (count - frequency[word] + 0.5) / (frequency[word] + 0.5))
            for i, t in enumerate(tokens):
                f = t.get(word)
                if f:
                    result[i] += idf * f * 2.2 / (f + 1.2 * (0.25 + 0.75 * lengths[i] / average))
        return result

    return scores


def has_answer(text, answers):
    normalized = normalize_answer(text)
    return any(normalize_answer(a) in normalized for a in answers)


def main(index_dir, questions_file, out, limit):
    torch.set_num_threads(1)
    retriever = Retriever.load(index_dir)
    chunks = [retriever.index.chunk(i) for i in range(len(retriever.index))]
    bm25 = bm25_scorer(chunks)
    done = {json.loads(line)["id"] for line in out.open()} if out.exists() else set()
    questions = read_jsonl(questions_file)[:limit]
    engine = Engine.load("qwen2.5-coder-0.5b-instruct")
    method = CalibratedReorder(layers=[12, 13, 14, 15, 16, 17], strength=0.5)
    with out.open("a") as records:
        for q in questions:
            if q["id"] in done:
                continue
            start = time.time()
            dense = retriever.retrieve(q["question"], k=K)
            lexical = bm25(q["question"])
            lexical_order = sorted(range(len(chunks)), key=lambda i: -lexical[i])
            lexical_top = lexical_order[:K]
            lexical_rank = {i: rank for rank, i in enumerate(lexical_order[:200], start=1)}
            text, spans = render_qa_prompt(q["question"], [(d.chunk.title, d.chunk.text) for d in dense])
            attention = method.ranking_attention(engine, [document_message(text, spans)])
            bias_file = out.parent / "positional-bias.json"
            if not bias_file.exists():
                bias = positional_bias(engine.model, K).mean(dim=1)
                bias_file.write_text(json.dumps(bias.tolist()))
            record = {
                "id": q["id"],
                "dense_ids": [d.chunk_id for d in dense],
                "dense_scores": [d.score for d in dense],
                "dense_gold": [has_answer(d.chunk.text, q["answers"]) for d in dense],
                "bm25_of_dense": [lexical[d.chunk_id] for d in dense],
                "lex_rank_of_dense": [lexical_rank.get(d.chunk_id) for d in dense],
                "lex_top_ids": lexical_top,
                "lex_top_gold": [has_answer(chunks[i].text, q["answers"]) for i in lexical_top],
                "attention": attention.tolist(),
                "seconds": time.time() - start,
            }
            records.write(json.dumps(record) + "\n")
            records.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
