"""Indexing throughput and query latency of the RAG pipeline on a generated corpus.

    python benchmarks/bench_pipeline.py                       # >= 10,000 chunks, flat index
    python benchmarks/bench_pipeline.py --documents 500 --queries 3 --kind hnsw

Writes a corpus of invented records as text files into a temporary folder, indexes it with the
default embedding model (reading, chunking, embedding, FAISS, saving), then answers questions
with the embedded model and reports the time of each query step: retrieve, pack, generate.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

SYLLABLES = [
    "ka",
    "lo",
    "ven",
    "tar",
    "mi",
    "sul",
    "dor",
    "ith",
    "gan",
    "pe",
    "rus",
    "el",
    "bra",
    "quo",
    "ny",
]
NOUNS = ["harbour", "mill", "lighthouse", "ferry", "bridge", "library", "market", "tower", "orchard", "forge"]
VERBS = ["was built", "was repaired", "was sold", "was painted", "was flooded", "was opened", "was enlarged"]


def invented_name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def write_corpus(folder: Path, documents: int, sentences: int, seed: int) -> list[tuple[str, str]]:
    """Text files of invented facts; returns (question, expected answer) pairs, one per document."""
    rng = random.Random(seed)
    questions = []
    for number in range(documents):
        place = invented_name(rng)
        lines = [f"# Records of {place}", ""]
        for _ in range(sentences):
            noun, verb = rng.choice(NOUNS), rng.choice(VERBS)
            who = f"{invented_name(rng)} {invented_name(rng)}"
            lines.append(
                f"The {noun} of {place} {verb} in {rng.randint(1500, 2020)} by {who}, "
                f"who was paid {rng.randint(2, 900)} crowns for {rng.randint(2, 60)} days."
            )
        builder = invented_name(rng)
        lines.append(f"The old {NOUNS[number % len(NOUNS)]} of {place} was designed by {builder}.")
        (folder / f"record-{number:05d}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        questions.append((f"Who designed the old {NOUNS[number % len(NOUNS)]} of {place}?", builder))
    return questions


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=1450, help="documents to generate (default 1450)")
    parser.add_argument("--sentences", type=int, default=40, help="sentences per document (default 40)")
    parser.add_argument(
        "--min-chunks", type=int, default=10_000, help="fail if the corpus makes fewer chunks"
    )
    parser.add_argument("--kind", default="flat", choices=["flat", "hnsw", "ivf"])
    parser.add_argument("--queries", type=int, default=5, help="questions answered (default 5)")
    parser.add_argument("-k", type=int, default=5, help="chunks retrieved per question (default 5)")
    parser.add_argument("--methods", default="none,mspoe", help="methods to time (default none,mspoe)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the loader's choice)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from rag_mspoe.engine import Engine
    from rag_mspoe.pipelines.answer import answer_question
    from rag_mspoe.pipelines.demo import contains_answer
    from rag_mspoe.pipelines.indexing import index_documents
    from rag_mspoe.pipelines.retrieval import Retriever

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as scratch:
        docs = Path(scratch) / "docs"
        docs.mkdir()
        questions = write_corpus(docs, args.documents, args.sentences, args.seed)

        report = index_documents(docs, Path(scratch) / "index", kind=args.kind)
        if report.total_chunks < args.min_chunks:
            raise SystemExit(f"only {report.total_chunks} chunks; raise --documents or --sentences")

        load_started = time.perf_counter()
        retriever = Retriever.load(Path(scratch) / "index")
        engine = Engine.load(threads=args.threads)
        load_seconds = time.perf_counter() - load_started

        rng = random.Random(args.seed + 1)
        asked = rng.sample(questions, args.queries)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        timings: dict[str, dict[str, list[float]]] = {
            m: {"retrieve": [], "pack": [], "generate": []} for m in methods
        }
        found = {m: 0 for m in methods}
        retrieved_gold = 0
        for question, expected in asked:
            retrieved_gold += any(expected in hit.chunk.text for hit in retriever.retrieve(question, args.k))
            for method in methods:
                answer = answer_question(
                    question, retriever, engine, k=args.k, max_new_tokens=args.max_new_tokens, method=method
                )
                for step, seconds in answer.timings.items():
                    timings[method][step].append(seconds)
                found[method] += contains_answer(answer.text, [expected])

    print()
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"model {engine.name}; index kind {args.kind}"
    )
    print(
        f"corpus: {args.documents} documents, {report.chunks_added} chunks of up to "
        f"{retriever.index.settings.chunk_size} tokens"
    )
    end_to_end = report.chunks_added / report.seconds
    embedding = report.chunks_added / report.embed_seconds
    print(
        f"indexing: {report.seconds:.1f} s in all, {end_to_end:.1f} chunks/s end to end "
        f"(read, chunk, embed, add, save); embedding alone {embedding:.1f} chunks/s"
    )
    print(f"loading the index, the embedding model and the LLM: {load_seconds:.1f} s")
    print(
        f"retrieval found the answer's chunk in the top {args.k} for {retrieved_gold}/{len(asked)} questions"
    )
    print(
        f"query latency, median of {len(asked)} questions (k={args.k}, max_new_tokens={args.max_new_tokens}):"
    )
    for method in methods:
        steps = {step: statistics.median(values) for step, values in timings[method].items()}
        total = sum(steps.values())
        retrieve_ms, pack_ms = steps["retrieve"] * 1000, steps["pack"] * 1000
        print(
            f"  {method:<10} retrieve {retrieve_ms:6.1f} ms  pack {pack_ms:6.1f} ms  "
            f"generate {steps['generate']:6.2f} s  total {total:6.2f} s  "
            f"(answer contains the fact: {found[method]}/{len(asked)})"
        )


if __name__ == "__main__":
    main()
