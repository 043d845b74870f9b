"""Hooks of the RoPE rescaling methods (uniform, layer-wise, Ms-PoE, or a composition of them),
and `RopeScaling`, the base of their configs.

How it works, for every supported architecture (no copied modeling code):
- A pre-hook on the decoder notes, per forward, the attention mask and whether the forward
  starts from an empty KV cache (a prefill) (`hooks.ModelHooks`).
- A hook on the decoder's rotary module notes the position ids the model uses.
- Per layer, a pre-hook on `self_attn` swaps its `position_embeddings`:
  * one factor for the layer: cos/sin recomputed at `position_ids / factor` (`layer_tables`);
  * per-head ratios (Ms-PoE): a `HeadwiseRotation` in place of cos (`head_rotation`).
Keys are rotated before the cache stores them, so cached decoding stays exact.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rag_mspoe.methods.method_config import Compose, MethodConfig
from rag_mspoe.rope.head_rotation import (
    HeadPlan,
    HeadRanking,
    HeadwiseRotation,
    unwrap_apply_rotary,
    wrap_apply_rotary,
)
from rag_mspoe.rope.hooks import ModelHooks
from rag_mspoe.rope.layer_tables import RotaryTables


@dataclass(frozen=True)
class LayerPlan:
    factor: float = 1.0
    heads: HeadPlan | None = None

    def divisors(self) -> tuple[float, ...]:
        return self.heads.ratios if self.heads else (self.factor,)


def layer_plans(method: MethodConfig, config: Any) -> dict[int, LayerPlan]:
    """The plan of every layer the method changes; layer factors multiply, per-head ratios on top."""
    num_layers = config.num_hidden_layers
    num_q = config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_q
    parts = method.methods if isinstance(method, Compose) else [method]
    rope_parts = [part for part in parts if isinstance(part, RopeScaling)]
    if len(rope_parts) != len(parts):
        other = next(part for part in parts if not isinstance(part, RopeScaling))
        raise TypeError(f"{type(other).__name__} is not a RoPE rescaling method this model hook can apply.")
    factors = [1.0] * num_layers
    for part in rope_parts:
        factors = [f * g for f, g in zip(factors, part.layer_factors(num_layers), strict=True)]

    plans: dict[int, LayerPlan] = {}
    for layer in range(num_layers):
        plans_of_parts = (
            part.head_plan(layer, factors[layer], num_q, num_kv, num_layers) for part in rope_parts
        )
        heads = next((plan for plan in plans_of_parts if plan is not None), None)
        if heads is not None or factors[layer] != 1.0:
            plans[layer] = LayerPlan(factors[layer], heads)
    return plans


class RotaryScaleState(ModelHooks):
    """The hooks of a RoPE rescaling method on one model."""

    # Rotations follow each row's position ids; per-prompt Ms-PoE's head ranks are the only
    # state a prefill leaves.
    joins_prefills = True

    def __init__(self, model: nn.Module, method: MethodConfig) -> None:
        super().__init__(model, method)
        self.plans = layer_plans(method, model.config)
        self.tables = RotaryTables(
            self.arch, self.decoder, {index: plan.divisors() for index, plan in self.plans.items()}
        )
        self.ranking = HeadRanking(self.arch, model.config)

    def prefill_state(self) -> Any:
        return dict(self.ranking.ranks), dict(self.ranking.scores)

    def join_prefills(self, states: Sequence[Any], lengths: Sequence[int]) -> None:
        for index, plan in self.plans.items():
            if plan.heads is not None and plan.heads.static_ranks is None:  # ranked per prompt
                self.ranking.ranks[index] = torch.cat([ranks[index] for ranks, _ in states])
                self.ranking.scores[index] = torch.cat([scores[index] for _, scores in states])

    def _install(self) -> None:
        self._handles.append(self.tables.rotary.register_forward_hook(self._on_rotary, with_kwargs=True))
        for index, plan in self.plans.items():
            attention = self.decoder.layers[index].self_attn
            hook = functools.partial(self._on_attention, index)
            self._handles.append(attention.register_forward_pre_hook(hook, with_kwargs=True))
            if plan.heads and plan.heads.expand_kv:
                self._expand_kv(attention)
        if any(plan.heads for plan in self.plans.values()):
            wrap_apply_rotary(self.arch)
            self._undo.append(lambda: unwrap_apply_rotary(self.arch))

    def _expand_kv(self, attention: Any) -> None:
        groups = attention.num_key_value_groups
        head_dim = attention.head_dim

        def repeat_heads(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            heads = output.view(*output.shape[:-1], -1, head_dim).repeat_interleave(groups, dim=-2)
            return heads.flatten(-2)

        self._handles.append(attention.k_proj.register_forward_hook(repeat_heads))
        self._handles.append(attention.v_proj.register_forward_hook(repeat_heads))
        attention.num_key_value_groups = 1

        def restore() -> None:
            attention.num_key_value_groups = groups

        self._undo.append(restore)

    def _on_rotary(self, _module: nn.Module, args: tuple, kwargs: dict, _output: Any) -> None:
        self.forward.position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)

    def _on_attention(self, index: int, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        plan = self.plans[index]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if plan.heads is None:
            cos, sin = self.tables.for_layer(self.forward, index, hidden, (plan.factor,))
            # A model spread over GPUs (device_map="auto") computes tables where its rotary module
            # sits; each layer reads them on its own device. No copy on a single device.
            kwargs["position_embeddings"] = (cos[0].to(hidden.device), sin[0].to(hidden.device))
        else:
            rotation = HeadwiseRotation(
                index, plan.heads, module, hidden, self.forward, self.ranking, self.tables
            )
            kwargs["position_embeddings"] = (rotation, None)
        return args, kwargs


@dataclass
class RopeScaling(MethodConfig):
    """Base of the configs these hooks apply: a method that divides RoPE positions per layer
    (`layer_factors`) and possibly per head (`head_plan`). Such methods compose: their layer
    factors multiply, and per-head ratios are multiplied by them."""

    hooks: ClassVar[Any] = RotaryScaleState
    composes: ClassVar[bool] = True

    def layer_factors(self, num_layers: int) -> list[float]:
        """The position divisor of every layer (1.0: unchanged)."""
        return [1.0] * num_layers

    def shares_prompt_prefixes(self) -> bool:
        # Fixed rotations per layer and head; only a ranking read from the prompt's last row
        # (per-prompt Ms-PoE) makes a start depend on what follows it.
        return not self.reads_last_row()

    def head_plan(
        self, layer: int, factor: float, num_q: int, num_kv: int, num_layers: int
    ) -> HeadPlan | None:
        """Per-head ratios in one layer (already multiplied by the layer's `factor`), or None."""
        return None
