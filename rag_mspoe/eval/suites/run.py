"""Run long-context suites (LongBench, ZeroSCROLLS) and a knowledge check (MMLU) per method:
does a position fix cost anything elsewhere?

    config = SuiteConfig(files=(DataFile("longbench", "data/hotpotqa.jsonl"),
                                DataFile("mmlu", "data/mmlu.jsonl")), methods=("none", "mspoe"))
    run_suite(config, "runs/side-effects")

Long-context examples are answered greedily and scored by their task's metric; knowledge
questions are scored by log-likelihood. Records go to results.jsonl keyed by (method, task,
example id), so a stopped run resumes where it stopped; a data file that changed since the run
started is refused. The report (summary.json, table.md) follows.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from rag_mspoe.engine.engine_generation import middle_cut, spans_after_cut
from rag_mspoe.eval.method_engines import EngineSet, require_given_order
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import Key
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.eval.scoring.text_metrics import score_text
from rag_mspoe.eval.suites.knowledge import ChoiceExample, Scoring, choice_scores, load_choices
from rag_mspoe.eval.suites.long_context import LongExample, load_long
from rag_mspoe.eval.suites.report import position_gains, write_suite_report
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve_all
from rag_mspoe.models.command_options import model_load_options
from rag_mspoe.models.loading import source_name
from rag_mspoe.prompts.chat_template import Prompt
from rag_mspoe.prompts.document_prompts import document_message

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike

Kind = Literal["longbench", "zeroscrolls", "mmlu"]
KINDS: tuple[Kind, ...] = ("longbench", "zeroscrolls", "mmlu")
KEY_FIELDS = ("method", "task", "example_id")
TEMPLATE_ROOM = 64  # tokens kept free for the chat template around a prompt cut to the limit
Example: TypeAlias = LongExample | ChoiceExample


@dataclass(frozen=True)
class DataFile:
    """One task file: kind (longbench, zeroscrolls or mmlu), its path, optionally the task's name."""

    kind: Kind
    path: str
    task: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Unknown data kind {self.kind!r}; choose from {', '.join(KINDS)}.")

    def load(self) -> list[Example]:
        if self.kind == "mmlu":
            return list(load_choices(self.path, subject=self.task))
        return list(load_long(self.path, self.kind, task=self.task))

    def label(self, example: Example) -> str:
        """The task column of a record: "longbench/hotpotqa", "mmlu/<file name>"."""
        if isinstance(example, LongExample):
            return f"{example.suite}/{example.task}"
        return f"mmlu/{self.task or Path(self.path).name.split('.')[0]}"


@dataclass(frozen=True)
class SuiteConfig:
    """samples: the first N examples of each task (None: all). max_length: prompt tokens before
    the middle is cut (None: the context window less the task's answer length)."""

    files: tuple[DataFile, ...]
    methods: tuple[str, ...] = ("none", "pi", "mspoe", "layerwise")
    samples: int | None = None
    max_length: int | None = None
    choice_scoring: Scoring = "letter"
    batch_size: int = 4
    model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.files:
            raise ValueError("Give at least one data file (--longbench, --zeroscrolls or --mmlu).")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}.")
        if self.max_length is not None and self.max_length < 16:
            raise ValueError(f"max_length must be at least 16 tokens, got {self.max_length}.")
        if self.choice_scoring not in ("letter", "text"):
            raise ValueError(f"choice_scoring must be 'letter' or 'text', got {self.choice_scoring!r}.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}.")


@dataclass(frozen=True)
class WorkItem:
    method: ResolvedMethod
    task: str
    examples: tuple[Example, ...]


def load_tasks(config: SuiteConfig) -> dict[str, list[Example]]:
    """Examples per task label, in file order, the first `samples` of each."""
    tasks: dict[str, list[Example]] = {}
    for data in config.files:
        for example in data.load():
            tasks.setdefault(data.label(example), []).append(example)
    if config.samples is not None:
        tasks = {task: examples[: config.samples] for task, examples in tasks.items()}
    return tasks


@dataclass
class Suite(Evaluation):
    """Units: a batch of one method's examples of one task; the data files must stay the same."""

    kind = "suite"
    command_help = "side effects per method: LongBench / ZeroSCROLLS long-context tasks, MMLU-style knowledge"
    command_description = (
        "Answer every example of the given task files with every method into OUT/results.jsonl, "
        "then write table.md and side_effects.md. Rerun the same command to resume."
    )
    pairing = Pairing("task", ("example_id",), ("score",))
    key_fields = KEY_FIELDS
    identity_fields = ("files", "samples", "max_length", "choice_scoring", "batch_size", "model")
    config: SuiteConfig
    methods: Sequence[ResolvedMethod]
    tasks: dict[str, list[Example]]

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        summary = write_suite_report(folder, sweep=Path(options.sweep) if options.sweep else None)
        return f"{summary['markdown']}\n{summary['side_effects']}"

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
        for kind, what in (
            ("longbench", "LongBench-format JSONL (one task per file, e.g. hotpotqa.jsonl)"),
            ("zeroscrolls", "ZeroSCROLLS-format JSONL (validation split, e.g. qasper.jsonl)"),
            ("mmlu", "MMLU-format JSONL or CSV (question, choices, answer)"),
        ):
            parser.add_argument(
                f"--{kind}",
                nargs="+",
                default=[],
                metavar="FILE[:TASK]",
                help=f"{what}; :TASK names the task",
            )
        parser.add_argument("--methods", nargs="+", default=["none", "pi", "mspoe", "layerwise"])
        parser.add_argument(
            "--samples", type=int, default=None, help="first N examples of each task (default all)"
        )
        parser.add_argument(
            "--max-length",
            type=int,
            default=None,
            help="prompt tokens before the middle is cut (default: the context window less the answer "
            "length)",
        )
        parser.add_argument(
            "--choice-scoring",
            choices=["letter", "text"],
            default="letter",
            help="MMLU: compare the answer letters (MMLU's way) or the choices' texts (kinder to small "
            "models)",
        )
        parser.add_argument(
            "--batch-size", type=int, default=4, help="long-context prompts per generation batch"
        )
        parser.add_argument("--sweep", default=None, help="a sweep folder, for the position-bias gain column")

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
        config = SuiteConfig(
            files=data_files(args),
            methods=tuple(args.methods),
            samples=args.samples,
            max_length=args.max_length,
            choice_scoring=args.choice_scoring,
            batch_size=args.batch_size,
            model=args.model,
        )
        sweep = Path(args.sweep) if args.sweep else None
        summary = run_suite(
            config, args.out, **model_load_options(args), progress=not args.no_progress, sweep=sweep
        )
        print(summary["markdown"])
        print(summary["side_effects"])
        return 0

    def inputs(self) -> Sequence[str]:
        return [data.path for data in self.config.files]

    def plan(self, folder: Path, done: set[Key]) -> list[WorkItem]:
        size, units = self.config.batch_size, []
        for method in self.methods:
            for task, examples in self.tasks.items():
                pending = tuple(e for e in examples if (method.name, task, e.id) not in done)
                units += [WorkItem(method, task, pending[i : i + size]) for i in range(0, len(pending), size)]
        return units

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        engines = EngineSet(model, tokenizer)
        return lambda item: score_item(engines.engine_for(item.method), item, self.config)


def data_files(args: argparse.Namespace) -> tuple[DataFile, ...]:
    """The task files the options of `rag-mspoe suite` name (FILE or FILE:TASK)."""
    files = []
    for kind in KINDS:
        for spec in getattr(args, kind):
            path, _, task = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
            files.append(DataFile(kind, str(Path(path).resolve()), task or None))
    return tuple(files)


def run_suite(
    config: SuiteConfig, folder: str | Path, *, sweep: Path | None = None, **options: Any
) -> dict[str, Any]:
    """Score every pending (method, task, example) into `folder`; returns the report's summary.

    sweep: a gold-position sweep folder whose position-bias gains join the side-effect table.
    options: those of `run_evaluation` (model, tokenizer, threads, device, dtype, progress)."""
    methods = resolve_all(config.methods, source_name(config.model))
    # The side-effect table still shows a reordering's position-bias gain, from a sweep.
    require_given_order(methods, "in these suites")
    tasks = load_tasks(config)
    require_document_spans(methods, tasks)
    if sweep is not None:
        position_gains(sweep)  # a bad sweep folder fails now, not after the run
    outcome = run_evaluation(Suite(config, methods, tasks), folder, **options)
    return write_suite_report(outcome.folder, [m.name for m in methods], sweep=sweep)


def require_document_spans(methods: Sequence[ResolvedMethod], tasks: dict[str, list[Example]]) -> None:
    """Refuse, before any model runs, a method that reads documents on a task whose prompts do
    not say where their document is."""
    readers = [m.name for m in methods if m.method is not None and m.method.needs_document_spans()]
    if not readers:
        return
    for task, examples in tasks.items():
        long = [e for e in examples if isinstance(e, LongExample)]
        unknown = [e.id for e in long if e.prompt_with_documents()[1] is None]
        if unknown:
            raise ValueError(
                f"{', '.join(readers)} read the documents, and {task}'s records do not say where the "
                f"document is in the input (example {unknown[0]!r}): give the records ZeroSCROLLS's "
                "document_start_index and document_end_index, or run those methods without that task."
            )


def score_item(engine: EngineLike, item: WorkItem, config: SuiteConfig) -> list[dict[str, Any]]:
    started = time.perf_counter()
    long = [e for e in item.examples if isinstance(e, LongExample)]
    choices = [e for e in item.examples if isinstance(e, ChoiceExample)]
    records = [*_answer_long(engine, long, item, config), *_answer_choices(engine, choices, item, config)]
    seconds = round((time.perf_counter() - started) / len(records), 4)
    return [{**record, "seconds": seconds} for record in records]


def prompt_within(engine: EngineLike, example: LongExample, max_length: int | None) -> tuple[Prompt, int]:
    """The example's prompt cut in the middle to the limit, and how many tokens were cut. The cut
    falls between tokens of the text, so the kept text is the original's head and tail, and the
    prompt says where its documents are (what is left of them), for the methods that read them."""
    limit = engine.context_window - example.spec.max_new_tokens - TEMPLATE_ROOM
    if max_length is not None:
        limit = min(limit, max_length)
    text, documents = example.prompt_with_documents()
    starts = engine.token_starts(text)
    head, tail_start, removed = middle_cut(len(starts), limit)
    if removed:
        cut_from, cut_to = starts[head], starts[tail_start]
        text = text[:cut_from] + text[cut_to:]
        documents = None if documents is None else spans_after_cut(documents, cut_from, cut_to)
    return (text if documents is None else [document_message(text, documents)]), removed


def _answer_long(
    engine: EngineLike, examples: Sequence[LongExample], item: WorkItem, config: SuiteConfig
) -> Iterator[dict[str, Any]]:
    if not examples:
        return
    spec = examples[0].spec  # one batch holds one task, so one spec
    prompts = [prompt_within(engine, example, config.max_length) for example in examples]
    answers = engine.generate_batch(
        [prompt for prompt, _ in prompts],
        max_new_tokens=spec.max_new_tokens,
        stop=["\n"] if spec.first_line else [],
        raw=not spec.chat,
        truncate="middle",  # a chat template longer than TEMPLATE_ROOM is cut too, and counted
        method=item.method.method,
    )
    for example, (_, removed), answer in zip(examples, prompts, answers, strict=True):
        prediction = answer.text.lstrip("\n").split("\n")[0] if spec.first_line else answer.text
        extra_cut = answer.truncation.removed_tokens if answer.truncation else 0
        yield {
            "method": item.method.name,
            "task": item.task,
            "example_id": example.id,
            "metric": spec.metric,
            "score": score_text(spec.metric, prediction, example.answers, example.classes),
            "prediction": prediction,
            "prompt_tokens": answer.prompt_tokens,
            "truncated_tokens": removed + extra_cut,
        }


def _answer_choices(
    engine: EngineLike, examples: Sequence[ChoiceExample], item: WorkItem, config: SuiteConfig
) -> Iterator[dict[str, Any]]:
    for example in examples:
        scored = engine.score_continuations(
            [document_message(example.prompt(config.choice_scoring), [])],  # a question, no documents
            example.continuations(config.choice_scoring),
            raw=True,
            method=item.method.method,
        )
        scores = choice_scores(scored, config.choice_scoring)
        choice = max(range(len(scores)), key=scores.__getitem__)  # ties: the earlier choice
        yield {
            "method": item.method.name,
            "task": item.task,
            "example_id": example.id,
            "metric": f"accuracy ({config.choice_scoring})",
            "score": float(choice == example.answer),
            "choice": choice,
            "answer": example.answer,
        }
