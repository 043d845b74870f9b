"""Ms-PoE: per-head RoPE ratios, the heads ranked by position awareness (the mechanics are in
`head_rotation` and `awareness`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rag_mspoe.methods.method_config import NUMBER, MethodConfig, check_factor, check_finite, number_argument
from rag_mspoe.rope.awareness import ranks_from_order
from rag_mspoe.rope.head_rotation import HeadPlan
from rag_mspoe.rope.rotary_scaling import RopeScaling

GqaPolicy = Literal["kv_group", "query_head"]


@dataclass
class MsPoE(RopeScaling):
    """Ms-PoE: per-head position ratios from `min_ratio` to `max_ratio` (Eq. 2 of the paper).

    Heads are ranked by the position-awareness score (Eq. 1, threshold `alpha` x the row mean)
    of the last prompt token, computed per prompt and per batch element; the most
    position-aware head gets `min_ratio`. Give `head_order` (per layer, head indices from most
    to least position-aware) to freeze the ranking instead (static Ms-PoE).

    gqa_policy, for models with grouped KV heads:
      "kv_group"   one ratio per KV head, shared by its query heads; heads are ranked by the
                   mean score of the group. The KV cache is unchanged.
      "query_head" one ratio per query head, as in the paper; keys and values are expanded to
                   one head per query head, so the KV cache grows by the group size.
    """

    kind: ClassVar[str] = "mspoe"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "mspoe": {},
        "mspoe-query-head": {"gqa_policy": "query_head"},
    }
    argument_name: ClassVar[str] = "mspoe"
    once_per_compose: ClassVar[bool] = True  # one ratio per head: two rankings cannot both apply
    min_ratio: float = 1.2
    max_ratio: float = 1.8
    skip_layers: int = 2
    alpha: float = 3.0
    gqa_policy: GqaPolicy = "kv_group"
    head_order: list[list[int]] | None = None

    def __post_init__(self) -> None:
        check_factor("min_ratio", self.min_ratio)
        check_factor("max_ratio", self.max_ratio)
        if self.max_ratio < self.min_ratio:
            raise ValueError(f"max_ratio ({self.max_ratio}) must be at least min_ratio ({self.min_ratio})")
        if self.skip_layers < 0:
            raise ValueError(f"skip_layers must be >= 0, got {self.skip_layers}")
        check_finite("alpha", self.alpha)  # a threshold, not a factor positions are divided by
        if not self.alpha > 0:
            raise ValueError(f"alpha must be a positive number, got {self.alpha!r}")
        if self.gqa_policy not in ("kv_group", "query_head"):
            raise ValueError(f"gqa_policy must be 'kv_group' or 'query_head', got {self.gqa_policy!r}")
        if self.head_order is not None:
            for layer, order in enumerate(self.head_order):
                if sorted(order) != list(range(len(order))):
                    raise ValueError(
                        f"head_order[{layer}] = {order} is not a permutation of 0..{len(order) - 1}"
                    )

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        # Split at the '-' between two numbers, not at a sign ('mspoe:-1', 'mspoe:1e-1-2').
        bounds = re.fullmatch(f"({NUMBER})-({NUMBER})", argument, re.ASCII)
        if bounds is None:
            raise ValueError(f"{part!r}: give Ms-PoE's ratio range as min-max, e.g. 'mspoe:1.2-1.8'.")
        return cls(min_ratio=number_argument(part, bounds[1]), max_ratio=number_argument(part, bounds[2]))

    @property
    def is_static(self) -> bool:
        return self.head_order is not None

    def reads_last_row(self) -> bool:
        return not self.is_static  # the per-prompt ranking reads the last prompt row

    def ratios(self, num_heads: int) -> list[float]:
        """Eq. 2: the ratios by rank, nearest 1 first (a single head gets the midpoint)."""
        if num_heads == 1:
            return [(self.min_ratio + self.max_ratio) / 2]
        step = (self.max_ratio - self.min_ratio) / (num_heads - 1)
        return [self.min_ratio + i * step for i in range(num_heads)]

    def head_plan(
        self, layer: int, factor: float, num_q: int, num_kv: int, num_layers: int
    ) -> HeadPlan | None:
        """The plan of one layer; `factor` (from uniform or layer-wise scaling) multiplies every ratio."""
        if layer < self.skip_layers:
            return None
        expand = self.gqa_policy == "query_head" and num_q != num_kv
        num_heads = num_q if self.gqa_policy == "query_head" else num_kv
        static_ranks = None
        if self.head_order is not None:
            if len(self.head_order) != num_layers:
                raise ValueError(
                    f"MsPoE.head_order has {len(self.head_order)} layers; the model has {num_layers}."
                )
            order = self.head_order[layer]
            if len(order) != num_heads:
                raise ValueError(
                    f"MsPoE.head_order[{layer}] ranks {len(order)} heads, but gqa_policy={self.gqa_policy!r} "
                    f"ranks {num_heads} heads in this model; recalibrate for this model and policy."
                )
            static_ranks = ranks_from_order(order)
        return HeadPlan(tuple(r * factor for r in self.ratios(num_heads)), static_ranks, self.alpha, expand)
