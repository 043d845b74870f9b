"""rag-mspoe: RoPE rescaled per head (Ms-PoE), per layer or uniformly, against 'lost in the middle'.

from rag_mspoe import load_model, rescale, unrescale, MsPoE
model, tokenizer = load_model()          # the embedded SmolLM2-135M-Instruct, offline
rescale(model, MsPoE())                  # or Uniform(1.5), LayerWise(factors=[...]), Compose([...])
unrescale(model)                         # back to the unmodified model, exactly
"""

from rag_mspoe.attention import AttentionCalibration, Pine, document_spans
from rag_mspoe.devices import DeviceError
from rag_mspoe.loading import ModelLoadError, load_model, model_display_name
from rag_mspoe.methods import (
    NAMED_METHODS,
    Compose,
    HiddenScale,
    LayerWise,
    MethodConfig,
    MsPoE,
    Uniform,
    load_method,
    method_name,
    parse_method,
)
from rag_mspoe.rope.architectures import ARCHITECTURES, UnsupportedArchitectureError
from rag_mspoe.rope.rescaling import (
    current_method,
    frozen_head_order,
    head_ratios,
    head_scores,
    rescale,
    rescaled,
    unrescale,
)

__all__ = [
    "ARCHITECTURES",
    "AttentionCalibration",
    "NAMED_METHODS",
    "Compose",
    "DeviceError",
    "HiddenScale",
    "LayerWise",
    "MethodConfig",
    "ModelLoadError",
    "MsPoE",
    "Pine",
    "Uniform",
    "UnsupportedArchitectureError",
    "current_method",
    "document_spans",
    "frozen_head_order",
    "head_ratios",
    "head_scores",
    "load_method",
    "load_model",
    "method_name",
    "model_display_name",
    "parse_method",
    "rescale",
    "rescaled",
    "unrescale",
]
