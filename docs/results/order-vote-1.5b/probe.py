"""Probe: answer each question under position-invariant reordering's two orders (the top-ranked
document first, and last), record each answer's token log-probabilities, and see offline whether
keeping the answer the model is surer of beats either order. Not a method of the package: a
measurement of whether one was worth building (see README.md here)."""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rag_mspoe.attention.invariant_reorder import InvariantReorder
from rag_mspoe.attention.reorder import document_texts, prompt_with_documents
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import load_qa
from rag_mspoe.eval.data.prompts import prompt_message
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.scoring.metrics import best_subspan_em


class NewlineStop(StoppingCriteria):
    def __init__(self, tokenizer, start):
        self.tokenizer, self.start = tokenizer, start

    def __call__(self, input_ids, scores, **kwargs):
        return "\n" in self.tokenizer.decode(input_ids[0, self.start :], skip_special_tokens=True)


def answer(engine, prompt, max_new_tokens):
    ids, _ = engine.document_spans_of(None, prompt)
    model, tok = engine.model, engine.tokenizer
    rows = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([NewlineStop(tok, len(ids))]),
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
        )
    new = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), -1)[token])
        for score, token in zip(out.scores, new, strict=True)
    ]
    text = tok.decode(new, skip_special_tokens=True)
    return {"text": text.split("\n")[0], "tokens": tok.convert_ids_to_tokens(new), "logprobs": logprobs}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--data", required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, threads=args.threads)
    examples = load_qa(args.data)[args.first : args.first + args.count]
    out = Path(args.out)
    done = {json.loads(line)["example_id"] for line in out.open()} if out.exists() else set()
    ranker = InvariantReorder()
    for example in examples:
        if example.id in done:
            continue
        started = time.time()
        gold = len(example.documents) // 2 - 1  # the middle; both orders are the same from any position
        prompt = prompt_message(with_gold_at(example, gold))
        texts = document_texts(prompt)
        scores = ranker.scores(engine, prompt)
        ranked = sorted(range(len(scores)), key=lambda k: (-scores[k], texts[k]))
        record = {"example_id": example.id, "scores": scores, "ranked": ranked, "gold": gold, "answers": {}}
        for name, order in (("first", ranked), ("last", ranked[::-1])):
            result = answer(engine, prompt_with_documents(prompt, order), args.max_new_tokens)
            result["match"] = best_subspan_em(result["text"], example.answers)
            record["answers"][name] = result
        record["seconds"] = round(time.time() - started, 1)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(
            example.id, record["seconds"], {k: v["match"] for k, v in record["answers"].items()}, flush=True
        )


if __name__ == "__main__":
    main()
