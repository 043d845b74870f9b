"""The shipped reordering with a margin, replayed from a sweep's records: no model runs.

A sweep of `none` and the shipped `calibrated` (a calibrated reordering) records for every prompt
the unmodified answer, the reordered answer and the ranking attention the reordering ranked by
(every layer). A variant that only decides whether to reorder answers as `none` did where it keeps
the given order (the same prompt, read as given) and as `calibrated` did where it reorders (the
same order), so it can be scored from those records:

- `first`: reorder only when the top-ranked document's relevance leads the first document's by at
  least the margin (the retriever's first document kept unless clearly outranked);
- `runner-up`: reorder only when it leads the runner-up's (the config's `min_margin`).

Relevance is the config's calibrated attention share (the positional-bias estimate cached for the
model). A prompt whose recomputed order differs from the one the sweep recorded is counted and
left out.

    python benchmarks/replay_first_margin.py docs/results/search4-0.5b --margins 0 0.02 0.05 0.1
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rag_mspoe.attention.bias import PositionalBias, bias_cache_path
from rag_mspoe.attention.reorder import CalibratedReorder, relevance_shares
from rag_mspoe.eval.scoring.metrics import paired_test
from rag_mspoe.methods.method_config import MethodConfig


def read_records(folder: Path) -> list[dict[str, Any]]:
    path = folder / "results.jsonl"
    opened = open(path) if path.exists() else gzip.open(folder / "results.jsonl.gz", "rt")  # noqa: SIM115
    with opened as handle:
        return [json.loads(line) for line in handle]


def prompts(folder: Path) -> tuple[list[int], list[dict[str, Any]]]:
    """The gold positions, and per (question, position) the two answers and the relevance of each
    document (the shipped config's, recomputed from the recorded attention)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    config = MethodConfig.from_dict(manifest["methods"]["calibrated"]["method"])
    if not isinstance(config, CalibratedReorder):
        raise SystemExit(f"{folder}: 'calibrated' ran {config!r}, not a calibrated reordering.")
    model = manifest["model"]
    documents = int(manifest["sweep"]["num_documents"])
    layers, heads = int(model["num_layers"]), int(model["num_heads"])
    bias = None
    if config.strength:
        table = PositionalBias.load(bias_cache_path(model["name"])).table(documents, layers, heads)
        if table is None:
            raise SystemExit(f"No positional-bias estimate for {documents} documents in this cache.")
        bias = table.mean(dim=1)
    by_key: dict[tuple[str, int], dict[str, Any]] = defaultdict(dict)
    for record in read_records(folder):
        by_key[str(record["example_id"]), int(record["position"])][record["method"]] = record
    paired = []
    for (question, position), pair in sorted(by_key.items()):
        if not {"none", "calibrated"} <= set(pair):
            continue
        shipped = pair["calibrated"]
        attention = torch.tensor(shipped["ranking_attention"], dtype=torch.float32)
        relevance = relevance_shares(attention, bias, config.ranking_layers(layers), config.strength).tolist()
        paired.append(
            {
                "question": question,
                "position": position,
                "none": float(pair["none"]["match"]),
                "calibrated": float(shipped["match"]),
                "relevance": relevance,
                "agrees": config.order(relevance) == list(shipped["documents_read"]),
            }
        )
    return sorted({p["position"] for p in paired}), paired


def reorders(prompt: dict[str, Any], rule: str, margin: float) -> bool:
    relevance = prompt["relevance"]
    ranked = sorted(range(len(relevance)), key=lambda k: (-relevance[k], k))
    if ranked[0] == 0:
        return False  # the top-ranked document is already first: the order stays
    other = 0 if rule == "first" else ranked[1]
    return relevance[ranked[0]] - relevance[other] >= margin


def replay(positions: list[int], paired: list[dict[str, Any]], rule: str, margin: float) -> dict[str, Any]:
    usable = [p for p in paired if p["agrees"]]
    questions = sorted(
        {p["question"] for p in usable}
        & set.intersection(*({p["question"] for p in usable if p["position"] == pos} for pos in positions))
    )
    rows: dict[int, dict[str, list[float]]] = {
        pos: {"none": [], "variant": [], "moved": []} for pos in positions
    }
    for prompt in usable:
        if prompt["question"] not in questions:
            continue
        moved = reorders(prompt, rule, margin)
        row = rows[prompt["position"]]
        row["none"].append(prompt["none"])
        row["variant"].append(prompt["calibrated"] if moved else prompt["none"])
        row["moved"].append(float(moved))
    mean = lambda xs: 100 * sum(xs) / len(xs)  # noqa: E731
    worst = min(positions, key=lambda pos: mean(rows[pos]["none"]))
    every = lambda key: [x for pos in positions for x in rows[pos][key]]  # noqa: E731
    return {
        "rule": rule,
        "margin": margin,
        "questions": len(questions),
        "left_out_disagreeing": sum(1 for p in paired if not p["agrees"]),
        "none": {pos: round(mean(rows[pos]["none"]), 1) for pos in positions},
        "variant": {pos: round(mean(rows[pos]["variant"]), 1) for pos in positions},
        "moved_percent": {pos: round(mean(rows[pos]["moved"]), 1) for pos in positions},
        "worst_position": worst,
        "worst_gain": round(mean(rows[worst]["variant"]) - mean(rows[worst]["none"]), 1),
        "worst_p": round(paired_test(rows[worst]["variant"], rows[worst]["none"]), 4),
        "average_gain": round(mean(every("variant")) - mean(every("none")), 1),
        "average_p": round(paired_test(every("variant"), every("none")), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="sweep folders with none and calibrated")
    parser.add_argument("--margins", nargs="+", type=float, default=[0.0, 0.02, 0.05, 0.1])
    parser.add_argument("--rules", nargs="+", choices=("first", "runner-up"), default=["first", "runner-up"])
    args = parser.parse_args()
    for folder in args.runs:
        positions, paired = prompts(folder)
        for rule in args.rules:
            for margin in args.margins:
                print(json.dumps({"run": str(folder), **replay(positions, paired, rule, margin)}))


if __name__ == "__main__":
    main()
