"""Read and write evaluation examples as JSON lines, gzipped when the name ends in .gz.

The published lost-in-the-middle files (`nq-open-*.jsonl.gz`, `kv-retrieval-*.jsonl.gz`) load
as they are; their records carry no id, so an example is named by its line (0-based), which is
the same question in every gold-position file of one release.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from rag_mspoe.eval.data.records import KVExample, QAExample
from rag_mspoe.files import atomic_write

T = TypeVar("T")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a JSON lines file (blank lines skipped); a bad line is a ValueError naming it."""
    return [record for _, _, record in _records(Path(path))]


def load_qa(path: str | os.PathLike[str]) -> list[QAExample]:
    """Multi-document QA examples: `question`, `answers`, `ctxs` (title, text, isgold, hasanswer)."""
    return _load(Path(path), QAExample.from_dict)


def load_kv(path: str | os.PathLike[str]) -> list[KVExample]:
    """Key-value retrieval examples: `ordered_kv_records` ([key, value] pairs), `key`, `value`."""
    return _load(Path(path), KVExample.from_dict)


def save_jsonl(path: str | os.PathLike[str], examples: Iterable[QAExample | KVExample]) -> None:
    """Write examples one per line, atomically: a reader sees the old file or the whole new one."""
    target = Path(path)
    text = "".join(json.dumps(example.to_dict(), ensure_ascii=False) + "\n" for example in examples)
    data = text.encode("utf-8")
    if _gzipped(target):
        data = gzip.compress(data, mtime=0)  # mtime=0: the same examples always give the same bytes
    atomic_write(target, data)


def _load(path: Path, parse: Callable[[dict[str, Any], str], T]) -> list[T]:
    examples = []
    for line_number, index, record in _records(path):
        try:
            examples.append(parse(record, str(index)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}, line {line_number}: {exc}; fix or remove that line.") from exc
    return examples


def _records(path: Path) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(line number from 1, record index from 0, record) for every non-blank line."""
    if not path.is_file():
        raise FileNotFoundError(f"No examples file at {path}; check the path.")
    index = 0
    with _open_text(path) as lines:
        try:
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"{path}, line {line_number}: not valid JSON ({exc.msg} at column {exc.colno}); "
                        "fix or remove that line."
                    ) from None
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{path}, line {line_number}: expected a JSON object, got {type(record).__name__}; "
                        "fix or remove that line."
                    )
                yield line_number, index, record
                index += 1
        except (OSError, EOFError, UnicodeDecodeError) as exc:  # a truncated or corrupt gzip stream
            raise ValueError(f"{path}: cannot be read ({exc}); the file is damaged, fetch it again.") from exc


def _open_text(path: Path) -> IO[str]:
    if _gzipped(path):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _gzipped(path: Path) -> bool:
    return path.suffix == ".gz"
