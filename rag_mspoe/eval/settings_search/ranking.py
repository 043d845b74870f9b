"""Which layers and which bias strength rank a model's documents best, for calibrated reordering.

Calibrated reordering moves the document its ranking puts first; when that is the gold document
its answer is the unmodified model's with the gold first. So the ranking's top-1 accuracy is what
its settings decide, and it needs no answers: one pass per prompt records each layer's attention
from the question rows on each document (averaged over heads), and every layer band and bias
strength is scored from those records at once. A study of 40 questions at 3 gold positions costs
120 prompt forwards, where a `calibrate search` over the same grid would score answers for each
candidate. The records (`attention.jsonl`) are appended as they come: rerun to go on; a rerun
with another model or other questions under the same ids is refused (`inputs.json`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rag_mspoe.files import atomic_write, check_output_folder

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike

RECORDS_FILE = "attention.jsonl"
INPUTS_FILE = "inputs.json"  # the model and a fingerprint of each example the records came from
SIGNIFICANCE = 0.05


@dataclass(frozen=True)
class RankingSetting:
    """A ranking: layers [first, stop) and the factor on the positional bias subtracted."""

    first: int
    stop: int
    strength: float

    @property
    def label(self) -> str:
        return f"layers {self.first}-{self.stop - 1}, strength {self.strength:g}"

    def config(self) -> Any:
        from rag_mspoe.attention.reorder import CalibratedReorder

        return CalibratedReorder(layers=list(range(self.first, self.stop)), strength=self.strength)


def layer_bands(layers: int, blocks: int) -> list[tuple[int, int]]:
    """Every run of whole blocks of layers (the layers cut into `blocks` nearly equal blocks)."""
    edges = sorted({round(layers * k / blocks) for k in range(blocks + 1)})
    return [(a, b) for i, a in enumerate(edges) for b in edges[i + 1 :]]


def record_attention(
    engine: EngineLike,
    examples: Sequence[Any],
    positions: Sequence[int],
    folder: Path,
    *,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Each (example, gold position)'s ranking attention (`CalibratedReorder.ranking_attention`),
    read from `folder` or computed and appended."""
    from rag_mspoe.attention.reorder import CalibratedReorder
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.eval.runs.results import ResultsFile, read_records
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of

    refuse_other_inputs(folder, engine.name, examples)
    results = ResultsFile(folder / RECORDS_FILE, ("example_id", "position"))
    for example in examples:
        for position in positions:
            if (example.id, position) in results.done:
                continue
            mass = CalibratedReorder().ranking_attention(engine, prompt_of(with_gold_at(example, position)))
            if mass is None:
                raise ValueError(f"Example {example.id} has fewer than two documents: nothing to rank.")
            results.append([{"example_id": example.id, "position": position, "attention": mass.tolist()}])
            if progress:
                print(f"{len(results.done)} prompts recorded", flush=True)
    wanted = {(example.id, position) for example in examples for position in positions}
    return [r for r in read_records(results.path) if (r["example_id"], r["position"]) in wanted]


def refuse_other_inputs(folder: Path, model_name: str, examples: Sequence[Any]) -> None:
    """Refuse to add records to a folder whose records came from another model or from other
    questions under the same ids (another data file, document count or build): the attention of
    the two would be scored as one study. Records what it checked in INPUTS_FILE."""
    path = folder / INPUTS_FILE
    fingerprints = {str(example.id): _fingerprint(example) for example in examples}
    recorded: dict[str, Any] = {"model": model_name, "examples": {}}
    if path.is_file():
        recorded = json.loads(path.read_text())
    if recorded["model"] != model_name:
        raise ValueError(
            f"{folder} holds the attention of {recorded['model']!r}, not of {model_name!r}; "
            "write this study into a new folder (--out)."
        )
    changed = sorted(i for i, digest in fingerprints.items() if recorded["examples"].get(i, digest) != digest)
    if changed:
        raise ValueError(
            f"{folder} recorded other prompts under the ids {changed[:5]} ({len(changed)} in all): its "
            "records came from another data file, number of documents or build of the data. Rerun with "
            "the data the study started with, or write into a new folder (--out)."
        )
    recorded["examples"].update(fingerprints)
    atomic_write(path, (json.dumps(recorded, sort_keys=True) + "\n").encode())


def _fingerprint(example: Any) -> str:
    """The sha256 of what an example's prompts are made of."""
    text = json.dumps(dataclasses.asdict(example), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def accuracy_table(
    records: Sequence[dict[str, Any]],
    bias: torch.Tensor,
    settings: Sequence[RankingSetting],
    default: RankingSetting,
) -> list[dict[str, Any]]:
    """For each setting: the share of prompts whose gold document it ranks first, overall and per
    gold position, and the paired test against `default` on the same prompts (exact McNemar), best
    first. bias: [layers, documents], head-averaged."""
    from rag_mspoe.attention.reorder import relevance_shares
    from rag_mspoe.eval.scoring.metrics import paired_test

    positions = sorted({r["position"] for r in records})
    masses = torch.tensor([r["attention"] for r in records])  # [prompts, layers, documents]
    golds = torch.tensor([r["position"] for r in records])

    def hits_of(setting: RankingSetting) -> torch.Tensor:
        band = range(setting.first, setting.stop)
        relevance = relevance_shares(masses, bias, band, setting.strength)
        return (relevance.argmax(dim=-1) == golds).float()

    baseline = hits_of(default).tolist()
    rows = []
    for setting in settings:
        hits = hits_of(setting)
        rows.append(
            {
                "setting": setting,
                "accuracy": hits.mean().item(),
                "by_position": {p: hits[golds == p].mean().item() for p in positions},
                "p_vs_default": paired_test(hits.tolist(), baseline),
            }
        )
    return sorted(rows, key=lambda row: -row["accuracy"])


def write_study(folder: Path, rows: list[dict[str, Any]], default: RankingSetting, prompts: int) -> str:
    """ranking.md (the table) and ranking.json; returns the table."""
    positions = list(rows[0]["by_position"])
    lines = [
        f"Gold document ranked first, share of {prompts} prompts (calibrated reordering's ranking; "
        f"the default is {default.label}).",
        "",
        "| layers | strength | all | "
        + " | ".join(f"gold at {p}" for p in positions)
        + " | p against the default |",
        "|---|---|---|" + "---|" * (len(positions) + 1),
    ]
    for row in rows:
        s = row["setting"]
        mark = " (default)" if s == default else ""
        cells = " | ".join(f"{row['by_position'][p]:.3f}" for p in positions)
        lines.append(
            f"| {s.first}-{s.stop - 1}{mark} | {s.strength:g} | {row['accuracy']:.3f} | {cells} "
            f"| {row['p_vs_default']:.3g} |"
        )
    table = "\n".join(lines) + "\n"
    atomic_write(folder / "ranking.md", table.encode())
    data = [
        {
            "layers": [row["setting"].first, row["setting"].stop],
            "strength": row["setting"].strength,
            "accuracy": row["accuracy"],
            "by_position": row["by_position"],
            "p_vs_default": row["p_vs_default"],
        }
        for row in rows
    ]
    atomic_write(folder / "ranking.json", (json.dumps(data, indent=1) + "\n").encode())
    return table


def study(
    engine: EngineLike,
    examples: Sequence[Any],
    positions: Sequence[int],
    folder: Path,
    *,
    blocks: int = 8,
    strengths: Sequence[float] = (0.0, 0.5, 1.0, 1.5, 2.0),
    progress: bool = True,
) -> tuple[str, RankingSetting | None]:
    """Record the prompts' attention, score every band of `blocks` and strength, write the table;
    returns it and the best setting when it ranks the gold first more often than the default, by a
    paired difference with p < 0.05 (its config is then saved in `folder` as rag_mspoe_method.json)."""
    from rag_mspoe.attention.reorder import CalibratedReorder, positional_bias
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of

    check_output_folder(folder, INPUTS_FILE)
    folder.mkdir(parents=True, exist_ok=True)
    model = engine.model
    layers = int(model.config.num_hidden_layers)
    documents = len(examples[0].documents)
    # The reference bias, estimated once per model and number of documents, as the method does.
    method = CalibratedReorder()
    _, spans = engine.document_spans_of(method, prompt_of(with_gold_at(examples[0], positions[0])))
    method.prepare(model, engine.tokenizer, [spans])
    records = record_attention(engine, examples, positions, folder, progress=progress)
    bias = positional_bias(model, documents).mean(dim=1)
    default = RankingSetting(layers // 2, layers, 1.0)
    settings = {RankingSetting(a, b, s) for a, b in layer_bands(layers, blocks) for s in strengths}
    ordered = sorted(settings | {default}, key=lambda s: (s.first, s.stop, s.strength))
    rows = accuracy_table(records, bias, ordered, default)
    table = write_study(folder, rows, default, len(records))
    best = rows[0]
    default_accuracy = next(row["accuracy"] for row in rows if row["setting"] == default)
    # The best of many settings on few prompts beats the default by chance alone: only a paired
    # difference that chance rarely gives makes a config.
    if best["accuracy"] <= default_accuracy or best["p_vs_default"] >= SIGNIFICANCE:
        return table, None
    best["setting"].config().save(folder, base_model=engine.name)
    return table, best["setting"]
