"""For the questions of `oracle.jsonl.gz` (dense gold rank 2nd-20th): what the unmodified 0.5B
answers when an oracle does more than move the gold chunk first. Arms:

- gold_repeated: the retrieval order, then the gold chunk once more right before the question
  (a 21st document);
- gold_last: the gold chunk moved to the end, next to the question;
- gold_only: the gold chunk alone (the most any choice of context can give this model).

Greedy, 32 new tokens, best-subspan exact match, as `oracle_answers.py`. Appends to OUT and resumes.

    python oracle_bounds.py INDEX SIGNALS QUESTIONS ORACLE OUT
"""

import gzip
import json
import sys
from pathlib import Path

import torch
from chunk_answers import answer_from

from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import read_jsonl
from rag_mspoe.pipelines.index import ChunkIndex


def arms(gold, count):
    rest = [i for i in range(count) if i != gold]
    return {
        "gold_repeated": [*range(count), gold],
        "gold_last": [*rest, gold],
        "gold_only": [gold],
    }


def main(index_dir, signals, questions_file, oracle, out):
    torch.set_num_threads(1)
    index = ChunkIndex.load(index_dir)
    questions = {q["id"]: q for q in read_jsonl(questions_file)}
    with gzip.open(oracle, "rt") as lines:
        wanted = [json.loads(line)["id"] for line in lines]
    retrieved = {}
    with gzip.open(signals, "rt") as lines:
        for line in lines:
            record = json.loads(line)
            if record["id"] in wanted:
                retrieved[record["id"]] = record
    done = {json.loads(line)["id"] for line in out.open()} if out.exists() else set()
    engine = Engine.load("qwen2.5-coder-0.5b-instruct")
    with out.open("a") as records:
        for qid in wanted:
            if qid in done:
                continue
            record, q = retrieved[qid], questions[qid]
            chunks = [index.chunk(i) for i in record["dense_ids"]]
            gold = record["dense_gold"].index(True)
            result = {"id": qid, "gold_rank": gold + 1}
            for name, order in arms(gold, len(chunks)).items():
                result[name] = answer_from(engine, q, chunks, order)
            records.write(json.dumps(result) + "\n")
            records.flush()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
