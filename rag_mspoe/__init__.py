"""rag-mspoe: RoPE rescaled per head (Ms-PoE), per layer or uniformly, against 'lost in the middle'.

    from rag_mspoe import load_model, rescale, unrescale, MsPoE
    model, tokenizer = load_model()          # the embedded SmolLM2-135M-Instruct, offline
    rescale(model, MsPoE())                  # or Uniform(1.5), LayerWise(factors=[...]), Compose([...])
    unrescale(model)                         # back to the unmodified model, exactly

What this package exports:

Loading
    load_model            a model and tokenizer: the embedded default, a local folder, a hub id, a GGUF file
    model_display_name    the name a loaded model goes by (in results, server model names, 'calibrated')
    Engine                generation and scoring over one model (chat template, batches, streaming);
                          imported on first use, since it loads transformers
    EngineLike            what code driving a model needs of an engine (a Protocol `Engine` meets)
    ModelLoadError        a model source that cannot be loaded; the message says what to do
    DeviceError           a device or dtype the machine cannot give
Methods (configs; `rag_mspoe.methods.method_config` says how to add one)
    MethodConfig          the base of every method config
    Uniform, LayerWise, MsPoE, HiddenScale, Compose   the built-in methods
    AttentionCalibration, Pine   attention-level methods that need the documents' spans
    document_spans        the documents' token spans for the forwards inside a `with` block
    NAMED_METHODS         the preset names users can type ("pi", "mspoe", "layerwise", ...)
    parse_method          the config a spec means ("mspoe", "pi:2", "layerwise+pi", a saved path)
    load_method           a config saved with `config.save(folder)`
    method_name           a config's short display name
Applying a method to a model
    rescale, unrescale    put a method's hooks on a model, take them off (bit-identical after)
    rescaled              a method for the duration of a `with` block
    current_method        the method a model has, or None
    head_ratios, head_scores   Ms-PoE's per-head ratios and position-awareness scores of the last prefill
    frozen_head_order     reuse the last prefill's Ms-PoE ranking (scoring prompt + continuation)
Architectures
    ARCHITECTURES         every supported architecture's facts, keyed by config.model_type
    UnsupportedArchitectureError   a model whose architecture is not in ARCHITECTURES
"""

from typing import TYPE_CHECKING, Any

from rag_mspoe.attention.spans import document_spans
from rag_mspoe.methods import (
    NAMED_METHODS,
    AttentionCalibration,
    Compose,
    HiddenScale,
    LayerWise,
    MethodConfig,
    MsPoE,
    Pine,
    Uniform,
    load_method,
    method_name,
    parse_method,
)
from rag_mspoe.models.devices import DeviceError
from rag_mspoe.models.loading import load_model, model_display_name
from rag_mspoe.models.model_cache import ModelLoadError
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

if TYPE_CHECKING:
    from rag_mspoe.engine import Engine
    from rag_mspoe.engine.protocol import EngineLike


def __getattr__(name: str) -> Any:
    # The engine imports transformers' generation stack: loaded when first asked for, not by
    # `import rag_mspoe`.
    if name == "Engine":
        from rag_mspoe.engine import Engine

        return Engine
    if name == "EngineLike":
        from rag_mspoe.engine.protocol import EngineLike

        return EngineLike
    raise AttributeError(f"module 'rag_mspoe' has no attribute {name!r}")


__all__ = [
    "ARCHITECTURES",
    "AttentionCalibration",
    "NAMED_METHODS",
    "Compose",
    "DeviceError",
    "Engine",
    "EngineLike",
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
