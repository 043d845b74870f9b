"""Perplexity against context length on a long text, per method: the extrapolation check of the
layer-specific scaling paper (PI and Dynamic-NTK, with and without layer-specific factors).

    config = PerplexityConfig(text="book.txt", lengths=(2048, 4096, 8192),
                              methods=("none", "pi:2", "dynamic-ntk:2", "layerwise+pi:2"))
    run_perplexity(config, "runs/ppl")

The text is tokenized once; window w of length L is tokens [w*L, (w+1)*L). Each window is one
forward (no striding), so every token of it is predicted from all tokens before it in the
window. Results stream to results.jsonl, one record per (method, length, window), and a
resumed run skips what is there; summary.json, table.md and perplexity_by_length.png follow.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_mspoe.eval.method_engines import EngineSet, require_given_order
from rag_mspoe.eval.report import line_plot
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import Key, read_records
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve_all
from rag_mspoe.models.command_options import model_load_options
from rag_mspoe.models.loading import source_name

KEY_FIELDS = ("method", "length", "window")
PLOT_FILE = "perplexity_by_length.png"
_LOSS_CHUNK = 1024  # logits rows turned to float at once, to bound memory on long windows


@dataclass(frozen=True)
class PerplexityConfig:
    text: str
    lengths: tuple[int, ...]
    methods: tuple[str, ...] = ("none", "pi:2", "dynamic-ntk:2", "layerwise+pi:2", "layerwise+dynamic-ntk:2")
    windows: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(sorted(set(self.lengths))))
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError("lengths must be at least 2 tokens each.")
        if self.windows < 1:
            raise ValueError(f"windows must be at least 1, got {self.windows}.")


def text_tokens(tokenizer: Any, path: str, needed: int) -> list[int]:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < needed:
        raise ValueError(
            f"{path} has {len(ids)} tokens; {needed} are needed (windows x longest length). "
            "Use a longer text, fewer --windows or shorter --lengths."
        )
    return ids


def window_nll(model: Any, ids: Sequence[int], method: Any) -> tuple[float, int]:
    """(sum of negative log-likelihoods, tokens predicted) of one window under `method`."""
    import torch

    from rag_mspoe import rescaled

    with rescaled(model, method), torch.inference_mode():
        inputs = torch.tensor([list(ids)], device=model.device)
        logits = model(inputs).logits[0]
        targets = inputs[0, 1:]
        total = 0.0
        for start in range(0, len(ids) - 1, _LOSS_CHUNK):
            rows = logits[start : start + _LOSS_CHUNK][: len(targets) - start].float()
            picked = torch.log_softmax(rows, dim=-1).gather(1, targets[start : start + len(rows), None])
            total -= float(picked.sum())
    return total, len(ids) - 1


@dataclass
class Perplexity(Evaluation):
    """Units: (method, length, window); lengths and windows may change on resume, since a
    window's tokens depend only on the text (which must stay the same)."""

    kind = "perplexity"
    command_help = "perplexity against context length on a long text file, per method"
    pairing = Pairing("length", ("window",), ("perplexity",))
    key_fields = KEY_FIELDS
    unit_name = "window"
    identity_fields = ("text", "model")
    config: PerplexityConfig
    methods: Sequence[ResolvedMethod]

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        return str(write_perplexity_report(folder)["markdown"])

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("text", help="a long plain-text file")
        parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
        parser.add_argument(
            "--lengths",
            nargs="+",
            type=int,
            required=True,
            help="context lengths in tokens, e.g. 2048 4096 8192",
        )
        parser.add_argument(
            "--methods",
            nargs="+",
            default=["none", "pi:2", "dynamic-ntk:2", "layerwise+pi:2", "layerwise+dynamic-ntk:2"],
            help="method specs as for sweep",
        )
        parser.add_argument("--windows", type=int, default=1, help="text windows scored per length")

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
        config = PerplexityConfig(
            text=str(Path(args.text).resolve()),
            lengths=tuple(args.lengths),
            methods=tuple(args.methods),
            windows=args.windows,
            model=args.model,
        )
        summary = run_perplexity(config, args.out, **model_load_options(args), progress=not args.no_progress)
        print(summary["markdown"])
        return 0

    def inputs(self) -> Sequence[str]:
        return (self.config.text,)

    def plan(self, folder: Path, done: set[Key]) -> list[tuple[ResolvedMethod, int, int]]:
        return [
            (method, length, window)
            for length in self.config.lengths
            for window in range(self.config.windows)
            for method in self.methods
            if (method.name, length, window) not in done
        ]

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        models = EngineSet(model, tokenizer)
        ids = text_tokens(tokenizer, self.config.text, self.config.windows * max(self.config.lengths))

        def score(unit: tuple[ResolvedMethod, int, int]) -> list[dict[str, Any]]:
            method, length, window = unit
            nll, tokens = window_nll(
                models.model_for(method), ids[window * length : (window + 1) * length], method.method
            )
            record = {"method": method.name, "length": length, "window": window, "nll": nll, "tokens": tokens}
            return [{**record, "perplexity": math.exp(nll / tokens)}]

        return score


def run_perplexity(config: PerplexityConfig, folder: str | Path, **options: Any) -> dict[str, Any]:
    """Score every pending (method, length, window) into `folder`; returns the summary.

    options: those of `run_evaluation` (model, tokenizer, threads, device, dtype, progress)."""
    methods = resolve_all(config.methods, source_name(config.model))
    require_given_order(methods, "for perplexity")
    outcome = run_evaluation(Perplexity(config, methods), folder, **options)
    return write_perplexity_report(outcome.folder, [m.name for m in methods])


def write_perplexity_report(folder: Path, method_order: Sequence[str] = ()) -> dict[str, Any]:
    """summary.json, table.md (methods x lengths) and perplexity_by_length.png from results.jsonl."""
    records = read_records(folder / "results.jsonl")
    totals: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for record in records:
        entry = totals[(record["method"], int(record["length"]))]
        entry[0] += record["nll"]
        entry[1] += record["tokens"]
    methods = [
        m for m in dict.fromkeys([*method_order, *(m for m, _ in totals)]) if any(k[0] == m for k in totals)
    ]
    lengths = sorted({length for _, length in totals})
    table = {
        method: {
            length: math.exp(nll / tokens) for (m, length), (nll, tokens) in totals.items() if m == method
        }
        for method in methods
    }
    header = ["method", *(str(length) for length in lengths)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        cells = [f"{table[method][length]:.2f}" if length in table[method] else "-" for length in lengths]
        lines.append("| " + " | ".join([method, *cells]) + " |")
    markdown = "\n".join(lines) + "\n\nPerplexity (lower is better) by context length in tokens.\n"
    summary = {"lengths": lengths, "perplexity": table, "markdown": markdown}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / "table.md").write_text(markdown)
    if table:
        line_plot(
            table,
            folder / PLOT_FILE,
            xlabel="context length (tokens)",
            ylabel="perplexity (log scale)",
            log_y=True,
        )
    return summary
