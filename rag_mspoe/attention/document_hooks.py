"""What the hooks of every attention-level method share.

transformers calls attention through `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with q and k after RoPE and after the KV-cache update. While such a method is installed, the
model's config names a registered function (`_dispatch`) that hands each layer's call to the
method; layers the method leaves alone, and other models, get the original implementation.
Masks are built as for the original implementation.

Per forward the hooks note the padding (the 2D attention mask the decoder gets), the position
ids the model uses and, on a prefill, where each row's documents are (from `document_spans`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rag_mspoe.attention.spans import DocumentSpans, Span
from rag_mspoe.methods.method_config import MethodConfig, chosen_layers
from rag_mspoe.rope.hooks import ModelHooks, kv_cache

HOOKS_ATTR = "_rag_mspoe_document_hooks"
ORIGINAL_ATTR = "_rag_mspoe_original_attention"
IMPLEMENTATION_PREFIX = "rag_mspoe_documents_over_"


@dataclass(frozen=True)
class RowDocuments:
    """One batch row's documents as [start, end) indices of the padded sequence."""

    spans: tuple[Span, ...]

    @property
    def start(self) -> int:
        return self.spans[0][0]

    @property
    def end(self) -> int:
        return self.spans[-1][1]


@dataclass(frozen=True)
class AttentionCall:
    """One layer's call of the attention function: q, k and v as [B, heads, T, D] (after RoPE and
    the KV-cache update), the mask and the other arguments the layer passed (`kwargs`), and the
    model's own attention function (`original`), for the rows a method leaves as they are."""

    layer: int
    module: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: Any
    kwargs: dict[str, Any]
    original: Callable[..., Any]

    def model_attention(self, rows: int | None = None) -> torch.Tensor:
        """[B, rows, H, D]: the model's own attention output of the first `rows` query rows (None:
        all). Causal rows read no key after their own, so only the keys up to the last row are read."""
        query, key, value, mask = self.query, self.key, self.value, self.attention_mask
        if rows is not None:
            width = key.shape[2] - query.shape[2] + rows
            query, key, value = query[:, :, :rows], key[:, :, :width], value[:, :, :width]
            mask = None if mask is None else mask[:, :, :rows, :width]
        output: torch.Tensor = self.original(self.module, query, key, value, mask, **self.kwargs)[0]
        return output


class DocumentAttentionMethod(MethodConfig):
    """What the config of a method these hooks run declares: it needs the documents' spans, and it
    runs in the layers of its `layers` field (None: every layer)."""

    layers: list[int] | None

    def needs_document_spans(self) -> bool:
        return True

    def layer_indices(self, num_layers: int) -> list[int]:
        return chosen_layers(type(self).__name__, self.layers, num_layers)


class DocumentAttentionHooks(ModelHooks):
    """Routes the attention of the method's layers to `attend`; tracks spans, padding and positions."""

    joins_prefills = True  # a prefill leaves its rows' documents and `per_prefill`

    def __init__(self, model: nn.Module, method: DocumentAttentionMethod) -> None:
        super().__init__(model, method)
        self._layers = method.layer_indices(len(self.decoder.layers))
        self._spans: DocumentSpans | None = None
        # Spans given since the last prefill: the next forward reads them even if the cache it
        # continues was filled before (by the unmodified model, for a method that leaves the rows
        # through the documents as they are: `MethodConfig.keeps_rows_through_documents`).
        self._spans_pending = False
        self._continued = 0  # keys cached before this forward, when it is such a prefill
        self.rows: list[RowDocuments | None] = []  # per batch row, from the last prefill
        self.prompt_length = 0  # tokens in the last prefill, padding included
        self.key_positions: torch.Tensor | None = None  # [B, keys]: position id of every cached key
        self._positions_stale = True
        # What every layer of one forward would compute alike (key membership, ...), by name.
        self.per_forward: dict[str, Any] = {}
        # What holds from one prefill until the next (per-layer tables of its documents), by name.
        self.per_prefill: dict[str, Any] = {}

    @contextlib.contextmanager
    def given_spans(self, spans: DocumentSpans) -> Iterator[None]:
        """The spans of the prompts the next prefill runs (see `document_spans`)."""
        previous = self._spans, self._spans_pending
        self._spans, self._spans_pending = spans, True
        try:
            yield
        finally:
            self._spans, self._spans_pending = previous

    def prefill_state(self) -> Any:
        return self.rows, self.per_prefill

    def join_prefills(self, states: Sequence[Any], lengths: Sequence[int]) -> None:
        width = max(lengths)
        self.rows = []
        for (rows, _), length in zip(states, lengths, strict=True):
            (row,) = rows  # a prompt prefilled alone
            pad = width - length  # its tokens start after the left padding
            self.rows.append(
                None if row is None else RowDocuments(tuple((s + pad, e + pad) for s, e in row.spans))
            )
        self.prompt_length = width
        # Each prompt's own position ids from 0 (each was prefilled unpadded); padding 0, as
        # generate numbers it. The last prompt token's comes with the first decoding step.
        positions = torch.zeros(len(lengths), width - 1, dtype=torch.long)
        for b, length in enumerate(lengths):
            positions[b, width - length :] = torch.arange(length - 1)
        model: Any = self.model
        self.key_positions = positions.to(model.device)
        self._continued = 0
        self.per_prefill = self.joined_per_prefill([per_prefill for _, per_prefill in states])

    def joined_per_prefill(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """`per_prefill` of prompts decoded as one batch from theirs, each made by a prefill of
        one prompt: empty here, for methods whose tables are rebuilt from `rows` when needed."""
        return {}

    def layers(self) -> list[int]:
        """The layers whose attention goes to `attend`."""
        return self._layers

    def attend(self, call: AttentionCall) -> torch.Tensor:
        """The attention output [B, Tq, H, D] of one layer's call."""
        raise NotImplementedError

    def _install(self) -> None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config: Any = self.model.config
        original = config._attn_implementation or "eager"
        if original.startswith(IMPLEMENTATION_PREFIX):
            raise RuntimeError(
                "Another attention-level method is still installed; unrescale the model first."
            )
        name = IMPLEMENTATION_PREFIX + original
        ALL_ATTENTION_FUNCTIONS.register(name, _dispatch)
        if original in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
        original_function = ALL_ATTENTION_FUNCTIONS.get_interface(original, self._eager())
        chosen = set(self.layers())
        for index, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            setattr(attention, ORIGINAL_ATTR, original_function)
            if index in chosen:
                setattr(attention, HOOKS_ATTR, self)
        config._attn_implementation = name
        self._undo.append(lambda: self._restore(original))
        rotary = self.arch.rotary(self.decoder)
        self._handles.append(rotary.register_forward_hook(self._on_rotary, with_kwargs=True))

    def _eager(self) -> Callable[..., Any]:
        eager: Callable[..., Any] = self.arch.module().eager_attention_forward
        return eager

    def _restore(self, original: str) -> None:
        config: Any = self.model.config
        config._attn_implementation = original
        for layer in self.decoder.layers:
            for attr in (HOOKS_ATTR, ORIGINAL_ATTR):
                if hasattr(layer.self_attn, attr):
                    delattr(layer.self_attn, attr)

    def _on_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._on_decoder(module, args, kwargs)
        self._positions_stale = True
        self.per_forward = {}
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        if inputs is None:
            raise ValueError("The decoder was called without input_ids or inputs_embeds.")
        batch, length = inputs.shape[0], inputs.shape[1]
        self._continued = 0
        if self.forward.starts_fresh or self._spans_pending:
            cache: Any = kv_cache(kwargs)  # not fresh: a cache with keys in it
            self._continued = 0 if self.forward.starts_fresh else int(cache.get_seq_length())
            if self._continued and kwargs.get("attention_mask") is not None:
                raise ValueError(
                    "A prefill that continues a cache is supported for unpadded prompts only; "
                    "pass no attention mask."
                )
            self._spans_pending = False
            self.per_prefill = {}
            self.rows = self._row_documents(batch, self._continued + length)
            self.prompt_length = self._continued + length
        elif len(self.rows) == 1 and batch > 1:
            # Several continuations of one prefilled prompt (its cache expanded to the batch).
            self.rows = self.rows * batch

    def _on_rotary(self, _module: nn.Module, args: tuple, kwargs: dict, _output: Any) -> None:
        self.forward.position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)

    def _row_documents(self, batch: int, length: int) -> list[RowDocuments | None]:
        if self._spans is None:
            raise ValueError(
                f"{type(self.method).__name__} needs to know where the documents are in the prompt. Run "
                "the model inside `with rag_mspoe.attention.document_spans(model, spans):`, with one "
                "list of (start, end) token spans per batch row: from rag_mspoe.attention.prompt_with_spans "
                "(character spans from PackedPrompt.document_spans or eval's qa_prompt_with_spans); "
                "an empty list for a prompt without documents."
            )
        if len(self._spans) != batch:
            raise ValueError(
                f"The document spans have {len(self._spans)} rows but the batch has {batch} prompts; "
                "give one list of spans per prompt."
            )
        mask = self.forward.attention_mask
        rows: list[RowDocuments | None] = []
        for index, spans in enumerate(self._spans.rows):
            # Left padding shifts a row's tokens right; its first real token is the mask's first 1.
            offset = 0
            if mask is not None and mask.dim() == 2:
                offset = int(mask[index, -length:].to(torch.int64).argmax())
            if spans and spans[-1][1] + offset > length:
                raise ValueError(
                    f"Row {index}: a document span ends at token {spans[-1][1]} but the prompt has "
                    f"{length - offset} tokens; the spans belong to another prompt."
                )
            shifted = tuple((start + offset, end + offset) for start, end in spans)
            rows.append(RowDocuments(shifted) if shifted else None)
        return rows

    def positions(self, keys: int, device: torch.device) -> torch.Tensor:
        """[B, keys] position ids of every key, this forward's tokens last."""
        if self._positions_stale:
            current = self.forward.position_ids
            if current is None:
                raise ValueError("The model computed no position ids; cannot place the documents.")
            current = current.to(device)
            if self.forward.starts_fresh:
                earlier = None
            elif self._continued:  # a prefill continuing a cache filled without the method
                earlier = torch.arange(self._continued, device=device)[None]
            else:
                earlier = self.key_positions
            if earlier is not None and earlier.shape[0] != current.shape[0]:
                batch = max(earlier.shape[0], current.shape[0])
                earlier, current = earlier.expand(batch, -1), current.expand(batch, -1)
            self.key_positions = current if earlier is None else torch.cat([earlier, current], dim=1)
            self._positions_stale = False
        assert self.key_positions is not None
        positions = self.key_positions
        if positions.shape[1] != keys:
            raise ValueError(
                f"The KV cache holds {keys} keys but {positions.shape[1]} tokens went through the model "
                "since the last prefill; attention-level methods need a dynamic cache from one prefill."
            )
        return positions.expand(len(self.rows) or positions.shape[0], -1)

    def key_padding(self, batch: int, keys: int, device: torch.device) -> torch.Tensor:
        """[B, keys] bool: which keys are real tokens (not padding)."""
        mask = self.forward.attention_mask
        if mask is None or mask.dim() != 2:
            return torch.ones(batch, keys, dtype=torch.bool, device=device)
        return mask[:, -keys:].to(device).bool()


def _dispatch(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered while an attention-level method is installed."""
    hooks: DocumentAttentionHooks | None = getattr(module, HOOKS_ATTR, None)
    original = getattr(module, ORIGINAL_ATTR, None)
    if original is None:
        raise RuntimeError(
            "This model's config names the attention of a rag_mspoe method that is no longer installed; "
            "restore config._attn_implementation (e.g. 'sdpa')."
        )
    if hooks is None or all(row is None for row in hooks.rows):
        return original(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    call = AttentionCall(module.layer_idx, module, query, key, value, attention_mask, kwargs, original)
    return hooks.attend(call), None


def attention_scaling(module: Any, query: torch.Tensor, kwargs: dict[str, Any]) -> float:
    """The factor on q.k the layer asked for (its `scaling`), else 1/sqrt(head dim)."""
    scaling: float = kwargs.get("scaling", getattr(module, "scaling", None)) or query.shape[-1] ** -0.5
    return scaling


def row_membership(rows: list[RowDocuments | None], keys: int, device: torch.device) -> torch.Tensor:
    """[B, keys, K] float: 1 where key j is a token of document k (K the most documents of a row)."""
    most = max((len(row.spans) for row in rows if row is not None), default=0)
    member = torch.zeros(len(rows), keys, most, device=device)
    for b, row in enumerate(rows):
        if row is None:
            continue
        for k, (start, end) in enumerate(row.spans):
            member[b, start:end, k] = 1.0
    return member
