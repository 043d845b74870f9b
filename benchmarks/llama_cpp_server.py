"""`python -m llama_cpp.server` with llama.cpp's repacked weight buffers off (`llama_cpp_layout`).

    python benchmarks/llama_cpp_server.py --model FILE.gguf --n_ctx 4096 --n_threads 1 --port 8089

Same arguments as llama-cpp-python's server, which has no option for the weight layout.
"""

from __future__ import annotations

from llama_cpp.server.__main__ import main
from llama_cpp_layout import use_plain_weight_layout

if __name__ == "__main__":
    use_plain_weight_layout()
    main()
