"""Long-context tasks in the LongBench and ZeroSCROLLS record formats, from local JSON-lines files.

LongBench records: {"_id", "dataset", "context", "input", "answers": [...], "all_classes", ...};
the prompt comes from the task (`{context}` and `{input}` filled in). ZeroSCROLLS records:
{"id", "input", "output", ...}: `input` already is the whole prompt (instructions, document,
query), `output` the reference; rows sharing an id are one example with several references.

A task's prompt, answer length and metric come from the built-in tables below, by the task's
name (LongBench's "dataset" field, else the file name: `hotpotqa.jsonl` is hotpotqa). Records may
override them with our own keys "prompt", "max_new_tokens" and "metric", which is how tasks of
your own are defined.

Prompts longer than the run's limit are cut in the middle, as LongBench does: the head and tail
tokens stay (instructions and the question sit there) and the middle of the context goes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rag_mspoe.eval.data.loaders import read_jsonl
from rag_mspoe.eval.data.records import string_field
from rag_mspoe.eval.scoring.text_metrics import TEXT_METRICS

Suite = Literal["longbench", "zeroscrolls"]
SUITES: tuple[Suite, ...] = ("longbench", "zeroscrolls")


@dataclass(frozen=True)
class TaskSpec:
    """How a task is asked and scored.

    chat: render through the model's chat template (LongBench does for chat models, except on its
    few-shot and code tasks, whose prompts are text to continue). first_line: only the answer's
    first line is scored, and generation stops at a newline.
    """

    prompt: str
    max_new_tokens: int
    metric: str
    chat: bool = True
    first_line: bool = False

    def __post_init__(self) -> None:
        if self.metric not in TEXT_METRICS:
            raise ValueError(f"Unknown metric {self.metric!r}; choose from {', '.join(TEXT_METRICS)}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if "{input}" not in self.prompt and "{context}" not in self.prompt:
            raise ValueError("A task prompt must contain {context} and/or {input}.")


_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
    "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
    "Answer:"
)
_QASPER_RULES = (
    "Answer the question as concisely as you can, using a single phrase or sentence if possible. If the "
    'question cannot be answered based on the information in the article, write "unanswerable". If the '
    'question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)
_STORY_RULES = "as concisely as you can, using a single phrase if possible. Do not provide any explanation."

# LongBench (v1, English tasks): prompt, answer length and metric per task, as published.
LONGBENCH_TASKS: dict[str, TaskSpec] = {
    "narrativeqa": TaskSpec(
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        f"question {_STORY_RULES}\n\nStory: {{context}}\n\nNow, answer the question based on the story "
        f"{_STORY_RULES}\n\nQuestion: {{input}}\n\nAnswer:",
        128,
        "qa_f1",
    ),
    "qasper": TaskSpec(
        f"You are given a scientific article and a question. {_QASPER_RULES}\n\nArticle: {{context}}\n\n "
        f"{_QASPER_RULES.replace('Answer the question', 'Answer the question based on the above article')}"
        "\n\nQuestion: {input}\n\nAnswer:",
        128,
        "qa_f1",
    ),
    "multifieldqa_en": TaskSpec(
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:",
        64,
        "qa_f1",
    ),
    "hotpotqa": TaskSpec(_QA_PASSAGES, 32, "qa_f1"),
    "2wikimqa": TaskSpec(_QA_PASSAGES, 32, "qa_f1"),
    "musique": TaskSpec(_QA_PASSAGES, 32, "qa_f1"),
    "gov_report": TaskSpec(
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        512,
        "rouge_l",
    ),
    "qmsum": TaskSpec(
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
        512,
        "rouge_l",
    ),
    "multi_news": TaskSpec(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
        "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
        512,
        "rouge_l",
    ),
    "trec": TaskSpec(
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "{context}\n{input}",
        64,
        "classification",
        chat=False,
        first_line=True,
    ),
    "triviaqa": TaskSpec(
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}",
        32,
        "qa_f1",
        chat=False,
        first_line=True,
    ),
    "samsum": TaskSpec(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
        "{context}\n\n{input}",
        128,
        "rouge_l",
        chat=False,
        first_line=True,
    ),
    "passage_count": TaskSpec(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after "
        "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
        "{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The "
        "output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        32,
        "count",
    ),
    "passage_retrieval_en": TaskSpec(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter "
        'the number of the paragraph that the abstract is from. The answer format must be like "Paragraph '
        '1", "Paragraph 2", etc.\n\nThe answer is: ',
        32,
        "retrieval",
    ),
    "lcc": TaskSpec(
        "Please complete the code given below. \n{context}Next line of code:\n",
        64,
        "edit_similarity",
        chat=False,
    ),
    "repobench-p": TaskSpec(
        "Please complete the code given below. \n{context}{input}Next line of code:\n",
        64,
        "edit_similarity",
        chat=False,
    ),
}

# ZeroSCROLLS: the record's input is the prompt; answer length and metric per task. Its two
# other tasks (space_digest, book_sum_sort) use metrics not offered here.
ZEROSCROLLS_TASKS: dict[str, TaskSpec] = {
    name: TaskSpec("{input}", max_new_tokens, metric)
    for name, max_new_tokens, metric in (
        ("gov_report", 1024, "rouge_geometric_mean"),
        ("summ_screen_fd", 512, "rouge_geometric_mean"),
        ("qmsum", 512, "rouge_geometric_mean"),
        ("squality", 512, "rouge_geometric_mean"),
        ("qasper", 128, "qa_f1"),
        ("narrative_qa", 64, "qa_f1"),
        ("musique", 32, "qa_f1"),
        ("quality", 10, "exact_match"),
    )
}

BUILT_IN_TASKS: dict[Suite, dict[str, TaskSpec]] = {
    "longbench": LONGBENCH_TASKS,
    "zeroscrolls": ZEROSCROLLS_TASKS,
}
_OVERRIDE_KEYS = ("prompt", "max_new_tokens", "metric", "chat", "first_line")


@dataclass(frozen=True)
class LongExample:
    """One long-context example and the task spec it is asked and scored with."""

    id: str
    suite: Suite
    task: str
    context: str
    input: str
    answers: tuple[str, ...]
    spec: TaskSpec
    classes: tuple[str, ...] = ()
    document_span: tuple[int, int] | None = None  # ZeroSCROLLS: where the document is in `input`

    def __post_init__(self) -> None:
        object.__setattr__(self, "answers", tuple(self.answers))
        object.__setattr__(self, "classes", tuple(self.classes))
        if not self.answers:
            raise ValueError(f"Example {self.id!r} of {self.task} has no reference answer.")

    @property
    def prompt(self) -> str:
        return self._filled()[0]

    def prompt_with_documents(self) -> tuple[str, list[tuple[int, int]] | None]:
        """The prompt and the character span of each of its documents: the context's numbered
        passages ('Passage 1:', 'Paragraph 2:', 'Document 3:' lines), else the whole context as one
        document; [] when the prompt holds no context; None when where it is is not known (a
        ZeroSCROLLS record without document_start_index and document_end_index)."""
        text, document = self._filled()
        if document is None:
            return text, None if self.suite == "zeroscrolls" else []
        return text, document_spans(text, document)

    def _filled(self) -> tuple[str, tuple[int, int] | None]:
        """The prompt and the character range of its document (the context), if it has one."""
        if self.suite == "zeroscrolls":
            return self.input, self.document_span
        # One pass over the template, not str.replace twice (a context may spell "{input}") nor
        # str.format (contexts hold braces: code, JSON).
        text, context = "", None
        for piece in _FIELD.split(self.spec.prompt):
            if piece == "{context}":
                context = (len(text), len(text) + len(self.context))
                text += self.context
            else:
                text += self.input if piece == "{input}" else piece
        return text, context if self.context else None

    def to_dict(self) -> dict[str, Any]:
        """A LongBench-format record that carries its task spec, so it loads back on its own."""
        return {
            "_id": self.id,
            "dataset": self.task,
            "context": self.context,
            "input": self.input,
            "answers": list(self.answers),
            "all_classes": list(self.classes) or None,
            "suite": self.suite,
            **dataclasses.asdict(self.spec),
        }


_FIELD = re.compile(r"(\{context\}|\{input\})")
# A numbered passage heading at the start of a line, as LongBench's multi-document contexts write them.
_PASSAGE = re.compile(r"^(?:Passage|Paragraph|Document) (\d+):", re.MULTILINE)


def document_spans(text: str, document: tuple[int, int]) -> list[tuple[int, int]]:
    """The documents of `text[start:end]`: one per numbered passage when the passages number 1, 2,
    ... in order (each runs to the next, trailing blank space left out), else the whole range."""
    start, end = document
    headings = list(_PASSAGE.finditer(text, start, end))
    if len(headings) < 2 or [int(h.group(1)) for h in headings] != list(range(1, len(headings) + 1)):
        return [document]
    bounds = [h.start() for h in headings] + [end]
    return [(a, a + len(text[a:b].rstrip())) for a, b in zip(bounds, bounds[1:], strict=False)]


def task_spec(suite: Suite, task: str, record: dict[str, Any]) -> TaskSpec:
    """The built-in spec of `task`, with any of the record's own overrides applied."""
    overrides = {key: record[key] for key in _OVERRIDE_KEYS if record.get(key) is not None}
    base = BUILT_IN_TASKS[suite].get(task)
    if base is None:
        missing = [key for key in ("prompt", "max_new_tokens", "metric") if key not in overrides]
        if missing:
            known = ", ".join(BUILT_IN_TASKS[suite])
            raise ValueError(
                f"{suite} task {task!r} is not built in ({known}); give its {', '.join(missing)} in the "
                "records (keys 'prompt' with {context}/{input}, 'max_new_tokens', 'metric'), or name "
                "a built-in task with --task."
            )
        return TaskSpec(**overrides)
    return dataclasses.replace(base, **overrides)


def load_long(path: str | Path, suite: Suite, task: str | None = None) -> list[LongExample]:
    """Examples of one task file. task: the task's name (default: each LongBench record's
    "dataset", else the file name without .jsonl/.jsonl.gz and a "_e" (LongBench-E) suffix)."""
    if suite not in SUITES:
        raise ValueError(f"Unknown suite {suite!r}; choose from {', '.join(SUITES)}.")
    file = Path(path)
    default_task = task or file.name.split(".")[0].removesuffix("_e")
    records = read_jsonl(file)
    if not records:
        raise ValueError(f"{file} holds no records; check the file.")
    if suite == "zeroscrolls":
        return _zeroscrolls(file, records, default_task)
    examples = []
    for number, record in enumerate(records):
        name = task or record.get("dataset") or default_task
        try:
            answers = record["answers"]
            if isinstance(answers, str):
                answers = [answers]
            examples.append(
                LongExample(
                    id=str(record.get("_id", record.get("id", number))),
                    suite="longbench",
                    task=name,
                    context=string_field(record, "context"),
                    input=str(record.get("input") or ""),
                    answers=tuple(str(answer) for answer in answers),
                    spec=task_spec("longbench", name, record),
                    classes=tuple(record.get("all_classes") or ()),
                )
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{file}, record {number + 1}: {exc}; fix or remove that record.") from None
    _check_unique(file, examples)
    return examples


def _zeroscrolls(file: Path, records: Sequence[dict[str, Any]], task: str) -> list[LongExample]:
    merged: dict[str, LongExample] = {}
    for number, record in enumerate(records):
        try:
            identifier = str(record.get("id", number))
            reference = record.get("output")
            if not isinstance(reference, str) or not reference:
                raise ValueError(
                    "'output' (the reference) is missing; ZeroSCROLLS test files hide it, "
                    "use the validation split"
                )
            spec = task_spec("zeroscrolls", task, record)
            if identifier in merged:  # another reference for the same question
                previous = merged[identifier]
                merged[identifier] = dataclasses.replace(previous, answers=(*previous.answers, reference))
                continue
            text = string_field(record, "input")
            merged[identifier] = LongExample(
                id=identifier,
                suite="zeroscrolls",
                task=task,
                context="",
                input=text,
                answers=(reference,),
                spec=spec,
                document_span=_document_indices(record, len(text)),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{file}, record {number + 1}: {exc}; fix or remove that record.") from None
    return list(merged.values())


def _document_indices(record: dict[str, Any], length: int) -> tuple[int, int] | None:
    """ZeroSCROLLS's document_start_index and document_end_index, checked; None without them."""
    start, end = record.get("document_start_index"), record.get("document_end_index")
    if start is None and end is None:
        return None
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= length):
        raise ValueError(
            f"document_start_index {start!r} and document_end_index {end!r} must be character offsets "
            f"0 <= start <= end <= {length} of the input"
        )
    return start, end


def _check_unique(file: Path, examples: Sequence[LongExample]) -> None:
    seen: set[tuple[str, str]] = set()
    for example in examples:
        key = (example.task, example.id)
        if key in seen:
            raise ValueError(
                f"{file}: example id {example.id!r} of {example.task} appears twice; ids must be unique."
            )
        seen.add(key)
