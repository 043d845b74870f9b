"""Every fact the hooks need about an architecture, keyed by `config.model_type`, in one table.

Code elsewhere asks the `Architecture` of a model rather than probing its modules, so adding an
architecture means adding one row here (and a tiny model to the tests).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

# Where a layer's attention window comes from: none, the attention module of each layer
# (`attention.sliding_window`, None on full-attention layers), or one value in the model config.
WindowSource = Literal["none", "per_layer", "config"]


@dataclass(frozen=True)
class Architecture:
    """Where the pieces are in one transformers architecture, and what its attention does."""

    model_type: str
    modeling_module: str  # holds the module-level apply_rotary_pos_emb the attention calls
    rotary_class: str  # the rotary embedding module's class in `modeling_module`
    window: WindowSource = "none"
    qk_norm: bool = False  # q and k normalised per head before RoPE (`q_norm`, `k_norm`)
    softcapping: bool = False  # attention logits soft-capped at `config.attn_logit_softcapping`
    rope_per_layer_type: bool = False  # rotary_emb(x, position_ids, layer_type), as in Gemma 3
    decoder_attr: str = "model"  # the *ForCausalLM attribute holding the decoder
    rotary_attr: str = "rotary_emb"  # the decoder attribute holding the rotary module

    def module(self) -> ModuleType:
        return importlib.import_module(self.modeling_module)

    def rotary_type(self) -> type[nn.Module]:
        rotary: type[nn.Module] = getattr(self.module(), self.rotary_class)
        return rotary

    def decoder(self, model: nn.Module) -> Any:
        """The base model holding `layers` and the rotary module (model.model for *ForCausalLM)."""
        base = getattr(model, self.decoder_attr, model)
        if not hasattr(base, "layers") or not hasattr(base, self.rotary_attr):
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has no decoder with `layers` and `{self.rotary_attr}`; "
                "pass the *ForCausalLM model."
            )
        return base

    def rotary(self, decoder: Any) -> nn.Module:
        rotary: nn.Module = getattr(decoder, self.rotary_attr)
        return rotary

    def sliding_window(self, attention: Any, config: Any) -> int | None:
        """The attention window of one layer, or None for full attention."""
        if self.window == "per_layer":
            window: int | None = attention.sliding_window
            return window
        if self.window == "config":
            return getattr(config, "sliding_window", None)
        return None

    def normalise_qk(
        self, attention: Any, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [B, H, T, D] as the attention normalises them before RoPE."""
        if self.qk_norm:
            return attention.q_norm(q), attention.k_norm(k)
        return q, k

    def soft_cap(self, config: Any, logits: torch.Tensor) -> torch.Tensor:
        """Attention logits as the model caps them (`tanh(logits / cap) * cap`), or as they are."""
        cap = getattr(config, "attn_logit_softcapping", None) if self.softcapping else None
        return torch.tanh(logits / cap) * cap if cap else logits


_MODELS = "transformers.models"
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", f"{_MODELS}.llama.modeling_llama", "LlamaRotaryEmbedding"),
    "mistral": Architecture(
        "mistral", f"{_MODELS}.mistral.modeling_mistral", "MistralRotaryEmbedding", window="config"
    ),
    "qwen2": Architecture(
        "qwen2", f"{_MODELS}.qwen2.modeling_qwen2", "Qwen2RotaryEmbedding", window="per_layer"
    ),
    "qwen3": Architecture(
        "qwen3", f"{_MODELS}.qwen3.modeling_qwen3", "Qwen3RotaryEmbedding", window="per_layer", qk_norm=True
    ),
    "gemma3_text": Architecture(
        "gemma3_text",
        f"{_MODELS}.gemma3.modeling_gemma3",
        "Gemma3RotaryEmbedding",
        window="per_layer",
        qk_norm=True,
        softcapping=True,
        rope_per_layer_type=True,
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
