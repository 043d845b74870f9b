"""The files of a model folder that decide its vectors, with a digest each: what an index records
to know its embedding model.

A path or a hub id names a model, but the files behind it can change: vectors of two models of
the same dimension would mix in one index without an error. Not only the weights and the
tokenizer decide the vectors: `config.json` (layers, heads), `modules.json` (which modules run:
pooling, Dense, Normalize), each module's folder (`1_Pooling/config.json` picks mean or CLS
pooling, `2_Dense/` holds a projection), `sentence_bert_config.json` (max length, lower case) and
`config_sentence_transformers.json` (query and document prompts) do too. So every file of the
folder counts but what the torch backend never reads: documentation, hidden files, and exports
for other runtimes and frameworks. A digest per file lets a refusal name the file that changed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Exports for other runtimes and frameworks, which sentence-transformers' torch backend does not read.
OTHER_RUNTIMES = {"onnx", "openvino"}
OTHER_FRAMEWORK_SUFFIXES = {".h5", ".msgpack", ".ot", ".onnx", ".tflite", ".mlmodel"}
DOCUMENTATION_PREFIXES = ("readme", "license", "licence", "notice")

# What versions before per-file digests hashed (for indexes that recorded only that hash).
_LEGACY_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".model"}
_LEGACY_NAMES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
}


def model_files(folder: Path) -> list[Path]:
    """The files under `folder` that decide the vectors (see the module docstring), in a fixed order."""
    found = []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if any(p.startswith(".") or p in OTHER_RUNTIMES for p in parts[:-1]) or parts[-1].startswith("."):
            continue
        name = path.name.lower()
        if name.startswith(DOCUMENTATION_PREFIXES) or path.suffix in {".md", *OTHER_FRAMEWORK_SUFFIXES}:
            continue
        if path.is_file():
            found.append(path)
    return found


def _feed(digest: Any, path: Path) -> Any:
    """`digest` (a hashlib object) updated with the bytes of `path`, read in blocks."""
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest


@dataclass(frozen=True)
class ModelFiles:
    """A model folder's files that decide its vectors, each with the sha256 of its bytes."""

    folder: Path
    digests: dict[str, str]  # path inside the folder -> "sha256:..."

    @classmethod
    def of(cls, folder: Path) -> ModelFiles:
        files = model_files(folder)
        if not any(path.suffix in _LEGACY_SUFFIXES for path in files):
            raise ValueError(f"{folder} holds no weight files to fingerprint; is it a model folder?")
        digests = {
            path.relative_to(folder).as_posix(): "sha256:" + _feed(hashlib.sha256(), path).hexdigest()
            for path in files
        }
        return cls(folder, digests)

    def changes_from(self, recorded: dict[str, str]) -> list[str]:
        """Each file that differs from `recorded` (a digests dict), named by its path."""
        changes = []
        for name in sorted(recorded.keys() | self.digests.keys()):
            if name not in self.digests:
                changes.append(f"{self.folder / name} is gone")
            elif name not in recorded:
                changes.append(f"{self.folder / name} is new")
            elif recorded[name] != self.digests[name]:
                changes.append(f"{self.folder / name} changed")
        return changes

    def legacy_fingerprint(self) -> str:
        """The one hash versions before per-file digests recorded: the weight and tokenizer files'
        paths, sizes and bytes. Indexes that hold only it are checked with it."""
        digest = hashlib.sha256()
        for path in model_files(self.folder):
            if path.suffix in _LEGACY_SUFFIXES or path.name in _LEGACY_NAMES:
                name = path.relative_to(self.folder).as_posix()
                digest.update(f"{name}\0{path.stat().st_size}\0".encode())
                _feed(digest, path)
        return "sha256:" + digest.hexdigest()
