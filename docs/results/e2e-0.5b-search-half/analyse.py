"""The tables of this folder's README from its records.

python analyse.py
"""

import json
from collections import Counter
from pathlib import Path

import torch
from scipy.stats import binomtest

from rag_mspoe.eval.data.loaders import read_jsonl

HERE = Path(__file__).parent
K = 20
RRF_K = 60


def first_gold(flags):
    return flags.index(True) + 1 if True in flags else None


def bucket(rank):
    if rank is None:
        return "missed"
    return "1" if rank == 1 else "2-5" if rank <= 5 else "6+"


def fused_gold_rank(record):
    scores = {}
    for ranking in (record["dense_ids"], record["lex_top_ids"]):
        for rank, chunk in enumerate(ranking, start=1):
            scores[chunk] = scores.get(chunk, 0.0) + 1 / (RRF_K + rank)
    gold = {c for c, g in zip(record["dense_ids"], record["dense_gold"], strict=True) if g}
    gold |= {c for c, g in zip(record["lex_top_ids"], record["lex_top_gold"], strict=True) if g}
    return first_gold([c in gold for c in sorted(scores, key=lambda c: -scores[c])[:K]])


def model_top(record, bias, layers, strength):
    attention = torch.tensor(record["attention"])[layers]
    return int((attention - strength * bias[layers]).mean(0).argmax())


def row(name, ranks):
    counts = Counter(bucket(rank) for rank in ranks)
    cells = " | ".join(str(counts[b]) for b in ("1", "2-5", "6+", "missed"))
    return f"| {name} | {cells} |"


def main():
    records = read_jsonl(HERE / "signals.jsonl.gz")
    bias = torch.tensor(json.loads((HERE / "positional-bias.json").read_text()))
    print(f"Where the gold chunk ranks, {len(records)} questions, k = {K}\n")
    print("| ranking | 1st | 2nd-5th | 6th-20th | not in the 20 |\n|---|---|---|---|---|")
    print(row("dense (MiniLM)", [first_gold(r["dense_gold"]) for r in records]))
    print(row("BM25", [first_gold(r["lex_top_gold"]) for r in records]))
    print(row("hybrid (RRF of both)", [fused_gold_rank(r) for r in records]))
    for layers, strength in ((slice(12, 18), 0.5), (slice(12, 18), 0.0), (slice(18, 24), 0.5)):
        ranks, moved = [], 0
        for r in records:
            top = model_top(r, bias, layers, strength)
            moved += top != 0
            order = [top, *(i for i in range(K) if i != top)]
            ranks.append(first_gold([r["dense_gold"][i] for i in order]))
        name = f"dense, the 0.5B's top chunk moved first (layers {layers.start}-{layers.stop - 1}, "
        print(row(f"{name}strength {strength}; moved {moved})", ranks))

    oracle = read_jsonl(HERE / "oracle.jsonl.gz")
    bounds = {r["id"]: r for r in read_jsonl(HERE / "bounds.jsonl.gz")}
    for record in oracle:
        record.update({k: v for k, v in bounds[record["id"]].items() if k not in record})
    print(f"\nExact match where the dense gold rank is 2nd-20th, {len(oracle)} questions\n")
    arms = ("retrieval", "gold_first", "model_first", "gold_repeated", "gold_last", "gold_only")
    paired_table(oracle, "retrieval", arms, "order")

    fewer = read_jsonl(HERE / "fewer-chunks.jsonl.gz")
    print(f"\nAnswering from fewer chunks, the first {len(fewer)} questions in file order\n")
    arms = ("k20", "top3", "top5", "first_and_model2")
    paired_table(fewer, "k20", arms, "chunks read")
    groups = (("gold 1st", {1}), ("gold 2nd-5th", {2, 3, 4, 5}), ("gold 6th+ or missed", None))
    for name, ranks in groups:
        subset = [
            r
            for r in fewer
            if (r["gold_rank"] in (ranks or ()) or (not ranks and r["gold_rank"] not in range(1, 6)))
        ]
        print(f"\n{name}: {len(subset)} questions\n")
        paired_table(subset, "k20", arms, "chunks read")
    seconds = {arm: sum(r[arm]["seconds"] for r in fewer) / len(fewer) for arm in arms}
    print("\nSeconds per answer:", ", ".join(f"{arm} {value:.2f}" for arm, value in seconds.items()))


def paired_table(records, baseline, arms, label):
    print(f"| {label} | exact match | vs {baseline} | gained, lost | p (exact McNemar) |")
    print("|---|---|---|---|---|")
    base = [r[baseline]["em"] for r in records]
    for name in arms:
        scores = [r[name]["em"] for r in records]
        gained = sum(s > b for s, b in zip(scores, base, strict=True))
        lost = sum(s < b for s, b in zip(scores, base, strict=True))
        p = binomtest(gained, gained + lost).pvalue if gained + lost else 1.0
        share = 100 * sum(scores) / len(scores)
        delta = share - 100 * sum(base) / len(base)
        print(f"| {name} | {share:.1f} | {delta:+.1f} | {gained}, {lost} | {p:.2g} |")


if __name__ == "__main__":
    main()
