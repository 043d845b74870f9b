"""What we need to know per architecture, keyed by `config.model_type`, read in one function."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Architecture:
    """Where the pieces are in one transformers architecture."""

    model_type: str
    modeling_module: str  # holds the module-level apply_rotary_pos_emb the attention calls
    rope_per_layer_type: bool = False  # rotary_emb(x, position_ids, layer_type), as in Gemma 3

    def module(self) -> ModuleType:
        return importlib.import_module(self.modeling_module)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "transformers.models.llama.modeling_llama"),
    "mistral": Architecture("mistral", "transformers.models.mistral.modeling_mistral"),
    "qwen2": Architecture("qwen2", "transformers.models.qwen2.modeling_qwen2"),
    "qwen3": Architecture("qwen3", "transformers.models.qwen3.modeling_qwen3"),
    "gemma3_text": Architecture(
        "gemma3_text", "transformers.models.gemma3.modeling_gemma3", rope_per_layer_type=True
    ),
}


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_of(model: nn.Module) -> Architecture:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"Architecture {model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(ARCHITECTURES))}. Load the text-only causal LM of a supported family."
        )
    return ARCHITECTURES[model_type]


def decoder(model: nn.Module) -> Any:
    """The base model holding `layers` and `rotary_emb` (model.model for *ForCausalLM)."""
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no decoder with `layers` and `rotary_emb`; "
            "pass the *ForCausalLM model."
        )
    return base


def sliding_window(attention: Any, config: Any) -> int | None:
    """The attention window of one layer, or None for full attention."""
    if hasattr(attention, "sliding_window"):  # Qwen2/3 and Gemma 3 set it per layer
        return attention.sliding_window
    return getattr(config, "sliding_window", None)  # Mistral: one window for every layer
