"""Real prompts for the engine benchmarks: NQ-open questions of the search half of the split
(never the validation half), built as the sweep builds them, on an engine of the unmodified model."""

from __future__ import annotations

import argparse
from typing import Any

from rag_mspoe import load_model
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import load_qa
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.sweep.batch_scorer import prompt_of

SEARCH_QUESTIONS = "docs/results/nq10-split/search-10.jsonl.gz"
MIDDLE = 4  # the gold's position among 10 documents: the middle, where models lose it


def add_options(parser: argparse.ArgumentParser, *, prompts: int, threads: int) -> None:
    """--model, --data, --prompts and --threads, with these defaults for the last two."""
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--data", default=SEARCH_QUESTIONS, help="QA examples with 10 documents each")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--threads", type=int, default=threads)


def engine_and_prompts(args: argparse.Namespace, gold: int = MIDDLE) -> tuple[Engine, list[Any]]:
    """The model named by `args` on an engine of the unmodified model, and `args.prompts` prompts
    with the gold document at `gold`."""
    model, tokenizer = load_model(args.model, threads=args.threads)
    return Engine(model, tokenizer, method="none"), search_prompts(args.data, args.prompts, gold)


def search_prompts(data: str, count: int, gold: int = MIDDLE) -> list[Any]:
    """The first `count` examples of `data` as chat messages, with the gold document at `gold`."""
    return [prompt_of(with_gold_at(ex, gold)) for ex in load_qa(data)[:count]]
