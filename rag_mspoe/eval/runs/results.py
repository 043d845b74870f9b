"""The results file of a run: JSON lines appended batch by batch, each record written exactly once.

A record is keyed by some of its fields (a sweep: method, gold position, example id). Opening
the file repairs a torn last line (a run killed while writing), so a restarted run sees exactly
the records that were written whole, skips them, and appends the rest. One process at a time
may write into a run folder.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rag_mspoe.files import folder_lock

RESULTS_FILE = "results.jsonl"
COMPRESSED_RESULTS_FILE = "results.jsonl.gz"  # how a finished run's records are kept in a repository
SWEEP_KEY = ("method", "position", "example_id")
Key = tuple[Any, ...]


def run_lock(folder: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the run folder; a second process writing the same folder would duplicate records."""
    return folder_lock(
        folder, f"Another process is writing a run into {folder}; wait for it or use another folder (--out)."
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a results file (a torn last line is left out)."""
    if not path.is_file():
        return []
    records = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):
                break  # torn by a kill mid-write; the run that resumes rewrites it
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}, line {number}: not a JSON record ({exc.msg}); remove that line and rerun."
                ) from None
    return records


def read_run_records(folder: Path) -> list[dict[str, Any]]:
    """A run folder's records, for reading only: results.jsonl, or where only its compressed copy
    is kept (a finished run committed to a repository), results.jsonl.gz."""
    compressed = folder / COMPRESSED_RESULTS_FILE
    if (folder / RESULTS_FILE).is_file() or not compressed.is_file():
        return read_records(folder / RESULTS_FILE)
    with gzip.open(compressed, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class ResultsFile:
    """Append-only JSONL of records with the set of keys already written."""

    def __init__(self, path: Path, key_fields: tuple[str, ...] = SWEEP_KEY) -> None:
        self.path = path
        self.key_fields = key_fields
        self._repair_tail()
        self.done: set[Key] = set()
        for record in read_records(self.path):
            key = self.key(record)
            if key in self.done:
                raise ValueError(f"{self.path} holds record {key} twice; remove one copy and rerun.")
            self.done.add(key)

    def key(self, record: dict[str, Any]) -> Key:
        return tuple(record[name] for name in self.key_fields)

    def _repair_tail(self) -> None:
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            with open(self.path, "r+b") as handle:
                handle.truncate(end)

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Write records not yet present, in one write, flushed to disk; returns how many were new."""
        fresh = []
        for record in records:
            key = self.key(record)
            if key not in self.done:
                self.done.add(key)
                fresh.append(json.dumps(record, ensure_ascii=False) + "\n")
        if fresh:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("".join(fresh))
                handle.flush()
                os.fsync(handle.fileno())
        return len(fresh)
