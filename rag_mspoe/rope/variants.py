"""RoPE variants: transformers' own RoPE types (dynamic NTK, YaRN) on a model already loaded.

A variant is a second model object with the same weight tensors but its own config and rotary
modules, so it can be compared side by side with the model and with the rescaling methods.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from rag_mspoe.rope.architectures import architecture_of


def rope_variant(model: Any, rope_parameters: dict[str, Any]) -> Any:
    """A second model object with the same weight tensors (no copy) whose config sets `rope_parameters`.

    Its module tree is its own, so hooks and rotary buffers never leak into the original model.
    """
    config = copy.deepcopy(model.config)
    params = config.rope_parameters
    per_type = all(isinstance(v, dict) for v in params.values())
    for target in params.values() if per_type else [params]:
        target.update(rope_parameters)
    with torch.device("meta"):
        variant = type(model)(config)
    variant.load_state_dict(model.state_dict(), assign=True)
    device = next(model.parameters()).device
    _rebuild_rotary_modules(variant, config, device)
    buffers = dict(model.named_buffers())
    for name, buffer in list(variant.named_buffers()):
        if buffer.is_meta:
            if name not in buffers:
                raise RuntimeError(f"Cannot build a RoPE variant of {type(model).__name__}: buffer {name}.")
            owner, _, leaf = name.rpartition(".")
            variant.get_submodule(owner)._buffers[leaf] = buffers[name]
    variant.generation_config = copy.deepcopy(model.generation_config)
    variant.eval()
    base_name = getattr(model, "_rag_mspoe_name", None) or model.config.name_or_path
    variant._rag_mspoe_name = f"{base_name}[{rope_parameters.get('rope_type')}]"
    return variant


def _rebuild_rotary_modules(variant: Any, config: Any, device: Any) -> None:
    """Build the variant's rotary modules from its config: built on the meta device, they have no
    inverse frequencies, and the model's own would carry the old RoPE type."""
    rotary_type = architecture_of(variant).rotary_type()
    for name, module in list(variant.named_modules()):
        if isinstance(module, rotary_type):
            with torch.device(device):
                rebuilt = rotary_type(config=config)
            owner, _, leaf = name.rpartition(".")
            setattr(variant.get_submodule(owner) if owner else variant, leaf, rebuilt)
