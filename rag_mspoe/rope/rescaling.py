"""Apply a method to a transformers model with hooks, and remove it again, leaving the model as it was."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from rag_mspoe.methods.method_config import AppliedHooks, MethodConfig
from rag_mspoe.methods.method_spec import MethodSpec, parse_method
from rag_mspoe.models.loading import model_display_name
from rag_mspoe.rope.rotary_scaling import RotaryScaleState

logger = logging.getLogger(__name__)

STATE_ATTR = "_rag_mspoe_state"


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
    state = method.hooks_class()(model, method)
    state.install()
    setattr(model, STATE_ATTR, state)
    return model


def unrescale(model: nn.Module) -> nn.Module:
    """Remove whatever `rescale` applied; the model computes exactly what it did before."""
    state: AppliedHooks | None = getattr(model, STATE_ATTR, None)
    if state is not None:
        state.uninstall()
        delattr(model, STATE_ATTR)
    return model


def current_method(model: nn.Module) -> MethodConfig | None:
    state: AppliedHooks | None = getattr(model, STATE_ATTR, None)
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
    if not isinstance(state, RotaryScaleState):
        return result
    for index, plan in state.plans.items():
        if plan.heads is None:
            continue
        ranks = (
            plan.heads.static_ranks[None]
            if plan.heads.static_ranks is not None
            else state.ranking.ranks.get(index)
        )
        if ranks is not None:
            result[index] = torch.tensor(plan.heads.ratios)[ranks.cpu()]
    return result


def head_scores(model: nn.Module) -> dict[int, torch.Tensor]:
    """Position-awareness scores (Eq. 1) of the last per-prompt Ms-PoE prefill: per layer, [B, heads].

    Heads as in `head_ratios`. Empty for other methods and for static Ms-PoE, which ranks nothing.
    """
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, RotaryScaleState):
        return {}
    return {index: scores.detach().cpu() for index, scores in state.ranking.scores.items()}


@contextlib.contextmanager
def frozen_head_order(model: nn.Module) -> Iterator[nn.Module]:
    """Reuse the Ms-PoE head ranking of the last prefill instead of ranking again.

    For scoring a continuation in one forward over prompt + continuation: prefill the prompt
    (which ranks the heads on its last row), then run the whole sequence inside this block.
    """
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, RotaryScaleState):
        yield model
        return
    state.ranking.frozen = True
    try:
        yield model
    finally:
        state.ranking.frozen = False
