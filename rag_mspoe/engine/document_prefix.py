"""The unmodified model's KV cache of each prompt through its last document, computed once.

Methods that change only what reads the documents (attention calibration, causal PINE:
`MethodConfig.keeps_rows_through_documents`) compute every row through the last document exactly
as the unmodified model does. Scoring a prompt under several of them (a sweep, a calibration
search) then needs those rows once: the cache is kept here, keyed by the tokens, and each method
runs only the question and the answer on a copy of it. For a 10-document prompt that is ~30 of
~1,300 tokens per method.

The unmodified model's answer to a prompt that starts as a kept one does (a calibrated reordering
that kept its documents' order, or moved one far down) starts from those rows too (`start_of`).

A pass that reads only the lower layers (a ranking by the attention of layers 12-17) asks for
those alone (`first_layers_of`): the upper layers run later, from the hidden states kept beside
the rows, only if the whole rows are wanted, so a ranking that moves a document and leaves the
rows unused has not paid for them.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rag_mspoe.models.decoder_stack import cuts_at, first_layers, upper_layers
from rag_mspoe.rope.hooks import cache_argument, grows_plainly, returned_cache

DEFAULT_MAX_BYTES = 1 << 30  # ~60 prompts of 1,300 tokens for the 0.5B in bf16, ~25 for the 1.5B
MAX_VALUES = 100_000  # numbers are small: a sweep's worth of document scores


@dataclass
class _Kept:
    """One kept prefix: its cache, and while only its first `layers` layers hold rows, the hidden
    states the last of them returned (from which the rest are made)."""

    cache: Any
    layers: int | None = None
    hidden: torch.Tensor | None = None
    size: int = field(init=False)  # bytes of tensors held

    def __post_init__(self) -> None:
        self.size = _bytes(self.cache) + (0 if self.hidden is None else _bytes_of(self.hidden))


class DocumentPrefixCache:
    """Least recently used KV caches of the unmodified `model`, up to `max_bytes` of tensors."""

    def __init__(self, model: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self._caches: OrderedDict[tuple[int, ...], _Kept] = OrderedDict()
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
        return self.remember(key, compute())

    def remember(self, key: Hashable, value: float) -> float:
        """Keep `value` for `key` (computed together with others), as `value` would; returns it."""
        self._values[key] = value
        self._values.move_to_end(key)
        if len(self._values) > MAX_VALUES:
            self._values.popitem(last=False)
        return value

    def knows(self, key: Hashable) -> bool:
        """Whether a value is kept for `key` (`value` would compute nothing)."""
        return key in self._values

    def copy_of(self, prefix: Sequence[int], shared: int = 0) -> Any:
        """A fresh copy of the cache after `prefix`, computed by the model as it is now (the caller
        makes sure no method is applied). shared: the length of a start that other prefixes begin
        with too (the template before a prompt's documents); it is cached on its own, and a new
        prefix runs only its rows after it."""
        key = tuple(prefix)
        if key in self._caches:
            self._caches.move_to_end(key)
            self._complete(key)
        else:
            start = self.copy_of(prefix[:shared]) if 0 < shared < len(key) else None
            rows = key[shared:] if start is not None else key
            ids = torch.tensor([list(rows)], device=self.model.device)
            with torch.inference_mode():
                arguments = cache_argument(start) if start is not None else {}
                out = self.model(ids, use_cache=True, logits_to_keep=1, **arguments)
            self.computed += 1
            self._keep(key, _Kept(returned_cache(out)))
        return copy.deepcopy(self._caches[key].cache)

    def first_layers_of(self, prefix: Sequence[int], layers: int) -> Any:
        """A fresh copy of the cache after `prefix` whose first `layers` decoder layers hold rows
        (the others may be empty): a pass that reads no layer above them runs on it with the model
        cut there (`rag_mspoe.models.decoder_stack.first_layers`). A kept whole prefix is copied as
        it is; a model that cannot be cut gets the whole cache (`copy_of`)."""
        key = tuple(prefix)
        kept = self._caches.get(key)
        if kept is not None and (kept.layers is None or kept.layers >= layers):
            self._caches.move_to_end(key)
            return copy.deepcopy(kept.cache)
        if not cuts_at(self.model, layers):
            return self.copy_of(prefix)
        ids = torch.tensor([list(key)], device=self.model.device)
        with first_layers(self.model, layers) as outputs, torch.inference_mode():
            out = self.model(ids, use_cache=True, logits_to_keep=1)
        self.computed += 1
        self._keep(key, _Kept(returned_cache(out), layers, outputs[-1]))
        return copy.deepcopy(self._caches[key].cache)

    def _keep(self, key: tuple[int, ...], kept: _Kept) -> None:
        """Keep `kept` for `key` (in place of what was kept for it), dropping the least recently
        used past `max_bytes`."""
        if key in self._caches:
            self._bytes -= self._caches.pop(key).size
        self._caches[key] = kept
        self._bytes += kept.size
        while self._bytes > self.max_bytes and len(self._caches) > 1:
            _, dropped = self._caches.popitem(last=False)
            self._bytes -= dropped.size

    def _complete(self, key: tuple[int, ...]) -> None:
        """Make the upper layers' rows of a prefix kept with its first layers only, from the
        hidden states kept with it: the rows one full forward makes."""
        from transformers.cache_utils import DynamicCache

        kept = self._caches[key]
        if kept.layers is None:
            return
        upper = DynamicCache(config=self.model.config)
        with upper_layers(self.model, kept.layers), torch.inference_mode():
            self.model(inputs_embeds=kept.hidden, use_cache=True, logits_to_keep=1, **cache_argument(upper))
        layers = kept.cache.layers[: kept.layers] + upper.layers[kept.layers :]
        rows = [(layer.keys, layer.values) for layer in layers]
        self._keep(key, _Kept(DynamicCache(ddp_cache_data=rows, config=self.model.config)))

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
        self._complete(found)
        cache = self._caches[found].cache
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
                total += _bytes_of(tensor)
    return total


def _bytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
