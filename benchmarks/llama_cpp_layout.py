"""llama.cpp with its repacked weight buffers off (`use_extra_bufts`), for every script that loads it.

On a CPU with AVX-512 and AMX, llama-cpp-python 0.3.36 built from source segfaults in its first
batched prefill of the Qwen2.5 Q4_K_M file when the weights are repacked for those instructions
(one token at a time runs); the plain layout runs. llama-cpp-python has no option for it, so this
sets the default model parameters before a model is loaded.
"""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama

_defaults = llama_cpp.llama_model_default_params


def _plain_layout() -> llama_cpp.llama_model_params:
    params = _defaults()
    params.use_extra_bufts = False
    return params


def use_plain_weight_layout() -> None:
    """Load every later `llama_cpp.Llama` with the plain weight layout."""
    llama_cpp.llama.llama_cpp.llama_model_default_params = _plain_layout
