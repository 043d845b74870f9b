"""Ms-PoE: each attention head rotated at its own ratio, the ratio chosen by the head's rank.

A `HeadwiseRotation` object takes the place of `cos` in the attention's `position_embeddings`;
the architecture's module-level `apply_rotary_pos_emb`, wrapped while any model of that
architecture is rescaled, hands q and k to it. It ranks the heads (per prompt, from the last
prompt row, or from a fixed order) and rotates each head with the table of its ratio.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from rag_mspoe.rope.architectures import Architecture
from rag_mspoe.rope.awareness import position_awareness, rank_heads
from rag_mspoe.rope.hooks import ForwardInfo, key_validity
from rag_mspoe.rope.layer_tables import RotaryTables


@dataclass(frozen=True)
class HeadPlan:
    """Ms-PoE in one layer: ratio by rank, and a fixed ranking when static."""

    ratios: tuple[float, ...]
    static_ranks: torch.Tensor | None
    alpha: float
    expand_kv: bool  # one ratio per query head with grouped KV: keys and values are expanded


class HeadRanking:
    """The head ranks of every Ms-PoE layer of one model, and the scores of the last prefill."""

    def __init__(self, arch: Architecture, config: Any) -> None:
        self.arch = arch
        self.config = config
        self.frozen = False  # reuse the last prefill's ranking instead of ranking again
        self.ranks: dict[int, torch.Tensor] = {}
        self.scores: dict[int, torch.Tensor] = {}  # position-awareness of the last prefill

    def of_layer(
        self,
        index: int,
        plan: HeadPlan,
        attention: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        forward: ForwardInfo,
    ) -> torch.Tensor:
        """[B or 1, heads] rank of each head in this layer (0 = most position-aware)."""
        if plan.static_ranks is not None:
            # Moved to the model's device once, so decoding copies nothing per step.
            ranks = self.ranks.get(index)
            if ranks is None or ranks.device != q.device:
                ranks = self.ranks[index] = plan.static_ranks.to(q.device)[None]
            return ranks
        if forward.starts_fresh and not self.frozen:
            valid = key_validity(
                forward.attention_mask,
                k.shape[0],
                k.shape[2],
                self.arch.sliding_window(attention, self.config),
                k.device,
            )[:, 0]
            scores = position_awareness(q[:, :, -1], k, valid, attention.scaling, plan.alpha)
            group_scores = scores.view(k.shape[0], k.shape[1], -1).mean(dim=-1)
            self.scores[index] = group_scores
            self.ranks[index] = rank_heads(group_scores)
        ranks = self.ranks.get(index)
        if ranks is None:
            raise RuntimeError(
                "Ms-PoE ranks heads on the prompt, but this forward continues a cache it never saw. "
                "Run the prompt through the rescaled model first (or use a static head order)."
            )
        if ranks.shape[0] not in (1, q.shape[0]):  # one prompt may be continued several ways
            raise RuntimeError(
                f"The head ranking was computed for a batch of {ranks.shape[0]} prompts, but this forward "
                f"has {q.shape[0]}; decode the same batch that was prefilled."
            )
        return ranks


class RotationStandIn:
    """Stands in for `cos` in one attention call: the wrapped apply_rotary_pos_emb hands it q and
    k (before RoPE) and returns what `apply` returns."""

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@dataclass
class HeadwiseRotation(RotationStandIn):
    """Stands in for `cos` in one attention call and rotates each head at its own ratio."""

    index: int
    plan: HeadPlan
    attention: Any
    hidden: torch.Tensor
    forward: ForwardInfo
    ranking: HeadRanking
    tables: RotaryTables

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ranks = self.ranking.of_layer(self.index, self.plan, self.attention, q, k, self.forward)
        cos, sin = self.tables.for_heads(
            self.forward, self.index, self.hidden, self.plan.ratios, ranks
        )  # [B, n, T, D]
        batch, num_q, length, dim = q.shape
        # Query heads of one KV group share its ratio: broadcast over the group, no copies.
        grouped = q.view(batch, k.shape[1], num_q // k.shape[1], length, dim)
        cos_q, sin_q = cos[:, :, None], sin[:, :, None]
        q_out = (grouped * cos_q + _rotate_half(grouped) * sin_q).view(batch, num_q, length, dim)
        return q_out, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# -- the wrapped apply_rotary_pos_emb, shared by every rescaled model of one architecture ---------
_wrap_lock = threading.Lock()
_wrap_counts: dict[str, int] = {}


def wrap_apply_rotary(arch: Architecture) -> None:
    """Route `RotationStandIn`s (Ms-PoE's `HeadwiseRotation`, PINE's kept q and k) through the
    architecture's apply_rotary_pos_emb (counted)."""
    with _wrap_lock:
        module = arch.module()
        if _wrap_counts.get(arch.modeling_module, 0) == 0:
            original = module.apply_rotary_pos_emb

            @functools.wraps(original)
            def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):  # type: ignore[no-untyped-def]
                if isinstance(cos, RotationStandIn):
                    return cos.apply(q, k)
                return original(q, k, cos, sin, *args, **kwargs)

            module.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]
        _wrap_counts[arch.modeling_module] = _wrap_counts.get(arch.modeling_module, 0) + 1


def unwrap_apply_rotary(arch: Architecture) -> None:
    """Undo one `wrap_apply_rotary`; the last one restores the original function."""
    with _wrap_lock:
        _wrap_counts[arch.modeling_module] -= 1
        if _wrap_counts[arch.modeling_module] == 0:
            module = arch.module()
            module.apply_rotary_pos_emb = module.apply_rotary_pos_emb.__wrapped__  # type: ignore[attr-defined]
