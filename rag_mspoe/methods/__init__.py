"""The methods: what each one declares, how a spec names one, the registry, and the public names.

    method_config    MethodConfig, the base every method subclasses; Compose; saving and loading
    registry         the one registry: how a method registers, which modules ship one, plugins
    method_spec      parse_method: the config a spec means ("mspoe", "pi:2", "layerwise+pi", a path)
    hidden_scaling   HiddenScale, positional hidden-state scaling
    where_validated  WhereValidated ("auto"): a shipped reordering on the prompts it was validated for

The RoPE families live in `rag_mspoe.rope` (uniform, layerwise, mspoe) beside the hooks every
method is applied with, the attention-level ones in `rag_mspoe.attention`; `registry.BUILT_IN_METHODS`
lists them all. This package's `__all__` is the one list of public method names (`rag_mspoe`
re-exports from it).

The method classes are imported on first use, not when this package is imported: their modules
import `rag_mspoe.methods.method_config`, and so this package, themselves.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rag_mspoe.methods.method_config import (
    METHOD_FILE,
    NAMED_METHODS,
    Compose,
    MethodConfig,
    load_method,
    method_name,
)
from rag_mspoe.methods.method_spec import AUTO, CALIBRATED, UNMODIFIED_NAMES, MethodSpec, parse_method
from rag_mspoe.methods.registry import BUILT_IN_METHODS, registered_methods

if TYPE_CHECKING:
    from rag_mspoe.attention.attention_calibration import AttentionCalibration
    from rag_mspoe.attention.invariant_reorder import InvariantReorder
    from rag_mspoe.attention.pine import Pine
    from rag_mspoe.attention.reorder import CalibratedReorder
    from rag_mspoe.methods.hidden_scaling import HiddenScale
    from rag_mspoe.methods.where_validated import WhereValidated
    from rag_mspoe.rope.layerwise import LayerWise
    from rag_mspoe.rope.mspoe import GqaPolicy, MsPoE
    from rag_mspoe.rope.uniform import Uniform


def __getattr__(name: str) -> Any:
    if name in __all__:
        registered_methods()  # imports every built-in method's module
        for module in BUILT_IN_METHODS:
            if hasattr(sys.modules[module], name):
                return getattr(sys.modules[module], name)
    raise AttributeError(f"module 'rag_mspoe.methods' has no attribute {name!r}")


__all__ = [
    "AUTO",
    "AttentionCalibration",
    "CALIBRATED",
    "CalibratedReorder",
    "Compose",
    "GqaPolicy",
    "HiddenScale",
    "InvariantReorder",
    "LayerWise",
    "METHOD_FILE",
    "MethodConfig",
    "MethodSpec",
    "MsPoE",
    "NAMED_METHODS",
    "Pine",
    "UNMODIFIED_NAMES",
    "Uniform",
    "WhereValidated",
    "load_method",
    "method_name",
    "parse_method",
]
