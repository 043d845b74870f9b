"""The methods: what each one declares, how a spec names one, and the ones that ship.

    registry         the built-in methods and the names code imports them by (re-exported here)
    method_config    MethodConfig, the base every method subclasses; Compose; saving and loading
    method_spec      parse_method: the config a spec means ("mspoe", "pi:2", "layerwise+pi", a path)
    hidden_scaling   HiddenScale, positional hidden-state scaling

The RoPE families live in `rag_mspoe.rope` (uniform, layerwise, mspoe) beside the hooks every
method is applied with, and the attention-level ones in `rag_mspoe.attention` (Pine,
AttentionCalibration).

`from rag_mspoe.methods import MsPoE` imports the registry on first use, not when this package is
imported: the method families import `rag_mspoe.methods.method_config`, and the registry imports
the families.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rag_mspoe.methods.registry import (
        CALIBRATED,
        METHOD_FILE,
        NAMED_METHODS,
        UNMODIFIED_NAMES,
        AttentionCalibration,
        Compose,
        GqaPolicy,
        HiddenScale,
        LayerWise,
        MethodConfig,
        MethodSpec,
        MsPoE,
        Pine,
        Uniform,
        load_method,
        method_name,
        parse_method,
    )


def __getattr__(name: str) -> Any:
    registry = import_module("rag_mspoe.methods.registry")
    if name in registry.__all__:
        return getattr(registry, name)
    raise AttributeError(f"module 'rag_mspoe.methods' has no attribute {name!r}")


__all__ = [
    "AttentionCalibration",
    "CALIBRATED",
    "Compose",
    "GqaPolicy",
    "HiddenScale",
    "LayerWise",
    "METHOD_FILE",
    "MethodConfig",
    "MethodSpec",
    "MsPoE",
    "NAMED_METHODS",
    "Pine",
    "UNMODIFIED_NAMES",
    "Uniform",
    "load_method",
    "method_name",
    "parse_method",
]
