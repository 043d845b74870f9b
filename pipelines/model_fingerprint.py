"""A content fingerprint of a model folder: what an index records to know its embedding model.

A path or a hub id names a model, but the files behind it can change: vectors of two models of
the same dimension would mix in one index without an error. The fingerprint hashes the files
that decide the vectors, the weights and the tokenizer, so another model at the same path shows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth"}
TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
}
TOKENIZER_SUFFIXES = {".model"}  # sentencepiece
# Exports for other runtimes, which sentence-transformers' torch backend does not read.
OTHER_RUNTIMES = {"onnx", "openvino"}


def model_files(folder: Path) -> list[Path]:
    """The weight and tokenizer files under `folder`, in a fixed order."""
    found = []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if any(p.startswith(".") or p in OTHER_RUNTIMES for p in parts[:-1]) or parts[-1].startswith("."):
            continue
        name = path.name
        is_model_file = path.suffix in WEIGHT_SUFFIXES | TOKENIZER_SUFFIXES or name in TOKENIZER_FILES
        if is_model_file and path.is_file():
            found.append(path)
    return found


def fingerprint(folder: Path) -> str:
    """sha256 over the weight and tokenizer files (their paths inside the folder and their bytes)."""
    files = model_files(folder)
    if not files:
        raise ValueError(f"{folder} holds no weight or tokenizer files to fingerprint; is it a model folder?")
    digest = hashlib.sha256()
    for path in files:
        name = path.relative_to(folder).as_posix()
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()
