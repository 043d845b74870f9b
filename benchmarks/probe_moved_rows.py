"""Can a calibrated reordering that moves a document answer from the rows its ranking pass read?

    python benchmarks/probe_moved_rows.py --first 200 --count 40 --out probe.jsonl
    python benchmarks/probe_moved_rows.py --summary probe.jsonl [more.jsonl ...]

The shipped method ranks the documents, moves the top-ranked one first, and reads the whole new
prompt again (1.5-1.6x the unmodified answer). This probe asks whether the second read can be
skipped. For each question (10 real NQ-open documents, the gold at `--slot`), greedy answers of
up to 64 tokens from:

- `none`: the unmodified model on the prompt as given;
- `exact`: the shipped method (documents renumbered 1, 2, ... in their new order, read whole);
- `kept_numbers`: the same order read whole with each document's old number kept (the prompt the
  two variants below approximate, token for token);
- `reuse`: no second read: the rows the unmodified model read the prompt with, moved to the new
  order, each key rotated by its token's change of position (RoPE rotates a key by its position,
  so a moved key is exactly the key of its content at the new place; what the rows saw before
  them is the old order's);
- `fresh_first`: as `reuse`, but the moved document read again right after the template, as the
  whole read reads it (about a tenth of the prompt).

Every answer is scored by best-subspan exact match. Records: one JSON line per question; the
variants are answered only where the method moves a document (elsewhere every variant is `none`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench_cpu_inference import DATA

VARIANTS = ("none", "exact", "kept_numbers", "reuse", "fresh_first")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--data", default=str(DATA), help="10-document QA records (the search half)")
    parser.add_argument("--first", type=int, default=200, help="the first question's index in the file")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--slot", type=int, default=4, help="the gold document's index (4: fifth of 10)")
    parser.add_argument("--out", type=Path, help="records are appended here")
    parser.add_argument("--summary", type=Path, nargs="+", help="summarise these records instead")
    args = parser.parse_args()
    if args.summary:
        print(json.dumps(summary([json.loads(line) for path in args.summary for line in path.open()])))
        return
    if args.out is None:
        parser.error("--out is needed to record answers")
    probe(args)


def probe(args: argparse.Namespace) -> None:
    import torch

    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.eval.scoring.metrics import best_subspan_em

    torch.set_num_threads(1)
    engine = Engine.load(args.model, threads=1)
    method: Any = engine.method_config("calibrated")
    with args.out.open("a") as records:
        for example in load_qa(args.data)[args.first : args.first + args.count]:
            started = time.perf_counter()
            engine.document_prefixes.clear()
            prompt = qa_prompt(with_gold_at(example, args.slot))
            ids, spans = engine.document_spans_of(method, prompt)
            attention = method.ranking_attention(engine, prompt)
            order = method.order(method.relevance(engine.model, attention))
            record: dict[str, Any] = {"id": example.id, "slot": args.slot, "order": order}
            record["moved"] = order != list(range(len(spans)))
            record["none"] = _greedy(engine, ids)
            if record["moved"]:
                exact_ids, _ = engine.document_spans_of(method, method.reordered(engine, prompt, attention))
                record["exact"] = _greedy(engine, exact_ids)
                moved_ids, cache = moved_rows(engine, ids, spans, order, fresh_first=False)
                record["kept_numbers"] = _greedy(engine, moved_ids)
                record["reuse"] = _greedy(engine, moved_ids, cache)
                fresh = moved_rows(engine, ids, spans, order, fresh_first=True)
                record["fresh_first"] = _greedy(engine, *fresh)
            else:
                record.update({name: record["none"] for name in VARIANTS[1:]})
            for name in VARIANTS:
                record[f"em_{name}"] = best_subspan_em(record[name], example.answers)
            record["seconds"] = round(time.perf_counter() - started, 1)
            records.write(json.dumps(record) + "\n")
            records.flush()
            print(example.id, record["moved"], [record[f"em_{name}"] for name in VARIANTS], file=sys.stderr)


def moved_rows(
    engine: Any, ids: list[int], spans: list[tuple[int, int]], order: list[int], *, fresh_first: bool
) -> tuple[list[int], Any]:
    """The token ids of the prompt with its documents in `order` (numbers kept, separators in their
    slots) and a cache through its last document made from the unmodified model's rows of `ids`
    (module docstring); fresh_first: the first document's rows read again after the template."""
    import torch
    from transformers.cache_utils import DynamicCache

    model = engine.model
    end = spans[-1][1]
    cache = engine.document_prefixes.copy_of(ids[:end])
    source = list(range(spans[0][0]))  # for each new place, the old place of its token
    for slot, document in enumerate(order):
        source += range(*spans[document])
        separator_end = spans[slot + 1][0] if slot + 1 < len(spans) else end
        source += range(spans[slot][1], separator_end)
    index = torch.tensor(source)
    shift = (torch.arange(end) - index).float()
    # A pure rotation by each token's shift (no attention scaling: the cached keys carry theirs).
    angles = shift[:, None] * model.model.rotary_emb.inv_freq.float()[None, :]
    table = torch.cat((angles, angles), -1)
    cos, sin = table.cos(), table.sin()
    rotate_half = importlib.import_module(type(model).__module__).rotate_half  # the model's own
    rows = []
    for layer in cache.layers:
        keys = layer.keys[:, :, index].float()
        rotated = keys * cos + rotate_half(keys) * sin
        rows.append((rotated.to(layer.keys.dtype), layer.values[:, :, index].clone()))
    moved_ids = [ids[k] for k in source] + list(ids[end:])
    if fresh_first:
        start = spans[0][0]
        stop = start + spans[order[0]][1] - spans[order[0]][0]
        head = DynamicCache(
            ddp_cache_data=[(k[:, :, :start].clone(), v[:, :, :start].clone()) for k, v in rows],
            config=model.config,
        )
        with torch.inference_mode():
            first = torch.tensor([moved_ids[start:stop]])
            model(first, past_key_values=head, use_cache=True, logits_to_keep=1)
        rows = [
            (torch.cat([layer.keys, k[:, :, stop:]], dim=2), torch.cat([layer.values, v[:, :, stop:]], dim=2))
            for layer, (k, v) in zip(head.layers, rows, strict=True)
        ]
    return moved_ids, DynamicCache(ddp_cache_data=rows, config=model.config)


def _greedy(engine: Any, ids: list[int], cache: Any = None) -> str:
    """Greedy answer of up to 64 tokens to `ids` (from `cache` where given: its rows are not read again)."""
    import torch

    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=torch.tensor([ids]), past_key_values=cache, max_new_tokens=64, do_sample=False
        )
    return str(engine.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact match of each variant over every question and over those the method moved, and each
    variant against the shipped one, question by question (McNemar's exact test)."""
    from rag_mspoe.eval.scoring.metrics import paired_test

    moved = [r for r in records if r["moved"]]
    result: dict[str, Any] = {"questions": len(records), "moved": len(moved)}
    for name in VARIANTS:
        result[name] = {
            "exact_match": round(sum(r[f"em_{name}"] for r in records) / len(records), 3),
            "right_where_moved": int(sum(r[f"em_{name}"] for r in moved)),
        }
        if name != "exact":
            ours, shipped = [r[f"em_{name}"] for r in moved], [r["em_exact"] for r in moved]
            result[name]["right_only_here_or_in_exact"] = [
                sum(a > b for a, b in zip(ours, shipped, strict=True)),
                sum(a < b for a, b in zip(ours, shipped, strict=True)),
            ]
            result[name]["p_vs_exact"] = round(paired_test(ours, shipped), 3)
            result[name]["same_text_as_exact"] = sum(r[name] == r["exact"] for r in moved)
            result[name]["same_text_as_none"] = sum(r[name] == r["none"] for r in moved)
    return result


if __name__ == "__main__":
    main()
