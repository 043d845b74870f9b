"""A run's input files and folders known by content.

The manifest keeps the sha256 of each input (data, questions, text, a corpus folder) beside its path
relative to the run folder. A resumed run refuses another file at the same path, since its
records would mix two versions of the data, and takes the same bytes at another path (a clone
of the repository, another machine, a renamed file) as the same input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rag_mspoe.files import path_sha256


def relative_to(folder: Path, value: Any) -> Any:
    """`value` (a setting: a string, or lists and dicts of them) with every absolute path made
    relative to the run folder, dict keys included. A run folder then names its inputs as they sit
    beside it, so it resumes wherever the two are moved together (a clone of a repository)."""
    if isinstance(value, str) and os.path.isabs(value):
        try:
            return os.path.relpath(value, folder.resolve())
        except ValueError:  # another drive: no relative path
            return value
    if isinstance(value, list):
        return [relative_to(folder, item) for item in value]
    if isinstance(value, dict):
        return {relative_to(folder, key): relative_to(folder, item) for key, item in value.items()}
    return value


def input_digests(folder: Path, paths: Sequence[str]) -> dict[str, str]:
    """Each input's sha256 (a folder's covers the files in it: `path_sha256`), by its path
    relative to the run folder."""
    return {relative_to(folder, path): path_sha256(path) for path in paths}


def refuse_changed_inputs(folder: Path, digests: Mapping[str, str], known: Mapping[str, str]) -> None:
    """Raise ValueError for an input file whose bytes differ from those the run recorded at its path."""
    for path, digest in digests.items():
        recorded = known.get(path)
        if recorded is not None and recorded != digest:
            raise ValueError(
                f"{where(folder, path)} changed since the run in {folder} started: it has sha256 {digest} "
                f"now, the run recorded sha256 {recorded}, so its records would mix two versions of the "
                "data. Restore the file (or folder) the run started with to resume it, or write into a "
                "new folder (--out) to run on this one."
            )


def take_moved_inputs(
    identity: Mapping[str, Any],
    previous: dict[str, Any],
    digests: Mapping[str, str],
    known: Mapping[str, str],
) -> None:
    """Settings of `identity` that name an input file holding the bytes the run recorded for its
    previous path: `previous` takes the new path, so the settings compare equal."""
    for name, value in identity.items():
        old = previous.get(name)
        if (
            isinstance(value, str)
            and value in digests
            and isinstance(old, str)
            and known.get(old) == digests[value]
        ):
            previous[name] = value


def unrecorded_inputs(digests: Mapping[str, str], known: Mapping[str, str]) -> list[str]:
    """Input files the run recorded no digest for, at their path or any other: it was started
    by a version that did not record its inputs."""
    recorded = set(known.values())
    return [path for path, digest in digests.items() if path not in known and digest not in recorded]


def with_digests(value: Any, digests: Mapping[str, str]) -> str:
    """A setting as an error message shows it: a path with its file's sha256, when known."""
    digest = digests.get(value) if isinstance(value, str) else None
    return f"{value!r} (sha256 {digest})" if digest else repr(value)


def where(folder: Path, path: str) -> str:
    """Where a path the manifest keeps (relative to the run folder, or absolute) points."""
    return os.path.normpath(folder.resolve() / path)
