"""The examples a position-bias evaluation runs on, in the lost-in-the-middle record formats.

A QA example is a question, its gold answers and documents of which one is the gold; a KV example
is a list of key-value pairs and the key asked for. `with_gold_at` moves the gold document (or
pair) to a chosen index, keeping the others in their order, which is how a gold-position sweep
is built from one example.

`to_dict`/`from_dict` read and write the keys of the published data files (`ctxs`, `isgold`,
`hasanswer`, `ordered_kv_records`), so those files load as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar


@dataclass(frozen=True)
class Document:
    title: str
    text: str
    is_gold: bool = False
    has_answer: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "text": self.text, "isgold": self.is_gold, "hasanswer": self.has_answer}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Document:
        # Published files may write null for the flags of distractors.
        return cls(
            title=string_field(data, "title"),
            text=string_field(data, "text"),
            is_gold=bool(data.get("isgold", data.get("is_gold")) or False),
            has_answer=bool(data.get("hasanswer", data.get("has_answer")) or False),
        )


@dataclass(frozen=True)
class QAExample:
    """candidates: answer options present in the context, for forced choice (any order; the gold
    answer, answers[0], is one of them). Empty when the example has none (real retrieval data)."""

    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...]
    candidates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists (as JSON gives them) but store tuples, so examples stay hashable and immutable.
        for name in ("answers", "documents", "candidates"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.answers:
            raise ValueError(f"QA example {self.id!r} has no gold answer; give at least one in 'answers'.")
        if sum(document.is_gold for document in self.documents) > 1:
            raise ValueError(f"QA example {self.id!r} marks several documents as gold; mark exactly one.")
        if self.candidates and self.answers[0] not in self.candidates:
            raise ValueError(
                f"QA example {self.id!r}: the gold answer {self.answers[0]!r} is not among its candidates; "
                "add it to 'candidates'."
            )

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "id": self.id,
            "question": self.question,
            "answers": list(self.answers),
            "ctxs": [document.to_dict() for document in self.documents],
        }
        if self.candidates:
            record["candidates"] = list(self.candidates)
        return record

    @classmethod
    def from_dict(cls, data: dict[str, Any], default_id: str = "") -> QAExample:
        """Read a record; `default_id` names it when it has no "id" (the published files have none)."""
        answers = data.get("answers")
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise ValueError("'answers' must be a list of strings")
        contexts = data.get("ctxs")
        if not isinstance(contexts, list) or not all(isinstance(c, dict) for c in contexts):
            raise ValueError("'ctxs' must be a list of {title, text, ...} objects")
        return cls(
            id=str(data.get("id", default_id)),
            question=string_field(data, "question"),
            answers=tuple(answers),
            documents=tuple(Document.from_dict(context) for context in contexts),
            candidates=tuple(data.get("candidates") or ()),
        )


@dataclass(frozen=True)
class KVExample:
    id: str
    pairs: tuple[tuple[str, str], ...]
    key: str
    value: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", tuple((str(k), str(v)) for k, v in self.pairs))
        keys = [k for k, _ in self.pairs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"KV example {self.id!r} has duplicate keys; every key must be unique.")
        if (self.key, self.value) not in self.pairs:
            raise ValueError(
                f"KV example {self.id!r}: the pair ({self.key!r}, {self.value!r}) is not in its records."
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ordered_kv_records": [list(pair) for pair in self.pairs],
            "key": self.key,
            "value": self.value,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], default_id: str = "") -> KVExample:
        records = data.get("ordered_kv_records")
        if not isinstance(records, list) or not all(
            isinstance(r, list | tuple) and len(r) == 2 and all(isinstance(x, str) for x in r)
            for r in records
        ):
            raise ValueError("'ordered_kv_records' must be a list of [key, value] string pairs")
        return cls(
            id=str(data.get("id", default_id)),
            pairs=tuple((k, v) for k, v in records),
            key=string_field(data, "key"),
            value=string_field(data, "value"),
        )


Example = TypeVar("Example", bound=QAExample | KVExample)


def gold_index(example: QAExample | KVExample) -> int | None:
    """Index of the gold document (QA) or of the asked-for pair (KV); None if no document is gold."""
    if isinstance(example, KVExample):
        return [k for k, _ in example.pairs].index(example.key)
    return next((i for i, document in enumerate(example.documents) if document.is_gold), None)


def with_gold_at(example: Example, index: int) -> Example:
    """A copy with the gold document (or pair) at `index`; the others keep their relative order."""
    items: tuple[Any, ...] = example.pairs if isinstance(example, KVExample) else example.documents
    if not 0 <= index < len(items):
        raise IndexError(
            f"Gold index {index} is out of range for {len(items)} items in example {example.id!r}."
        )
    current = gold_index(example)
    if current is None:
        raise ValueError(f"Example {example.id!r} has no gold document to move; mark one with is_gold=True.")
    others = items[:current] + items[current + 1 :]
    moved = others[:index] + (items[current],) + others[index:]
    if isinstance(example, KVExample):
        return dataclasses.replace(example, pairs=moved)
    return dataclasses.replace(example, documents=moved)


def string_field(data: dict[str, Any], key: str) -> str:
    """data[key], which must be a string."""
    value = data.get(key)
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {value!r}")
    return value
