"""For the search-half questions whose gold chunk the dense retriever ranks 2nd to 20th: the
unmodified 0.5B's answer in retrieval order, with the gold chunk moved first (the most any
method that moves one chunk first can gain), and with the shipped ranking's top chunk moved
first. Greedy, 32 new tokens, best-subspan exact match. Appends to OUT and resumes.

    python oracle_answers.py INDEX SIGNALS QUESTIONS OUT LIMIT
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

SHIPPED_LAYERS = slice(12, 18)
SHIPPED_STRENGTH = 0.5


def shipped_top(record, bias):
    attention = torch.tensor(record["attention"])[SHIPPED_LAYERS]
    return int((attention - SHIPPED_STRENGTH * bias[SHIPPED_LAYERS]).mean(0).argmax())


def main(index_dir, signals, questions_file, out, limit):
    torch.set_num_threads(1)
    index = ChunkIndex.load(index_dir)
    questions = {q["id"]: q for q in read_jsonl(questions_file)}
    bias = torch.tensor(json.loads((signals.parent / "positional-bias.json").read_text()))
    done = {json.loads(line)["id"] for line in out.open()} if out.exists() else set()
    engine = Engine.load("qwen2.5-coder-0.5b-instruct")
    count = len(done)
    with out.open("a") as records, gzip.open(signals, "rt") as lines:
        for line in lines:
            record = json.loads(line)
            flags = record["dense_gold"]
            if record["id"] in done or True not in flags or flags.index(True) == 0:
                continue
            if count >= limit:
                break
            q = questions[record["id"]]
            chunks = [index.chunk(i) for i in record["dense_ids"]]
            gold, top = flags.index(True), shipped_top(record, bias)
            orders = {
                "retrieval": list(range(len(chunks))),
                "gold_first": [gold, *(i for i in range(len(chunks)) if i != gold)],
                "model_first": [top, *(i for i in range(len(chunks)) if i != top)],
            }
            result = {"id": q["id"], "gold_rank": gold + 1, "model_top": top}
            for name, order in orders.items():
                if name == "model_first" and top in (0, gold):
                    result[name] = result["retrieval" if top == 0 else "gold_first"]
                    continue
                result[name] = answer_from(engine, q, chunks, order)
            records.write(json.dumps(result) + "\n")
            records.flush()
            count += 1


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]))
