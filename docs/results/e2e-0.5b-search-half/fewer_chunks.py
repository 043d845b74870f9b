"""The unmodified 0.5B answering from fewer of the 20 retrieved chunks, for the first LIMIT
search-half questions in file order (every retrieval rank): the retriever's top 3 and top 5,
and the retriever's first chunk with the two others the 0.5B's ranking puts highest (layers
18-23, no bias correction), each in retrieval order; the 20 in retrieval order as the baseline.
Greedy, 32 new tokens, best-subspan exact match, as `oracle_answers.py`. Appends and resumes;
FIRST (default 0) lets two processes share the questions.

    python fewer_chunks.py INDEX SIGNALS QUESTIONS OUT LIMIT [FIRST]
"""

import gzip
import json
import sys
import time
from pathlib import Path

import torch
from chunk_answers import answer_from

from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import read_jsonl
from rag_mspoe.pipelines.index import ChunkIndex

MODEL_LAYERS = slice(18, 24)


def arms(record):
    relevance = torch.tensor(record["attention"])[MODEL_LAYERS].mean(0)
    others = [i for i in torch.argsort(-relevance).tolist() if i != 0][:2]
    return {
        "k20": list(range(20)),
        "top3": [0, 1, 2],
        "top5": [0, 1, 2, 3, 4],
        "first_and_model2": sorted([0, *others]),
    }


def main(index_dir, signals, questions_file, out, limit, first=0):
    torch.set_num_threads(1)
    index = ChunkIndex.load(index_dir)
    questions = {q["id"]: q for q in read_jsonl(questions_file)}
    done = {json.loads(line)["id"] for line in out.open()} if out.exists() else set()
    engine = Engine.load("qwen2.5-coder-0.5b-instruct")
    engine.prompt_lookup_tokens = 0  # plain greedy decoding, as the other records of this folder
    with out.open("a") as records, gzip.open(signals, "rt") as lines:
        for number, line in enumerate(lines):
            if number >= limit:
                break
            if number < first:
                continue
            record = json.loads(line)
            if record["id"] in done:
                continue
            q = questions[record["id"]]
            chunks = [index.chunk(i) for i in record["dense_ids"]]
            flags = record["dense_gold"]
            result = {"id": q["id"], "gold_rank": flags.index(True) + 1 if True in flags else None}
            for name, order in arms(record).items():
                start = time.perf_counter()
                answered = answer_from(engine, q, chunks, order)
                seconds = round(time.perf_counter() - start, 2)
                result[name] = {"chunks": order, **answered, "seconds": seconds}
            records.write(json.dumps(result) + "\n")
            records.flush()


if __name__ == "__main__":
    first = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]), first)
