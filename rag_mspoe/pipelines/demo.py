"""The demo: index the shipped Skerrow Isles corpus, ask questions whose answer sits in the middle
of the retrieved context, and compare the unmodified model with the method shipped for it; then
the position curves of the evaluation (`rag_mspoe.eval.demo_curve` and `rag_mspoe.eval.live_curve`).

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

from rag_mspoe.pipelines.answer import GenerationEngine, pack_for_engine
from rag_mspoe.pipelines.packing import PackedPrompt
from rag_mspoe.pipelines.retrieval import Retriever

DEMO_METHODS = ("none", "pi", "mspoe", "layerwise")
DEMO_TOP_K = 10  # a document count the shipped methods were validated at
DEMO_MAX_NEW_TOKENS = 32
# Embedded models from the most capable down: the demo runs the first one installed.
DEMO_MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
# Where the demo writes when not told: a fresh folder per run, named after the model.
DEMO_ROOT = "rag-mspoe-demo"


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
    # The packed documents in the order the model read them (indices into the packed prompt's
    # documents), where a method reordered them; None: as packed.
    read_order: tuple[int, ...] | None = None


@dataclass
class DemoResult:
    question: DemoQuestion
    packed: PackedPrompt
    gold_positions: list[int]  # 1-based positions in the prompt of chunks from the gold file
    answers: list[MethodAnswer] = field(default_factory=list)


def demo_corpus_dir() -> Path:
    return Path(str(resources.files("rag_mspoe.pipelines") / "demo_corpus"))


def demo_model() -> str:
    """The most capable embedded model that is installed (the 0.5B answers the demo's questions
    where the 135M mostly cannot, in a few minutes on two CPU cores)."""
    from rag_mspoe.models import embedded_models

    return next((name for name in DEMO_MODELS if installed(name)), embedded_models.DEFAULT_MODEL)


def installed(model_name: str) -> bool:
    from rag_mspoe.models import embedded_models

    model = embedded_models.get(model_name)
    return all(embedded_models.locate_part(part) is not None for part in model.parts)


def demo_methods(model_name: str) -> tuple[str, ...]:
    """The unmodified model and the method shipped for it; the unmodified model alone where no
    method ships (a method ships only for a model where it won on held-out questions)."""
    from rag_mspoe.calibrated import calibrated_config_path

    return ("none", "calibrated") if calibrated_config_path(model_name) else ("none",)


def model_with_shipped_method() -> str | None:
    """The most capable embedded model a method ships for, installed or not."""
    from rag_mspoe.calibrated import calibrated_config_path

    return next((name for name in DEMO_MODELS if calibrated_config_path(name)), None)


def demo_folder(out: str | None, model: str) -> Path:
    """The folder this run writes into, created: `out`, which must be new or empty, or else a
    fresh folder under DEMO_ROOT named after the model (numbered when it exists)."""
    if out is not None:
        folder = Path(out)
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise ValueError(
                f"{folder} holds an earlier run (or is not a folder); give --out a new folder, or leave "
                f"--out out: each run then writes into a fresh folder under {DEMO_ROOT}/."
            )
    else:
        from rag_mspoe.models.loading import source_name

        base = Path(DEMO_ROOT) / source_name(model).replace("/", "-")
        folder, number = base, 1
        while folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            number += 1
            folder = base.with_name(f"{base.name}-{number}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
    on_question: Callable[[DemoResult], object] | None = None,
    on_answer: Callable[[DemoResult, MethodAnswer], object] | None = None,
) -> list[DemoResult]:
    """Pack each question once (retrieval order, benchmark prompt format) and answer it with every
    method, greedily. `on_question` sees each packed question before its answers, `on_answer`
    each answer as soon as it is generated."""
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
        if on_question is not None:
            on_question(result)
        for method in methods:
            started = time.perf_counter()
            result_of_method = engine.generate(packed.prompt, max_new_tokens=max_new_tokens, method=method)
            text = result_of_method.text.strip()
            answer = MethodAnswer(
                method,
                text,
                contains_answer(text, item.answers),
                time.perf_counter() - started,
                getattr(result_of_method, "documents_read", None),
            )
            result.answers.append(answer)
            if on_answer is not None:
                on_answer(result, answer)
        results.append(result)
    return results


def _normalise(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())
