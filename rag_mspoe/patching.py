"""Apply a method to a transformers model with hooks, and remove it again, leaving the model as it was.

How it works, for every supported architecture (no copied modeling code):
- A pre-hook on the decoder notes, per forward, the attention mask and whether the forward
  starts from an empty KV cache (a prefill).
- A hook on the decoder's `rotary_emb` notes the position ids the model uses.
- Per layer, a pre-hook on `self_attn` swaps its `position_embeddings`:
  * one factor for the layer: cos/sin recomputed by the model's own rotary module at
    `position_ids / factor`, so the model's `rope_parameters` (linear, dynamic, yarn, llama3)
    still apply on top;
  * per-head ratios (Ms-PoE): a `HeadwiseRotation` object takes the place of cos; the
    architecture's module-level `apply_rotary_pos_emb`, wrapped while any model is rescaled,
    hands q and k to it. It ranks the heads (per prompt, from the last prompt row) and rotates
    each head at its own ratio.
Keys are rotated before the cache stores them, so cached decoding stays exact.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rag_mspoe.architectures import Architecture, sliding_window
from rag_mspoe.awareness import position_awareness, rank_heads, ranks_from_order
from rag_mspoe.hidden_scaling import HiddenScaleState
from rag_mspoe.hooks import ModelHooks, key_validity
from rag_mspoe.loading import model_display_name
from rag_mspoe.methods import (
    Compose,
    HiddenScale,
    LayerWise,
    MethodConfig,
    MethodSpec,
    MsPoE,
    Uniform,
    parse_method,
)

logger = logging.getLogger(__name__)

STATE_ATTR = "_rag_mspoe_state"
# Inputs up to this many tokens (decoding steps) get every rotary table of a forward in one
# call; longer ones compute each table when first needed and keep few, to bound memory.
_SHORT_INPUT = 64
_LONG_INPUT_TABLES_KEPT = 2


@dataclass(frozen=True)
class HeadPlan:
    """Ms-PoE in one layer: ratio by rank, and a fixed ranking when static."""

    ratios: tuple[float, ...]
    static_ranks: torch.Tensor | None
    alpha: float
    expand_kv: bool  # one ratio per query head with grouped KV: keys and values are expanded


@dataclass(frozen=True)
class LayerPlan:
    factor: float = 1.0
    heads: HeadPlan | None = None

    def divisors(self) -> tuple[float, ...]:
        return self.heads.ratios if self.heads else (self.factor,)


def _layer_plans(method: MethodConfig, config: Any) -> dict[int, LayerPlan]:
    num_layers = config.num_hidden_layers
    num_q = config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_q
    factors = [1.0] * num_layers
    mspoe: MsPoE | None = None
    for part in method.methods if isinstance(method, Compose) else [method]:
        if isinstance(part, Uniform):
            for layer in part.layers if part.layers is not None else range(num_layers):
                if layer >= num_layers:
                    raise ValueError(f"Uniform.layers has layer {layer}; the model has {num_layers} layers.")
                factors[layer] *= part.factor
        elif isinstance(part, LayerWise):
            factors = [f * g for f, g in zip(factors, part.layer_factors(num_layers), strict=True)]
        elif isinstance(part, MsPoE):
            mspoe = part
        else:
            raise TypeError(
                f"{type(part).__name__} is not a RoPE rescaling method this model hook can apply."
            )

    plans: dict[int, LayerPlan] = {}
    for layer in range(num_layers):
        heads = None
        if mspoe is not None and layer >= mspoe.skip_layers:
            heads = _head_plan(mspoe, layer, factors[layer], num_q, num_kv, num_layers)
        if heads is not None or factors[layer] != 1.0:
            plans[layer] = LayerPlan(factors[layer], heads)
    return plans


def _head_plan(
    method: MsPoE, layer: int, factor: float, num_q: int, num_kv: int, num_layers: int
) -> HeadPlan:
    expand = method.gqa_policy == "query_head" and num_q != num_kv
    num_heads = num_q if method.gqa_policy == "query_head" else num_kv
    static_ranks = None
    if method.head_order is not None:
        if len(method.head_order) != num_layers:
            raise ValueError(
                f"MsPoE.head_order has {len(method.head_order)} layers; the model has {num_layers}."
            )
        order = method.head_order[layer]
        if len(order) != num_heads:
            raise ValueError(
                f"MsPoE.head_order[{layer}] ranks {len(order)} heads, but gqa_policy={method.gqa_policy!r} "
                f"ranks {num_heads} heads in this model; recalibrate for this model and policy."
            )
        static_ranks = ranks_from_order(order)
    return HeadPlan(tuple(r * factor for r in method.ratios(num_heads)), static_ranks, method.alpha, expand)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RescaleState(ModelHooks):
    """The hooks of a RoPE rescaling method (uniform, layer-wise, Ms-PoE, or a composition)."""

    def __init__(self, model: nn.Module, method: MethodConfig) -> None:
        super().__init__(model, method)
        self.plans = _layer_plans(method, model.config)
        self.frozen_ranking = False
        self.head_ranks: dict[int, torch.Tensor] = {}
        self.head_scores: dict[int, torch.Tensor] = {}  # position-awareness of the last prefill
        self._divisors_by_type = self._collect_divisors()
        self._requests_by_type = self._collect_requests()

    # -- installation -------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles.append(self.decoder.rotary_emb.register_forward_hook(self._on_rotary, with_kwargs=True))
        for index, plan in self.plans.items():
            attention = self.decoder.layers[index].self_attn
            hook = functools.partial(self._on_attention, index)
            self._handles.append(attention.register_forward_pre_hook(hook, with_kwargs=True))
            if plan.heads and plan.heads.expand_kv:
                self._expand_kv(attention)
        if any(plan.heads for plan in self.plans.values()):
            _wrap_apply_rotary(self.arch)
            self._undo.append(lambda: _unwrap_apply_rotary(self.arch))

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

    def _collect_divisors(self) -> dict[Any, tuple[float, ...]]:
        """Per layer type, every divisor its layers use, sorted (one rotary call covers them)."""
        by_type: dict[Any, set[float]] = {}
        for index, plan in self.plans.items():
            by_type.setdefault(self._layer_type(index), set()).update(plan.divisors())
        return {key: tuple(sorted(values)) for key, values in by_type.items()}

    def _collect_requests(self) -> dict[Any, set[tuple[float, ...]]]:
        """Per layer type, the divisor tuples its layers ask `rope_tables` for."""
        requests: dict[Any, set[tuple[float, ...]]] = {}
        for index, plan in self.plans.items():
            requests.setdefault(self._layer_type(index), set()).add(plan.divisors())
        return requests

    def _layer_type(self, index: int) -> Any:
        if self.arch.rope_per_layer_type:
            return self.decoder.layers[index].self_attn.layer_type
        return None

    # -- hooks ----------------------------------------------------------------------------------
    def _on_rotary(self, _module: nn.Module, args: tuple, kwargs: dict, _output: Any) -> None:
        self.forward.position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)

    def _on_attention(self, index: int, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        plan = self.plans[index]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if plan.heads is None:
            cos, sin = self.rope_tables(index, hidden, (plan.factor,))
            # A model spread over GPUs (device_map="auto") computes tables where its rotary module
            # sits; each layer reads them on its own device. No copy on a single device.
            kwargs["position_embeddings"] = (cos[0].to(hidden.device), sin[0].to(hidden.device))
        else:
            kwargs["position_embeddings"] = (HeadwiseRotation(self, index, module, hidden), None)
        return args, kwargs

    # -- rotary tables --------------------------------------------------------------------------
    def rope_tables(
        self, index: int, hidden: torch.Tensor, divisors: tuple[float, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [len(divisors), B, T, D] at `position_ids / divisor`, cached per forward."""
        layer_type = self._layer_type(index)
        tables = self.forward.tables
        found = tables.get((layer_type, divisors))
        if found is not None:
            return found
        if hidden.shape[1] <= _SHORT_INPUT:
            # Decoding: one rotary call gives every table of this layer type for the whole forward,
            # so the other layers only look theirs up.
            every = self._divisors_by_type[layer_type]
            cos_all, sin_all = self._compute_rope(layer_type, hidden, every)
            for wanted in self._requests_by_type[layer_type]:
                rows = [every.index(d) for d in wanted]
                tables[(layer_type, wanted)] = (cos_all[rows], sin_all[rows])
            return tables[(layer_type, divisors)]
        # Long inputs: tables are large, so compute each when needed and keep only a few.
        if len(tables) >= _LONG_INPUT_TABLES_KEPT:
            tables.clear()
        result = self._compute_rope(layer_type, hidden, divisors)
        tables[(layer_type, divisors)] = result
        return result

    def head_tables(
        self, index: int, hidden: torch.Tensor, ratios: tuple[float, ...], ranks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, n, T, D]: each head's table at its ratio.

        Decoding eagerly on the CPU, layers with the same ranking (few distinct ones) share one
        gather per forward. Elsewhere each layer gathers its own: reading the ranking on the host
        would wait for a GPU, and would break a compiled graph.
        """
        cos_t, sin_t = self.rope_tables(index, hidden, ratios)  # [n, Bp, T, D]
        cos_t, sin_t = cos_t.to(ranks.device), sin_t.to(ranks.device)  # see _on_attention
        shared = (
            hidden.shape[1] <= _SHORT_INPUT
            and ranks.device.type == "cpu"
            and not torch.compiler.is_compiling()
        )
        if not shared:
            return _gather_heads(cos_t, ranks), _gather_heads(sin_t, ranks)
        key = (self._layer_type(index), ratios, tuple(ranks.shape), tuple(ranks.flatten().tolist()))
        found = self.forward.tables.get(key)
        if found is None:
            found = (_gather_heads(cos_t, ranks), _gather_heads(sin_t, ranks))
            self.forward.tables[key] = found
        return found

    def _compute_rope(
        self, layer_type: Any, hidden: torch.Tensor, divisors: tuple[float, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.forward.position_ids
        if positions is None:
            raise RuntimeError(
                "The decoder's rotary embedding did not run before attention; unsupported model."
            )
        positions = positions.float()
        scaled = torch.stack([positions / d for d in divisors])  # [F, Bp, T]
        flat = scaled.reshape(-1, positions.shape[-1])
        extra = (layer_type,) if self.arch.rope_per_layer_type else ()
        # .forward skips our own hook on rotary_emb, which must see only the model's call.
        cos, sin = self.decoder.rotary_emb.forward(hidden, flat, *extra)
        shape = (len(divisors), *positions.shape, cos.shape[-1])
        return cos.reshape(shape), sin.reshape(shape)

    # -- Ms-PoE ranking -------------------------------------------------------------------------
    def ranks(self, index: int, module: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[B or 1, heads] rank of each head in this layer (0 = most position-aware)."""
        heads = self.plans[index].heads
        assert heads is not None
        if heads.static_ranks is not None:
            # Moved to the model's device once, so decoding copies nothing per step.
            ranks = self.head_ranks.get(index)
            if ranks is None or ranks.device != q.device:
                ranks = self.head_ranks[index] = heads.static_ranks.to(q.device)[None]
            return ranks
        if self.forward.starts_fresh and not self.frozen_ranking:
            valid = key_validity(
                self.forward.attention_mask,
                k.shape[0],
                k.shape[2],
                sliding_window(module, self.model.config),
                k.device,
            )[:, 0]
            scores = position_awareness(q[:, :, -1], k, valid, module.scaling, heads.alpha)
            group_scores = scores.view(k.shape[0], k.shape[1], -1).mean(dim=-1)
            self.head_scores[index] = group_scores
            self.head_ranks[index] = rank_heads(group_scores)
        ranks = self.head_ranks.get(index)
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


class HeadwiseRotation:
    """Stands in for `cos` in one attention call and rotates each head at its own ratio."""

    def __init__(self, state: RescaleState, index: int, module: Any, hidden: torch.Tensor) -> None:
        self.state, self.index, self.module, self.hidden = state, index, module, hidden

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = self.state.plans[self.index].heads
        assert heads is not None
        ranks = self.state.ranks(self.index, self.module, q, k)
        cos, sin = self.state.head_tables(self.index, self.hidden, heads.ratios, ranks)  # [B, n, T, D]
        batch, num_q, length, dim = q.shape
        # Query heads of one KV group share its ratio: broadcast over the group, no copies.
        grouped = q.view(batch, k.shape[1], num_q // k.shape[1], length, dim)
        cos_q, sin_q = cos[:, :, None], sin[:, :, None]
        q_out = (grouped * cos_q + _rotate_half(grouped) * sin_q).view(batch, num_q, length, dim)
        return q_out, k * cos + _rotate_half(k) * sin


def _gather_heads(table: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """table [n, Bp, T, D] by rank, ranks [B or 1, n] -> [B, n, T, D]."""
    batch = max(ranks.shape[0], table.shape[1])
    ranks = ranks.expand(batch, -1)
    if table.shape[1] == 1:
        return table[ranks, 0]
    return table[ranks, torch.arange(batch, device=ranks.device)[:, None]]


# -- the wrapped apply_rotary_pos_emb, shared by every rescaled model of one architecture ---------
_wrap_lock = threading.Lock()
_wrap_counts: dict[str, int] = {}


def _wrap_apply_rotary(arch: Architecture) -> None:
    with _wrap_lock:
        module = arch.module()
        if _wrap_counts.get(arch.modeling_module, 0) == 0:
            original = module.apply_rotary_pos_emb

            @functools.wraps(original)
            def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):  # type: ignore[no-untyped-def]
                if isinstance(cos, HeadwiseRotation):
                    return cos.apply(q, k)
                return original(q, k, cos, sin, *args, **kwargs)

            module.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]
        _wrap_counts[arch.modeling_module] = _wrap_counts.get(arch.modeling_module, 0) + 1


def _unwrap_apply_rotary(arch: Architecture) -> None:
    with _wrap_lock:
        _wrap_counts[arch.modeling_module] -= 1
        if _wrap_counts[arch.modeling_module] == 0:
            module = arch.module()
            module.apply_rotary_pos_emb = module.apply_rotary_pos_emb.__wrapped__  # type: ignore[attr-defined]


# -- public API ------------------------------------------------------------------------------------
def rescale(model: nn.Module, method: MethodSpec) -> nn.Module:
    """Apply `method` to `model` in place and return the model. `None` leaves it unmodified.

    `method` is a config, a short name ("pi", "mspoe", ...), "calibrated" (the config shipped
    for this model) or the path of a saved config.
    A model that already has a method gets a warning and the new method replaces the old one.
    """
    method = parse_method(method, model_display_name(model))
    if getattr(model, STATE_ATTR, None) is not None:
        logger.warning("Model already rescaled with %s; replacing it.", current_method(model))
        unrescale(model)
    if method is None:
        return model
    state: ModelHooks = (
        HiddenScaleState(model, method) if isinstance(method, HiddenScale) else RescaleState(model, method)
    )
    state.install()
    setattr(model, STATE_ATTR, state)
    return model


def unrescale(model: nn.Module) -> nn.Module:
    """Remove whatever `rescale` applied; the model computes exactly what it did before."""
    state: ModelHooks | None = getattr(model, STATE_ATTR, None)
    if state is not None:
        state.uninstall()
        delattr(model, STATE_ATTR)
    return model


def current_method(model: nn.Module) -> MethodConfig | None:
    state: ModelHooks | None = getattr(model, STATE_ATTR, None)
    return state.method if state else None


@contextlib.contextmanager
def rescaled(model: nn.Module, method: MethodSpec) -> Iterator[nn.Module]:
    """Apply `method` (None: unmodified) for the duration of the block, then restore the previous one."""
    method = parse_method(method, model_display_name(model))
    previous = current_method(model)
    if previous is method:
        yield model
        return
    unrescale(model)
    try:
        yield rescale(model, method)
    finally:
        unrescale(model)
        if previous is not None:
            rescale(model, previous)


def head_ratios(model: nn.Module) -> dict[int, torch.Tensor]:
    """Ms-PoE ratios in use, per layer: [B, heads] from the last prefill, or [1, heads] when static.

    Heads are KV heads under gqa_policy="kv_group" and query heads under "query_head".
    """
    state = getattr(model, STATE_ATTR, None)
    result: dict[int, torch.Tensor] = {}
    if not isinstance(state, RescaleState):
        return result
    for index, plan in state.plans.items():
        if plan.heads is None:
            continue
        ranks = (
            plan.heads.static_ranks[None]
            if plan.heads.static_ranks is not None
            else state.head_ranks.get(index)
        )
        if ranks is not None:
            result[index] = torch.tensor(plan.heads.ratios)[ranks.cpu()]
    return result


def head_scores(model: nn.Module) -> dict[int, torch.Tensor]:
    """Position-awareness scores (Eq. 1) of the last per-prompt Ms-PoE prefill: per layer, [B, heads].

    Heads as in `head_ratios`. Empty for other methods and for static Ms-PoE, which ranks nothing.
    """
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, RescaleState):
        return {}
    return {index: scores.detach().cpu() for index, scores in state.head_scores.items()}


@contextlib.contextmanager
def frozen_head_order(model: nn.Module) -> Iterator[nn.Module]:
    """Reuse the Ms-PoE head ranking of the last prefill instead of ranking again.

    For scoring a continuation in one forward over prompt + continuation: prefill the prompt
    (which ranks the heads on its last row), then run the whole sequence inside this block.
    """
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, RescaleState):
        yield model
        return
    state.frozen_ranking = True
    try:
        yield model
    finally:
        state.frozen_ranking = False
