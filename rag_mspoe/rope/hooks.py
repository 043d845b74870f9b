"""What every method's hooks share: per-forward facts from the decoder, and clean removal."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import transformers
from torch import nn

from rag_mspoe.methods.method_config import MethodConfig
from rag_mspoe.rope.architectures import Architecture, architecture_of


@dataclass
class ForwardInfo:
    """What one forward of the decoder tells the hooks."""

    attention_mask: torch.Tensor | None = None
    starts_fresh: bool = True  # no cached tokens before this forward: a prefill
    position_ids: torch.Tensor | None = None
    tables: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class ModelHooks:
    """Hooks one method put on one model; `uninstall` takes every one of them off again.

    Prompts prefilled one at a time can decode as one batch (`rag_mspoe.engine.joined_decode`)
    when the hooks say how to join what each prefill left them: `joins_prefills`, with
    `prefill_state` read after each prompt's prefill and `join_prefills` given them all.
    """

    # Whether `prefill_state` / `join_prefills` cover every state the hooks keep from a prefill
    # for decoding; hooks that do not say so decode only the batch they prefilled.
    joins_prefills: ClassVar[bool] = False

    def __init__(self, model: nn.Module, method: MethodConfig) -> None:
        self.model = model
        self.method = method
        self.arch: Architecture = architecture_of(model)
        self.decoder = self.arch.decoder(model)
        self.forward = ForwardInfo()
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        self._handles.append(self.decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True))
        self._install()

    def _install(self) -> None:
        raise NotImplementedError

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        for undo in reversed(self._undo):
            undo()
        self._handles.clear()
        self._undo.clear()

    def last_rows_weights(self, attention: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """Softmax weights of the last query rows of this forward from their scaled logits
        [B, H, rows, keys], masked as the model masks them: soft-capping, padding, causal
        (bottom-right), sliding window. For hooks that recompute a few rows eagerly."""
        batch, _, rows, keys = logits.shape
        logits = self.arch.soft_cap(self.model.config, logits)
        window = self.arch.sliding_window(attention, self.model.config)
        valid = key_validity(self.forward.attention_mask, batch, keys, window, logits.device, rows)
        return torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), dim=-1)

    def prefill_state(self) -> Any:
        """What decoding after the last prefill (of one unpadded prompt) reads of these hooks."""
        return None

    def join_prefills(self, states: Sequence[Any], lengths: Sequence[int]) -> None:
        """Decode as one batch the prompts whose `prefill_state`s these are, of `lengths` tokens:
        row b's cache holds its first lengths[b] - 1 tokens, left-padded to max(lengths) - 1, and
        its last prompt token comes with the first decoding step (`joined_decode`)."""

    def _on_decoder(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.forward = ForwardInfo(
            attention_mask=kwargs.get("attention_mask"),
            starts_fresh=starts_fresh(kv_cache(kwargs)),
        )


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as '5.24.0' or '5.24.0.dev0'."""
    return tuple(int(part) for part in version.split(".")[:2])


# What a forward calls its KV cache, as argument and as output field: transformers 5.24 renamed
# `past_key_values` to `cache`, still taking the old name but warning (removal due in 5.40).
CACHE_NAME = "cache" if _release(transformers.__version__) >= (5, 24) else "past_key_values"


def cache_argument(cache: Any) -> dict[str, Any]:
    """`cache` as the keyword argument a model's forward takes: `model(ids, **cache_argument(cache))`."""
    return {CACHE_NAME: cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a model's forward returned."""
    return getattr(output, CACHE_NAME)


def grows_plainly(cache: Any) -> bool:
    """Whether every layer of a KV cache keeps every row in a tensor that only grows (no sliding
    window, no fixed size): such a cache can be cut back to a start and padded to join others."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


def cache_grows_plainly(model: Any) -> bool:
    """Whether the cache `model` decodes with grows plainly (`grows_plainly`)."""
    from transformers.cache_utils import DynamicCache

    return grows_plainly(DynamicCache(config=model.config))


def kv_cache(kwargs: dict[str, Any]) -> Any:
    """The KV cache a forward was handed, or None: transformers 5.24 passes it as `cache`, earlier
    releases as `past_key_values`."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def starts_fresh(cache: Any) -> bool:
    """Whether a forward starts from an empty KV cache (a prefill).

    A compiled forward always continues a cache: prefills run eagerly (transformers' `generate`
    and our engine compile decoding steps only), and that is where Ms-PoE ranks heads and
    hidden-state scaling recomputes the last rows. Asking a static cache its length would be
    data-dependent, which breaks the compiled graph.
    """
    if cache is None:
        return True
    if torch.compiler.is_compiling():
        return False
    return bool(cache.get_seq_length() == 0)


def key_validity(
    attention_mask: torch.Tensor | None,
    batch: int,
    length: int,
    window: int | None,
    device: torch.device,
    rows: int = 1,
) -> torch.Tensor:
    """[B, rows, T] bool: which of T keys each of the last `rows` query rows of a prefill may read.

    Causal alignment is bottom-right: row r of the last `rows` sits at position T - rows + r.
    Padding (from a 2D mask, or the last row of a ready 4D mask) and sliding windows are masked.
    """
    if attention_mask is None:
        valid = torch.ones(batch, 1, length, dtype=torch.bool, device=device)
    elif attention_mask.dim() == 2:
        valid = attention_mask[:, None, -length:].to(device).bool()
    elif attention_mask.dim() == 4:
        # A ready mask: its last query row. In a prefill the keys take its first columns; a static
        # cache's mask is wider than the prompt (as wide as the cache).
        row = attention_mask[:, 0, -1:, :length].to(device)
        valid = row if row.dtype == torch.bool else row == 0
    else:
        raise ValueError(f"Cannot read an attention mask of shape {tuple(attention_mask.shape)}.")
    query_pos = torch.arange(length - rows, length, device=device)[:, None]
    key_pos = torch.arange(length, device=device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (query_pos - key_pos < window)
    return valid.expand(batch, 1, length) & allowed[None]
