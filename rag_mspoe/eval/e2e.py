"""End-to-end mode: questions go through the real RAG pipeline (index, retrieve, pack, answer).

For each question and method it records where the gold document ranked in retrieval
(`gold_rank`, 1 = best, None = not retrieved) and where it sat in the packed prompt
(`gold_prompt_position`, 0 = first document, None = not packed), so accuracy can be read by
prompt position and by retrieval quality.

Questions file: JSON lines of {"id", "question", "answers": [...]} with optionally
"gold_source" (the corpus file the answer comes from; a chunk is gold when its source path ends
with it) and "candidates" (answer options, for forced choice). Without gold_source, a chunk is
gold when it contains an answer (SQuAD-normalised).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_mspoe.eval.data.loaders import read_jsonl
from rag_mspoe.eval.method_engines import EngineSet, stable_seed
from rag_mspoe.eval.report import line_plot
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import Key, read_records
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.eval.scoring.metrics import best_subspan_em, normalize_answer, paired_test
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve_all
from rag_mspoe.models.command_options import model_load_options
from rag_mspoe.models.loading import source_name
from rag_mspoe.pipelines.retrieval import FIRST_STAGES, FirstStage

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike

KEY_FIELDS = ("method", "example_id")
PLOT_FILE = "accuracy_by_prompt_position.png"
# Where the retriever put the gold: first (no method can gain), just below, or far down.
RANK_BUCKETS = ((1, 1), (2, 5), (6, 10**9))
THROUGH = ("pipeline", "langchain", "langchain-agent", "llamaindex")


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]
    gold_source: str | None = None
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True)
class E2EConfig:
    questions: str
    corpus: tuple[str, ...]
    methods: tuple[str, ...] = ("none", "mspoe", "longcontextreorder")
    k: int = 10
    max_new_tokens: int = 64
    model: str | None = None
    # How the retriever finds chunks: dense (embeddings), lexical (BM25) or hybrid (fused).
    first_stage: FirstStage = "dense"
    seed: int = 0
    # The package's own pipeline, or the chain a user writes (rag_mspoe.eval.e2e_chains).
    through: str = "pipeline"

    def __post_init__(self) -> None:
        object.__setattr__(self, "corpus", tuple(self.corpus))
        object.__setattr__(self, "methods", tuple(self.methods))
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}.")
        if self.first_stage not in FIRST_STAGES:
            stages = ", ".join(FIRST_STAGES)
            raise ValueError(f"first_stage must be one of {stages}, got {self.first_stage!r}.")
        if self.through not in THROUGH:
            raise ValueError(f"through must be one of {', '.join(THROUGH)}, got {self.through!r}.")


def read_questions(path: str) -> list[Question]:
    questions = []
    for number, record in enumerate(read_jsonl(path), start=1):
        answers = record.get("answers")
        if not isinstance(record.get("question"), str) or not isinstance(answers, list) or not answers:
            raise ValueError(
                f"{path}, record {number}: needs 'question' (a string) and 'answers' (a non-empty list)."
            )
        questions.append(
            Question(
                id=str(record.get("id", number - 1)),
                question=record["question"],
                answers=tuple(answers),
                gold_source=record.get("gold_source"),
                candidates=tuple(record.get("candidates") or ()),
            )
        )
    if len({q.id for q in questions}) != len(questions):
        raise ValueError(f"{path}: question ids repeat; give every question its own 'id'.")
    return questions


def is_gold(question: Question, source: str, text: str) -> bool:
    if question.gold_source:
        return Path(source).as_posix().endswith(Path(question.gold_source).as_posix())
    normalized = normalize_answer(text)
    return any(normalize_answer(answer) in normalized for answer in question.answers)


@dataclass
class EndToEnd(Evaluation):
    """Units: (method, question). The corpus is indexed (incrementally) and every question
    retrieved once, before the model loads."""

    kind = "e2e"
    command_help = (
        "end to end: questions through the real RAG pipeline, accuracy by retrieval rank and position"
    )
    pairing = Pairing(None, ("example_id",), ("choice_correct", "match"))
    key_fields = KEY_FIELDS
    unit_name = "answer"
    identity_fields = (
        "questions",
        "corpus",
        "k",
        "max_new_tokens",
        "model",
        "seed",
        "through",
        "first_stage",
    )
    config: E2EConfig
    methods: Sequence[ResolvedMethod]
    index_dir: Path
    progress: bool | None = None
    questions: list[Question] = field(default_factory=list)
    retrieved: dict[str, Any] = field(default_factory=dict)
    index: Any = None  # the open Retriever, for answers through a chain

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        return str(write_e2e_report(folder)["markdown"])

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("questions", help="JSONL of {id, question, answers, gold_source} per line")
        parser.add_argument("corpus", nargs="+", help="files or folders to index (or an existing --index)")
        parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
        parser.add_argument("--index", default=None, help="index folder (default: OUT/index)")
        parser.add_argument("--methods", nargs="+", default=["none", "mspoe", "longcontextreorder"])
        parser.add_argument("-k", type=int, default=10, help="chunks retrieved per question")
        parser.add_argument(
            "--first-stage",
            choices=FIRST_STAGES,
            default="dense",
            help="how chunks are found: dense (embeddings), lexical (BM25) or hybrid (both, fused by rank)",
        )
        parser.add_argument("--max-new-tokens", type=int, default=64)
        parser.add_argument(
            "--through",
            choices=THROUGH,
            default="pipeline",
            help="answer through the package's pipeline, LangChain's tutorial RAG chain (langchain: the "
            "LCEL chain, its question before the context; langchain-agent: the current tutorial's agent, "
            "the context in its system message) or a LlamaIndex query engine (the LLM line the only "
            "thing of ours)",
        )

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
        config = E2EConfig(
            questions=str(Path(args.questions).resolve()),
            corpus=tuple(str(Path(p).resolve()) for p in args.corpus),
            methods=tuple(args.methods),
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            model=args.model,
            through=args.through,
            first_stage=args.first_stage,
        )
        summary = run_e2e(
            config, args.out, index_dir=args.index, **model_load_options(args), progress=not args.no_progress
        )
        print(json.dumps(summary["overall"], indent=2))
        return 0

    def inputs(self) -> Sequence[str]:
        # The corpus too: an edited, added or removed document would mix two corpora in the records.
        return (self.config.questions, *self.config.corpus)

    def plan(self, folder: Path, done: set[Key]) -> list[tuple[ResolvedMethod, Question]]:
        self.questions = read_questions(self.config.questions)
        return [(m, q) for q in self.questions for m in self.methods if (m.name, q.id) not in done]

    def prepare(self) -> None:
        from rag_mspoe.pipelines.indexing import index_documents
        from rag_mspoe.pipelines.retrieval import Retriever

        index_documents(list(self.config.corpus), self.index_dir, progress=self.progress)
        self.index = Retriever.load(self.index_dir, first_stage=self.config.first_stage)
        found = self.index.retrieve_many([q.question for q in self.questions], self.config.k)
        self.retrieved = dict(zip([q.id for q in self.questions], found, strict=True))

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        engines = EngineSet(model, tokenizer)

        def score(unit: tuple[ResolvedMethod, Question]) -> list[dict[str, Any]]:
            method, question = unit
            engine = engines.engine_for(method)
            if self.config.through != "pipeline":
                return [
                    answer_through(
                        self.config, method, question, self.retrieved[question.id], self.index, engine
                    )
                ]
            return [answer_one(self.config, method, question, self.retrieved[question.id], engine)]

        return score


def run_e2e(
    config: E2EConfig,
    folder: str | Path,
    *,
    index_dir: str | Path | None = None,
    progress: bool | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Index the corpus (incrementally), then answer every pending (method, question).

    options: those of `run_evaluation` (model, tokenizer, threads, device, dtype)."""
    methods = resolve_all(config.methods, source_name(config.model))
    index = Path(index_dir) if index_dir else Path(folder) / "index"
    outcome = run_evaluation(EndToEnd(config, methods, index, progress), folder, progress=progress, **options)
    return write_e2e_report(outcome.folder, [m.name for m in methods])


def answer_one(
    config: E2EConfig,
    method: ResolvedMethod,
    question: Question,
    retrieved: Sequence[Any],
    engine: EngineLike,
) -> dict[str, Any]:
    """Pack the retrieved chunks as the pipeline does, put them in the method's order, answer."""
    from rag_mspoe.eval.scoring.model_scores import score_forced_choice
    from rag_mspoe.pipelines.answer import generate_answer, pack_for_engine
    from rag_mspoe.pipelines.packing import render_prompt

    started = time.perf_counter()
    gold_rank = next((r.rank for r in retrieved if is_gold(question, r.chunk.source, r.chunk.text)), None)
    packed = pack_for_engine(
        question.question, retrieved, engine, max_new_tokens=config.max_new_tokens, reorder=False, cite=False
    )
    documents, _ = method.arrange(packed.documents, stable_seed(config.seed, question.id))
    prompt = render_prompt(question.question, documents, cite=False)
    packed = dataclasses.replace(
        packed, prompt=prompt, documents=documents, reordered=method.order != "given"
    )
    position = next(
        (i for i, r in enumerate(documents) if is_gold(question, r.chunk.source, r.chunk.text)), None
    )
    answer = generate_answer(
        packed, question.question, engine, max_new_tokens=config.max_new_tokens, method=method.method
    )
    record: dict[str, Any] = {
        "method": method.name,
        "example_id": question.id,
        "gold_rank": gold_rank,
        "gold_prompt_position": position,
        "packed": len(documents),
        "prediction": answer.text,
        "match": best_subspan_em(answer.text, question.answers),
    }
    if question.candidates:
        choice = score_forced_choice(
            engine, prompt, list(question.candidates), question.answers[0], method=method.method
        )
        record["choice_correct"] = choice["correct"]
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record


def answer_through(
    config: E2EConfig,
    method: ResolvedMethod,
    question: Question,
    retrieved: Sequence[Any],
    index: Any,
    engine: EngineLike,
) -> dict[str, Any]:
    """Answer through the chain `config.through` names, as a user's chain would, and record where
    the gold was retrieved, where it sat in the prompt and where the method read it."""
    from rag_mspoe.eval.e2e_chains import answer_through_chain

    started = time.perf_counter()
    gold_rank = next((r.rank for r in retrieved if is_gold(question, r.chunk.source, r.chunk.text)), None)
    answer = answer_through_chain(
        config.through, engine, method, question.question, index, config.k, config.max_new_tokens
    )
    position = next(
        (i for i, (source, text) in enumerate(answer.packed) if is_gold(question, source, text)), None
    )
    read = answer.documents_read
    return {
        "method": method.name,
        "example_id": question.id,
        "gold_rank": gold_rank,
        "gold_prompt_position": position,
        # Where the model read the gold: its place in the method's order (None: not read).
        "gold_read_position": position
        if read is None or position is None
        else _index_or_none(read, position),
        "documents_read": read,
        "packed": len(answer.packed),
        "prediction": answer.text,
        "match": best_subspan_em(answer.text, question.answers),
        "seconds": round(time.perf_counter() - started, 4),
    }


def _index_or_none(items: Sequence[int], item: int) -> int | None:
    return items.index(item) if item in items else None


def _bucket(rank: int | None) -> str:
    if rank is None:
        return "not retrieved"
    low, high = next((low, high) for low, high in RANK_BUCKETS if low <= rank <= high)
    return str(low) if low == high else (f"{low}-{high}" if high < 10**9 else f">{low - 1}")


def write_e2e_report(folder: Path, method_order: Sequence[str] = ()) -> dict[str, Any]:
    """summary.json and table.md: per method, accuracy and seconds per answer overall and by the
    gold's retrieval rank, each with the paired test against the unmodified model on the same
    questions; accuracy by the gold's position in the prompt; and the plot of the latter."""
    records = read_records(folder / "results.jsonl")
    metric = "choice_correct" if any("choice_correct" in r for r in records) else "match"
    by_method: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        by_method[r["method"]][r["example_id"]] = r
    methods = [m for m in dict.fromkeys([*method_order, *by_method]) if m in by_method]
    baseline = next((m for m in methods if m == "none"), None)

    def value(r: dict[str, Any]) -> float:
        return float(r.get(metric, r["match"]))

    def cell(method: str, keep: Any) -> dict[str, Any]:
        chosen = {i: r for i, r in by_method[method].items() if keep(r)}
        values = [value(r) for r in chosen.values()]
        entry: dict[str, Any] = {
            "accuracy": sum(values) / len(values),
            "n": len(values),
            "seconds_per_answer": sum(r["seconds"] for r in chosen.values()) / len(values),
        }
        if baseline is not None and method != baseline:
            both = [i for i in chosen if i in by_method[baseline]]
            if both:
                ours = [value(chosen[i]) for i in both]
                theirs = [value(by_method[baseline][i]) for i in both]
                entry["difference"] = (sum(ours) - sum(theirs)) / len(both)
                entry["p_vs_none"] = paired_test(ours, theirs)
        return entry

    def groups(method: str, label: Any) -> dict[str, dict[str, Any]]:
        names = sorted({label(r) for r in by_method[method].values()}, key=_bucket_order)
        return {name: cell(method, lambda r, name=name: label(r) == name) for name in names}

    summary: dict[str, Any] = {"metric": metric, "overall": {}, "by_rank": {}, "by_position": {}}
    for method in methods:
        summary["overall"][method] = cell(method, lambda r: True)
        summary["by_rank"][method] = groups(method, lambda r: _bucket(r["gold_rank"]))
        summary["by_position"][method] = groups(method, _position)
    summary["markdown"] = _e2e_markdown(summary)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / "table.md").write_text(summary["markdown"])
    by_position = {
        method: {int(k): v["accuracy"] * 100 for k, v in cells.items() if k.isdigit()}
        for method, cells in summary["by_position"].items()
    }
    if any(by_position.values()):
        line_plot(
            by_position,
            folder / PLOT_FILE,
            xlabel="gold document position in the packed prompt (0 = first)",
            ylabel=f"{metric} (%)",
        )
    return summary


def _position(record: dict[str, Any]) -> str:
    position = record["gold_prompt_position"]
    return "not packed" if position is None else str(position)


def _bucket_order(name: str) -> tuple[int, int]:
    """Ranks and positions in numeric order, then '>N', then 'not retrieved' / 'not packed'."""
    if name[0].isdigit():
        return 0, int(name.split("-")[0])
    return (1, int(name[1:])) if name.startswith(">") else (2, 0)


def _e2e_markdown(summary: dict[str, Any]) -> str:
    def row(method: str, group: str, entry: dict[str, Any]) -> str:
        change = (
            f"{100 * entry['difference']:+.1f} (p = {entry['p_vs_none']:.2g})" if "p_vs_none" in entry else ""
        )
        return (
            f"| {method} | {group} | {100 * entry['accuracy']:.1f} | {change} | {entry['n']} "
            f"| {entry['seconds_per_answer']:.1f} |"
        )

    lines = [
        f"Accuracy ({summary['metric']}, %) per method; the change against none is paired on the same "
        "questions (McNemar); n = questions; seconds per answer as measured in this run.",
        "",
        "| method | gold retrieved at rank | accuracy | vs none | n | s / answer |",
        "|---|---|---|---|---|---|",
    ]
    for method, entry in summary["overall"].items():
        lines.append(row(method, "all", entry))
        lines += [row(method, rank, cell) for rank, cell in summary["by_rank"][method].items()]
    lines += [
        "",
        "By the gold's position in the prompt the model was given (0 = first):",
        "",
        "| method | gold position | accuracy | vs none | n | s / answer |",
        "|---|---|---|---|---|---|",
    ]
    for method, cells in summary["by_position"].items():
        lines += [row(method, position, cell) for position, cell in cells.items()]
    return "\n".join(lines) + "\n"
