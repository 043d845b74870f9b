"""The unmodified model's KV cache of each prompt through its last document, computed once.

Methods that change only what reads the documents (attention calibration, causal PINE:
`MethodConfig.keeps_rows_through_documents`) compute every row through the last document exactly
as the unmodified model does. Scoring a prompt under several of them (a sweep, a calibration
search) then needs those rows once: the cache is kept here, keyed by the tokens, and each method
runs only the question and the answer on a copy of it. For a 10-document prompt that is ~30 of
~1,300 tokens per method.

The unmodified model's answer to a prompt that starts as a kept one does (a calibrated reordering
that kept its documents' order, or moved one far down) starts from those rows too (`start_of`).
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from rag_mspoe.rope.hooks import cache_argument, grows_plainly, returned_cache

DEFAULT_MAX_BYTES = 1 << 30  # ~60 prompts of 1,300 tokens for the 0.5B in bf16, ~25 for the 1.5B
MAX_VALUES = 100_000  # numbers are small: a sweep's worth of document scores


class DocumentPrefixCache:
    """Least recently used KV caches of the unmodified `model`, up to `max_bytes` of tensors."""

    def __init__(self, model: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self._caches: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._values: OrderedDict[Hashable, float] = OrderedDict()
        self.computed = 0  # prefixes run through the model, for tests and benchmarks

    def clear(self) -> None:
        """Forget every cache (their memory goes back) and every value."""
        self._caches.clear()
        self._bytes = 0
        self._values.clear()

    def value(self, key: Hashable, compute: Callable[[], float]) -> float:
        """A number the unmodified model gives for `key` (the tokens it reads and what is read off
        them), computed once: a document scored alone again (a sweep's other gold positions, a
        second label of the same method) costs nothing."""
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        self._values[key] = compute()
        if len(self._values) > MAX_VALUES:
            self._values.popitem(last=False)
        return self._values[key]

    def copy_of(self, prefix: Sequence[int], shared: int = 0) -> Any:
        """A fresh copy of the cache after `prefix`, computed by the model as it is now (the caller
        makes sure no method is applied). shared: the length of a start that other prefixes begin
        with too (the template before a prompt's documents); it is cached on its own, and a new
        prefix runs only its rows after it."""
        key = tuple(prefix)
        if key in self._caches:
            self._caches.move_to_end(key)
        else:
            start = self.copy_of(prefix[:shared]) if 0 < shared < len(key) else None
            rows = key[shared:] if start is not None else key
            ids = torch.tensor([list(rows)], device=self.model.device)
            with torch.inference_mode():
                arguments = cache_argument(start) if start is not None else {}
                out = self.model(ids, use_cache=True, logits_to_keep=1, **arguments)
            cache = returned_cache(out)
            size = _bytes(cache)
            self.computed += 1
            self._caches[key] = (cache, size)
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._caches) > 1:
                _, (_, dropped) = self._caches.popitem(last=False)
                self._bytes -= dropped
        return copy.deepcopy(self._caches[key][0])

    def start_of(self, ids: Sequence[int], at_least: int) -> tuple[Any, int] | None:
        """(cache, length): a copy of the kept rows that share the longest start with `ids`, cut
        to that start, leaving `ids` at least its last token to read; None when no kept prefix
        shares `at_least` tokens or the model's cache cannot be cut (a sliding window)."""
        from transformers.cache_utils import DynamicCache

        wanted = tuple(ids[:-1])
        best, found = 0, None
        for key in self._caches:
            length = len(os.path.commonprefix([key, wanted]))
            if length > best:
                best, found = length, key
        if found is None or best < at_least:
            return None
        self._caches.move_to_end(found)
        cache = self._caches[found][0]
        if not grows_plainly(cache):
            return None
        kept = [
            (layer.keys[:, :, :best].clone(), layer.values[:, :, :best].clone()) for layer in cache.layers
        ]
        return DynamicCache(ddp_cache_data=kept, config=self.model.config), best


def _bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total
