"""A multiple-choice knowledge check in the MMLU record format, scored by log-likelihood.

Records are JSON lines {"question", "choices": [...], "answer": index or letter, "subject"?}
(the Hugging Face MMLU layout), or MMLU's original CSV files (no header; question, the choices,
then the answer letter; the subject is the file name less "_test"/"_dev"/"_val").

`scoring="letter"` (MMLU's own) shows the lettered options in MMLU's zero-shot prompt and
compares the log-likelihoods of " A", " B", ...; `scoring="text"` (the cloze form) asks the
question alone and compares each choice's text as its answer by mean log-probability per token,
which tells more on small models that have not learnt to answer with a letter.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rag_mspoe.eval.data.loaders import read_jsonl

Scoring = Literal["letter", "text"]
LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class ChoiceExample:
    id: str
    question: str
    choices: tuple[str, ...]
    answer: int  # index into choices
    subject: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not 2 <= len(self.choices) <= len(LETTERS):
            raise ValueError(
                f"question {self.id!r} has {len(self.choices)} choices; give 2 to {len(LETTERS)}"
            )
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"question {self.id!r} repeats a choice; choices must be distinct")
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"question {self.id!r}: answer {self.answer} is not a choice index")

    def prompt(self, scoring: Scoring = "letter") -> str:
        """MMLU's zero-shot prompt with the lettered options ("letter"), or the question alone,
        whose answer the choices' texts continue ("text", the cloze form)."""
        topic = self.subject.replace("_", " ").strip()
        kind = "multiple choice questions" if scoring == "letter" else "questions"
        header = f"The following are {kind} (with answers) about {topic}.\n\n" if topic else ""
        if scoring == "text":
            return f"{header}{self.question.strip()}\nAnswer:"
        options = "".join(f"\n{LETTERS[i]}. {choice}" for i, choice in enumerate(self.choices))
        return f"{header}{self.question.strip()}{options}\nAnswer:"

    def continuations(self, scoring: Scoring) -> list[str]:
        if scoring == "letter":
            return [f" {LETTERS[i]}" for i in range(len(self.choices))]
        return [f" {choice}" for choice in self.choices]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "choices": list(self.choices),
            "answer": self.answer,
            "subject": self.subject,
        }


def load_choices(path: str | Path, subject: str | None = None) -> list[ChoiceExample]:
    """Questions of one MMLU-format file (.jsonl, .jsonl.gz or the original .csv)."""
    file = Path(path)
    default_subject = subject or file.name.split(".")[0].removesuffix("_test").removesuffix(
        "_dev"
    ).removesuffix("_val")
    rows = _csv_rows(file) if file.suffix == ".csv" else read_jsonl(file)
    if not rows:
        raise ValueError(f"{file} holds no questions; check the file.")
    examples = []
    for number, row in enumerate(rows):
        try:
            examples.append(
                ChoiceExample(
                    id=str(row.get("id", number)),
                    question=_text(row.get("question")),
                    choices=tuple(_text(choice) for choice in row.get("choices") or ()),
                    answer=_answer_index(row.get("answer")),
                    subject=str(row.get("subject") or default_subject),
                )
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{file}, record {number + 1}: {exc}; fix or remove that record.") from None
    return examples


def choice_scores(sums_and_counts: Sequence[tuple[float, int]], scoring: Scoring) -> list[float]:
    """The number each choice is ranked by: the total log-probability of a letter, or the mean
    per token of a choice's text (so long choices are not penalised for their length)."""
    if scoring == "letter":
        return [total for total, _ in sums_and_counts]
    return [total / tokens for total, tokens in sums_and_counts]


def _csv_rows(file: Path) -> list[dict[str, Any]]:
    if not file.is_file():
        raise FileNotFoundError(f"No questions file at {file}; check the path.")
    with open(file, encoding="utf-8", newline="") as handle:
        rows = []
        for line in csv.reader(handle):
            if len(line) < 4:
                raise ValueError(
                    f"{file}: a row has {len(line)} columns; MMLU rows are question, choices, answer."
                )
            rows.append({"question": line[0], "choices": line[1:-1], "answer": line[-1]})
        return rows


def _answer_index(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"answer must be a choice index or letter, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS:
        return LETTERS.index(value.strip().upper())
    raise ValueError(f"answer must be a choice index (0, 1, ...) or a letter (A, B, ...), got {value!r}")


def _text(value: Any) -> str:
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"expected text, got {value!r}")
    return str(value)
