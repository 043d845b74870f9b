"""Probe: how often each zero-shot score of a document read alone ranks the gold document first.

- question_likelihood: the question's log-likelihood given the document (`invariant-reorder`'s
  default score);
- judge: log p(yes) - log p(no) for the reply to a short prompt of the document's title and
  text, the question and "Does the document answer the question? Answer yes or no.";
- judge_in_prompt: the same judgement asked after the sweep's own prompt holding only that
  document ("Does Document [1] answer the question? ..."), as a method that sees any prompt can ask it.

Each record also keeps the gold document's index. `python analyze.py` compares the rankings.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch

from rag_mspoe.attention.invariant_reorder import InvariantReorder
from rag_mspoe.attention.reorder import document_texts, prompt_with_documents
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import load_qa
from rag_mspoe.eval.data.prompts import prompt_message
from rag_mspoe.eval.data.records import gold_index

YES, NO = ("Yes", "yes"), ("No", "no")


def yes_over_no(engine, prompt):
    totals = [total for total, _ in engine.score_continuations(prompt, [*YES, *NO], method=None)]
    return pooled(totals[: len(YES)]) - pooled(totals[len(YES) :])


def pooled(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def judged_alone(engine, document, question):
    content = (
        f"Document (Title: {document.title}) {document.text}\n\nQuestion: {question}\n"
        "Does the document answer the question? Answer yes or no."
    )
    return yes_over_no(engine, [{"role": "user", "content": content}])


def judged_in_prompt(engine, prompt, k):
    (single,) = prompt_with_documents(prompt, [k])
    question = "\n\nDoes Document [1] answer the question? Answer yes or no."
    return yes_over_no(engine, [{**single, "content": single["content"] + question}])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--data", required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, threads=args.threads)
    out = Path(args.out)
    done = {json.loads(line)["example_id"] for line in out.open()} if out.exists() else set()
    for example in load_qa(args.data)[args.first : args.first + args.count]:
        if example.id in done:
            continue
        started = time.time()
        prompt = prompt_message(example)
        record = {
            "example_id": example.id,
            "gold": gold_index(example),
            "question_likelihood": InvariantReorder().scores(engine, prompt),
            "judge": [judged_alone(engine, document, example.question) for document in example.documents],
            "judge_in_prompt": [
                judged_in_prompt(engine, prompt, k) for k in range(len(document_texts(prompt)))
            ],
        }
        record["seconds"] = round(time.time() - started, 1)
        with out.open("a") as lines:
            lines.write(json.dumps(record) + "\n")
        print(example.id, record["seconds"], flush=True)


if __name__ == "__main__":
    main()
