"""Hooks of PINE, position-invariant inference (`Pine`).

Every layer's attention runs as usual for rows before the documents. For every query row from
the first document on (documents, question, generated tokens), per head:
- q and the documents' keys are un-rotated (RoPE is a rotation per position, so the inverse is
  exact up to rounding) to score each document position-free: log of the mean exp(q.k) over its
  tokens;
- documents get new places inside the documents' region, least important first; a query inside
  a document puts its own document last and itself at its offset there;
- RoPE is relative, so a document placed at `start` is read with its keys rotated at their
  offsets inside it and the query rotated by (query position - start);
- masks: documents read each other in full and themselves causally (`isolated`: only
  themselves, placed first, as if each stood alone after the text before the documents); the
  text after the documents reads everything before it. Values are untouched.
Rows are done in chunks, so memory stays O(chunk x keys) per head.

The output does not depend on the documents' order in any dtype, bit for bit, as far as the
model's own kernels compute a token's row alike wherever it stands (measured on CPU: they do):
- q and k come as the layer computed them before RoPE (`KeptRotation`), not un-rotated from the
  model's rotated ones, whose rounding differs with each token's position;
- every angle is a token's offset inside its document or a placed position, the same in any
  order;
- the sums over keys (softmax, values) and the sort's ties run over the documents in an order
  of their content (`content_order`), not of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from rag_mspoe.attention.document_hooks import (
    AttentionCall,
    DocumentAttentionHooks,
    RowDocuments,
    attention_scaling,
)
from rag_mspoe.models.grouped_heads import by_key_head
from rag_mspoe.rope.head_rotation import RotationStandIn, unwrap_apply_rotary, wrap_apply_rotary

ROW_CHUNK = 256


class PineHooks(DocumentAttentionHooks):
    def __init__(self, model: nn.Module, method: Any) -> None:
        super().__init__(model, method)
        config: Any = model.config
        self.bidirectional: bool = method.bidirectional
        self.important_first: bool = method.important_first
        self.softness: float = method.softness
        self.isolated: bool = method.isolated
        windowed = [
            index
            for index in self._layers
            if self.arch.sliding_window(self.decoder.layers[index].self_attn, config) is not None
        ]
        if windowed:
            raise ValueError(
                f"PINE needs full attention in every layer, but layers {windowed} of this "
                f"{config.model_type} model attend within a sliding window. Load the model with "
                "sliding windows off, leave those layers out (Pine(layers=[...])), or use "
                "attention-calibration."
            )
        self.rotate_half = self.arch.module().rotate_half

    def _install(self) -> None:
        super()._install()
        wrap_apply_rotary(self.arch)
        self._undo.append(lambda: unwrap_apply_rotary(self.arch))
        for index in self._layers:
            attention = self.decoder.layers[index].self_attn
            hook = partial(self._keep_unrotated, index)
            self._handles.append(attention.register_forward_pre_hook(hook, with_kwargs=True))

    def _keep_unrotated(self, index: int, _module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Put a `KeptRotation` in place of the layer's cos: this forward's q and k before RoPE."""
        cos, sin = kwargs["position_embeddings"]

        def keep(q: torch.Tensor, k: torch.Tensor) -> None:
            self.per_forward[f"unrotated {index}"] = q, k

        kwargs["position_embeddings"] = (
            KeptRotation(cos, sin, self.arch.module().apply_rotary_pos_emb, keep),
            None,
        )
        return args, kwargs

    def _on_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._on_decoder(module, args, kwargs)
        orders = self.per_prefill.get("content_order")
        if orders is None:  # a prefill: its documents in the order of their content
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.per_prefill["content_order"] = [
                [] if row is None else content_order(row, ids, b, self._continued)
                for b, row in enumerate(self.rows)
            ]
        elif len(orders) == 1 and len(self.rows) > 1:  # continuations of one prefilled prompt
            self.per_prefill["content_order"] = orders * len(self.rows)

    def joined_per_prefill(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Each prompt's documents' order and keys (made from its prefill's own q and k, which a
        decoding step cannot remake bit for bit) under its batch row; the widest angle tables."""
        document_keys: dict[tuple[int, int], Any] = {}
        angles: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        for b, state in enumerate(states):
            for (layer, _), made in state.get("document_keys", {}).items():
                document_keys[layer, b] = made
            for key, table in state.get("angles", {}).items():
                if key not in angles or angles[key][0].shape[0] < table[0].shape[0]:
                    angles[key] = table
        return {
            "content_order": [state["content_order"][0] for state in states],
            "document_keys": document_keys,
            "angles": angles,
        }

    def attend(self, call: AttentionCall) -> torch.Tensor:
        layer, query, key, value = call.layer, call.query, call.key, call.value
        batch, heads, queries, dim = query.shape
        keys = key.shape[2]
        past = keys - queries
        # When every row is recomputed (decoding), the original attention would be thrown away.
        every_row = all(row is not None and self._first_row(row) <= past for row in self.rows)
        output = query.new_empty(batch, queries, heads, dim) if every_row else self._rows_left_alone(call)
        device = query.device
        # Scores in fp32 at least; an fp64 model gets fp64.
        compute = torch.promote_types(query.dtype, torch.float32)
        positions = self.positions(keys, device).to(compute)
        padding = self.key_padding(batch, keys, device)
        scaling = attention_scaling(call.module, query, call.kwargs)
        layer_type = self._layer_type(layer)
        wide_keys, wide_values = key.to(compute), value.to(compute)
        kept = self.per_forward.pop(f"unrotated {layer}", None)
        if kept is not None and kept[0].shape != query.shape:
            kept = None
        for b, row in enumerate(self.rows):
            if row is None:
                continue
            fresh_keys = None if kept is None else kept[1][b].to(compute)
            document_keys = self._document_keys(
                (layer, b), row, wide_keys[b], fresh_keys, positions[b], layer_type
            )
            order = self.per_prefill["content_order"][b]
            for first in range(max(self._first_row(row) - past, 0), queries, ROW_CHUNK):
                last = min(first + ROW_CHUNK, queries)
                index = torch.arange(past + first, past + last, device=device)
                if kept is None:
                    raw_query = self._unrotate(
                        query[b, :, first:last].to(compute), positions[b][index], layer_type
                    )
                else:
                    raw_query = kept[0][b, :, first:last].to(compute)
                attended = self._rows(
                    row,
                    order,
                    raw_query,
                    index,
                    wide_keys[b],
                    wide_values[b],
                    document_keys,
                    positions[b],
                    padding[b],
                    scaling,
                    layer_type,
                )
                output[b, first:last] = attended.transpose(0, 1).to(output.dtype)
        return output

    def _rows_left_alone(self, call: AttentionCall) -> torch.Tensor:
        """[B, queries, H, D]: the model's own attention in the rows before every batch row's
        first recomputed one; later rows are for `_rows` to fill."""
        attention_mask = call.attention_mask
        batch, heads, queries, dim = call.query.shape
        past = call.key.shape[2] - queries
        if any(row is None for row in self.rows):
            kept = queries
        else:
            kept = max(max(self._first_row(row) - past for row in self.rows if row is not None), 0)
        # Causal rows read no key after their own, so those rows alone need computing. A mask
        # the kernel builds itself (None) is aligned to the first key: only right without a past.
        sliceable = (attention_mask is None and past == 0) or (
            isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
        )
        if kept >= queries or not sliceable:
            return call.model_attention().clone()
        output = call.query.new_empty(batch, queries, heads, dim)
        if kept:
            output[:, :kept] = call.model_attention(kept)
        return output

    def _first_row(self, row: RowDocuments) -> int:
        """The first query row PINE recomputes: the documents' own rows only when they read each
        other both ways; else the rows after them (question, answer), which read them re-placed."""
        return row.start if self.bidirectional else row.end

    def _rows(
        self,
        row: RowDocuments,
        order: list[int],  # the documents in the order of their content (`content_order`)
        raw_query: torch.Tensor,  # [H, R, D], before RoPE
        index: torch.Tensor,  # [R]: each query's index among the keys
        key: torch.Tensor,  # [kv heads, keys, D], rotated at the natural positions
        value: torch.Tensor,  # [kv heads, keys, D]
        document_keys: tuple[torch.Tensor, torch.Tensor],  # from `_document_keys`
        positions: torch.Tensor,  # [keys]
        padding: torch.Tensor,  # [keys] bool
        scaling: float,
        layer_type: str | None,
    ) -> torch.Tensor:
        device = raw_query.device
        spans = document_blocks(row)
        starts = [start for start, _ in spans]
        begin, end = row.start, row.end
        lengths = torch.tensor([float(e - s) for s, e in spans], device=device, dtype=raw_query.dtype)
        region_start = positions[begin]
        region_end = region_start + (end - begin)

        key_doc = torch.full((key.shape[1],), -1, dtype=torch.long, device=device)
        for d, (s, e) in enumerate(spans):
            key_doc[s:e] = d
        in_docs = index < end
        own = torch.where(in_docs, key_doc[index.clamp(max=key.shape[1] - 1)], torch.full_like(index, -1))
        own_safe = own.clamp(min=0)
        query_positions = positions[index]
        offset = index - torch.tensor(starts, device=device)[own_safe]
        # A document's query stands at its offset inside its document, the document placed
        # nearest the query (last); an isolated document reads as if it stood first.
        moved = region_start + offset if self.isolated else region_end - lengths[own_safe] + offset
        effective = torch.where(in_docs, moved, query_positions)  # [R]

        raw_keys, placed_keys = document_keys
        scores = grouped(raw_query, raw_keys.transpose(-1, -2)) * scaling  # [H, R, doc tokens]
        importance = by_document(scores, spans, begin).logsumexp(dim=-1) - lengths.log()  # [H, R, K]
        own_mask = torch.nn.functional.one_hot(own_safe, len(spans)).bool() & in_docs[:, None]
        # Placed nearest the query: the most important document (PINE), or the least important
        # one (important_first, for models that read the start of their context best).
        nearness = -importance if self.important_first else importance
        importance = nearness.masked_fill(own_mask[None], float("inf"))
        placed_starts = region_start + self._before(importance, order) @ lengths  # [H, R, K]
        if self.isolated:
            placed_starts = torch.where(own_mask[None], region_start, placed_starts)

        # Text before and after the documents keeps its positions; the query may have moved.
        placed_query = self._rotate(raw_query, effective, layer_type)
        # The query is rotated by its distance from where each document is placed (see
        # `_document_keys`); [H, K, R], document-major, so each document's queries are one block.
        distances = effective[None, None, :] - placed_starts.transpose(1, 2)
        # A smooth sort places documents between whole positions.
        per_document = self._rotate(
            raw_query[:, None], distances, layer_type, whole=self.softness == 0
        )  # [H, K, R, D]
        # Keys go document by document in the order of their content, so the sums over them
        # (softmax, values) add the same numbers in the same order whatever the prompt's order.
        columns = torch.cat(
            [
                torch.arange(begin, device=device),
                *(torch.arange(spans[d][0], spans[d][1], device=device) for d in order),
                torch.arange(end, key.shape[1], device=device),
            ]
        )
        pieces = [grouped(placed_query, key[:, :begin].transpose(-1, -2))]
        for d in order:
            s, e = spans[d]
            keys_here = placed_keys[:, s - begin : e - begin]
            pieces.append(grouped(per_document[:, d], keys_here.transpose(-1, -2)))
        pieces.append(grouped(placed_query, key[:, end:].transpose(-1, -2)))
        logits = self.arch.soft_cap(self.model.config, torch.cat(pieces, dim=-1) * scaling)

        causal = columns[None] <= index[:, None]
        key_doc_here = key_doc[columns]
        document_key = (key_doc_here >= 0)[None]
        other_document = key_doc_here[None] != own[:, None]
        # Rows after the documents (own -1) read every document.
        reads_other = ~in_docs[:, None] if self.isolated else torch.ones_like(other_document)
        visible = (
            (columns[None] < begin)
            | (document_key & ((other_document & reads_other) | (~other_document & causal)))
            | ((columns[None] >= end) & causal)
        ) & padding[columns][None]
        weights = torch.softmax(logits.masked_fill(~visible[None], float("-inf")), dim=-1)
        return grouped(weights, value[:, columns])  # [H, R, D]

    def _document_keys(
        self,
        cache_key: tuple[int, int],
        row: RowDocuments,
        key: torch.Tensor,  # [kv heads, keys, D], rotated at the natural positions
        fresh: torch.Tensor | None,  # [kv heads, this forward's keys, D] before RoPE, when kept
        positions: torch.Tensor,  # [keys]
        layer_type: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The documents' keys [kv heads, doc tokens, D] un-rotated (to score the documents), and
        rotated at their offsets inside their document (to read them where they are placed).

        Every angle is then the same in any order of the documents, and so is its rounding (the
        model's own angles, at natural positions, would carry a different rounding error into
        each order). They depend only on the layer and the batch row, so they are made once per
        prefill (`cache_key`) and serve every chunk of rows and every generated token."""
        made = self.per_prefill.setdefault("document_keys", {})
        if cache_key not in made:
            begin, end = row.start, row.end
            blocks = document_blocks(row)
            natural_starts = positions[torch.tensor([start for start, _ in blocks], device=key.device)]
            lengths = torch.tensor([block_end - start for start, block_end in blocks], device=key.device)
            offsets = positions[begin:end] - natural_starts.repeat_interleave(lengths)
            past = key.shape[1] - (0 if fresh is None else fresh.shape[1])
            if fresh is not None and begin >= past:
                raw_keys = fresh[:, begin - past : end - past]
            else:  # documents cached before this forward (by the unmodified model): un-rotated
                raw_keys = self._unrotate(key[:, begin:end], positions[begin:end], layer_type)
            made[cache_key] = raw_keys, self._rotate(raw_keys, offsets, layer_type)
        cached: tuple[torch.Tensor, torch.Tensor] = made[cache_key]
        return cached

    def _before(self, importance: torch.Tensor, order: list[int]) -> torch.Tensor:
        """[H, R, K, K]: how far document e stands before (farther from the query than) document
        d, 0 to 1, from each document's nearness score (+inf: the query's own document)."""
        gap = importance[..., :, None] - importance[..., None, :]  # [h, r, d, e]: d's score - e's
        if self.softness == 0:
            # The paper's hard sort; an exact tie goes by the documents' content, not their place.
            rank = torch.empty(len(order), dtype=torch.long, device=importance.device)
            rank[torch.tensor(order, device=importance.device)] = torch.arange(
                len(order), device=importance.device
            )
            return ((gap > 0) | ((gap == 0) & (rank[None, :] < rank[:, None]))).to(importance.dtype)
        own_with_itself = torch.eye(importance.shape[-1], dtype=torch.bool, device=importance.device)
        return torch.sigmoid(gap / self.softness).masked_fill(own_with_itself, 0.0)  # inf - inf there

    def _tables(
        self, positions: torch.Tensor, like: torch.Tensor, layer_type: str | None, whole: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., D] at positions shaped like `like` without its last axis; `whole`:
        the positions are whole numbers, read from a table made once per prefill and layer type
        (the same value for a position wherever it is needed, and no trigonometry per query)."""
        shape = (*positions.shape, like.shape[-1])
        if not whole or not positions.numel() or positions.min() < 0:
            cos, sin = self._angles(positions.reshape(1, -1), like, layer_type)
            return cos.reshape(shape), sin.reshape(shape)
        size = int(positions.max()) + 1
        tables = self.per_prefill.setdefault("angles", {})
        table_key = (layer_type, like.dtype, like.device)
        if table_key not in tables or tables[table_key][0].shape[0] < size:
            span = torch.arange(size, device=like.device, dtype=like.dtype)[None]
            tables[table_key] = self._angles(span, like, layer_type)
        cos_table, sin_table = tables[table_key]
        index = positions.long()
        return cos_table[index].reshape(shape), sin_table[index].reshape(shape)

    def _angles(
        self, positions: torch.Tensor, like: torch.Tensor, layer_type: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, D] at positions [1, N], from the model's own rotary module."""
        rotary = self.arch.rotary(self.decoder)
        # `forward`, not the module call: the position hook must only see the model's own positions.
        extra = {"layer_type": layer_type} if layer_type is not None else {}
        cos, sin = rotary.forward(like, positions, **extra)
        return cos.to(like.dtype)[0], sin.to(like.dtype)[0]

    def _rotate(
        self, x: torch.Tensor, positions: torch.Tensor, layer_type: str | None, whole: bool = True
    ) -> torch.Tensor:
        cos, sin = self._tables(positions, x, layer_type, whole)
        return x * cos + self.rotate_half(x) * sin

    def _unrotate(self, x: torch.Tensor, positions: torch.Tensor, layer_type: str | None) -> torch.Tensor:
        cos, sin = self._tables(positions, x, layer_type)
        # RoPE multiplies by a rotation times an attention scale: cos^2 + sin^2 is that scale squared.
        return (x * cos - self.rotate_half(x) * sin) / (cos * cos + sin * sin)

    def _layer_type(self, layer: int) -> str | None:
        if not self.arch.rope_per_layer_type:
            return None
        config: Any = self.model.config
        layer_type: str = config.layer_types[layer]
        return layer_type


def document_blocks(row: RowDocuments) -> list[tuple[int, int]]:
    """Each document's [start, end) with the separator after it: text between two documents
    belongs to the one before (the last ends where the documents do)."""
    starts = [start for start, _ in row.spans]
    return list(zip(starts, [*starts[1:], row.end], strict=True))


def by_document(scores: torch.Tensor, spans: list[tuple[int, int]], begin: int) -> torch.Tensor:
    """[..., doc tokens] -> [..., K, longest document]: each document's scores in a row of its
    own, -inf after its end. One reduction then scores every document, and a document's row holds
    the same values in the same places wherever it stands (so its rounding does too)."""
    longest = max(end - start for start, end in spans)
    rows = scores.new_full((*scores.shape[:-1], len(spans), longest), float("-inf"))
    for d, (start, end) in enumerate(spans):
        rows[..., d, : end - start] = scores[..., start - begin : end - begin]
    return rows


def grouped(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[H, R, X] @ [kv heads, X, Y] -> [H, R, Y] (see `by_key_head`)."""
    return by_key_head(left[None], right[None])[0]


@dataclass
class KeptRotation(RotationStandIn):
    """Stands in for `cos` in a PINE layer's attention: hands q and k, as the layer computed them
    before RoPE, to `keep`, then rotates them as the model does. PINE scores and places the
    documents from these; un-rotating the model's rotated q and k instead would carry its
    rounding, which differs with each token's position, so with the documents' order."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the architecture's apply_rotary_pos_emb
    keep: Callable[[torch.Tensor, torch.Tensor], None]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keep(q, k)
        return self.rotate(q, k, self.cos, self.sin)


def content_order(row: RowDocuments, ids: torch.Tensor | None, batch_row: int, continued: int) -> list[int]:
    """The documents' indices ordered by their tokens (`document_blocks`): the same documents give
    the same order in any order of the prompt. In prompt order when the tokens are not at hand
    (inputs_embeds, or documents in a cache this forward continues)."""
    blocks = document_blocks(row)
    if ids is None or row.start < continued:
        return list(range(len(blocks)))
    tokens = ids[batch_row].tolist()
    content: Sequence[tuple[int, ...]] = [tuple(tokens[s - continued : e - continued]) for s, e in blocks]
    return sorted(range(len(blocks)), key=lambda d: content[d])
