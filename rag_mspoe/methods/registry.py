"""The methods that ship with the package, and the names code imports them by.

Each method is one module holding its config and hooks (`rag_mspoe.methods.method_config` says what a
method declares); importing it registers it. This module imports the built-in ones, so that
`from rag_mspoe.methods import MsPoE` keeps working and every built-in method is registered
whenever `rag_mspoe` is imported:

    uniform       rag_mspoe.rope.uniform        position interpolation ("pi", "pi:2")
    layerwise     rag_mspoe.rope.layerwise      one factor per layer ("layerwise")
    mspoe         rag_mspoe.rope.mspoe          per-head ratios ("mspoe", "mspoe:1.2-1.8")
    hidden        rag_mspoe.methods.hidden_scaling      positional hidden-state scaling ("hidden:DIM,FACTOR")
    compose       rag_mspoe.methods.method_config       several of the above at once ("layerwise+pi")

A config only describes a method; `rag_mspoe.rope.rescaling.rescale` applies it to a model.
"""

from rag_mspoe.attention.calibration import AttentionCalibration
from rag_mspoe.attention.pine import Pine
from rag_mspoe.methods.hidden_scaling import HiddenScale
from rag_mspoe.methods.method_config import (
    METHOD_FILE,
    NAMED_METHODS,
    Compose,
    MethodConfig,
    load_method,
    method_name,
)
from rag_mspoe.methods.method_spec import CALIBRATED, UNMODIFIED_NAMES, MethodSpec, parse_method
from rag_mspoe.rope.layerwise import LayerWise
from rag_mspoe.rope.mspoe import GqaPolicy, MsPoE
from rag_mspoe.rope.uniform import Uniform

__all__ = [
    "AttentionCalibration",
    "Pine",
    "CALIBRATED",
    "METHOD_FILE",
    "NAMED_METHODS",
    "UNMODIFIED_NAMES",
    "Compose",
    "GqaPolicy",
    "HiddenScale",
    "LayerWise",
    "MethodConfig",
    "MethodSpec",
    "MsPoE",
    "Uniform",
    "load_method",
    "method_name",
    "parse_method",
]
