"""The demo: index the shipped Skerrow Isles corpus, ask questions whose answer sits in the middle
of the retrieved context, and compare the unmodified model with each rescaling method.

The corpus (`demo_corpus/`) describes invented islands, so a model can only answer from the
retrieved documents. Several documents are about the same things (lighthouses, the instrument
maker, the tides), so the chunk holding the answer is retrieved, but not first: with k=7 it
lands at position 3 to 5 of the packed context, where "lost in the middle" bites.
"""

from __future__ import annotations

import re
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from rag_mspoe.pipelines.answer import GenerationEngine, generate_answer, pack_for_engine
from rag_mspoe.pipelines.packing import PackedPrompt
from rag_mspoe.pipelines.retrieval import Retriever

DEMO_METHODS = ("none", "pi", "mspoe", "layerwise")
DEMO_TOP_K = 7
DEMO_MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class DemoQuestion:
    question: str
    answers: tuple[str, ...]  # any of these in the answer counts as correct
    gold_file: str  # the corpus file that holds the answer


DEMO_QUESTIONS = (
    DemoQuestion("Who first lit the lamp of Gull Point Light?", ("Maren Holt",), "vellin-cay.md"),
    DemoQuestion("How many people does Quillfern Instruments employ?", ("212",), "quillfern-instruments.md"),
    DemoQuestion("What is the period of the oscillation in Tarrow Sound?", ("19 hours",), "marrow-kade.md"),
    DemoQuestion("When was the Ennick Light first lit?", ("1859",), "oskerholm.md"),
)


@dataclass
class MethodAnswer:
    method: str
    text: str
    correct: bool
    seconds: float


@dataclass
class DemoResult:
    question: DemoQuestion
    packed: PackedPrompt
    gold_positions: list[int]  # 1-based positions in the prompt of chunks from the gold file
    answers: list[MethodAnswer] = field(default_factory=list)


def demo_corpus_dir() -> Path:
    return Path(str(resources.files("rag_mspoe.pipelines") / "demo_corpus"))


def contains_answer(prediction: str, answers: Sequence[str]) -> bool:
    """Whether a normalised gold answer occurs in the prediction's first line, as the
    lost-in-the-middle QA metric scores it (lowercase, no punctuation or articles)."""
    first_line = prediction.strip().split("\n", 1)[0]
    return any(_normalise(gold) in _normalise(first_line) for gold in answers)


def run_demo(
    retriever: Retriever,
    engine: GenerationEngine,
    *,
    questions: Sequence[DemoQuestion] = DEMO_QUESTIONS,
    methods: Sequence[str] = DEMO_METHODS,
    k: int = DEMO_TOP_K,
    max_new_tokens: int = DEMO_MAX_NEW_TOKENS,
    on_result: Callable[[DemoResult], object] | None = None,
) -> list[DemoResult]:
    """Pack each question once (retrieval order, benchmark prompt format) and answer it with every
    method, greedily. `on_result` sees each question's result as soon as it is complete."""
    results = []
    for item in questions:
        packed = pack_for_engine(
            item.question,
            retriever.retrieve(item.question, k),
            engine,
            max_new_tokens=max_new_tokens,
            cite=False,
        )
        gold = [
            number
            for number, doc in enumerate(packed.documents, start=1)
            if Path(doc.chunk.source).name == item.gold_file
        ]
        result = DemoResult(question=item, packed=packed, gold_positions=gold)
        for method in methods:
            started = time.perf_counter()
            answer = generate_answer(
                packed, item.question, engine, max_new_tokens=max_new_tokens, method=method
            )
            result.answers.append(
                MethodAnswer(
                    method,
                    answer.text,
                    contains_answer(answer.text, item.answers),
                    time.perf_counter() - started,
                )
            )
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results


def _normalise(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())
