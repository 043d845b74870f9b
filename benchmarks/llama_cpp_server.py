"""`python -m llama_cpp.server` with llama.cpp's repacked weight buffers off (`use_extra_bufts`).

    python benchmarks/llama_cpp_server.py --model FILE.gguf --n_ctx 4096 --n_threads 1 --port 8089

Same arguments as llama-cpp-python's server. Why: on a CPU with AVX-512 and AMX, llama-cpp-python
0.3.36 built from source segfaults in its first batched prefill of the Qwen2.5 Q4_K_M file when
the weights are repacked for those instructions (one token at a time runs); the plain layout
runs. llama-cpp-python's server has no option for it, so this sets the default model parameters
before the server loads the model.
"""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama
from llama_cpp.server.__main__ import main

_defaults = llama_cpp.llama_model_default_params


def _plain_layout() -> llama_cpp.llama_model_params:
    params = _defaults()
    params.use_extra_bufts = False
    return params


llama_cpp.llama.llama_cpp.llama_model_default_params = _plain_layout  # what Llama() loads with

if __name__ == "__main__":
    main()
