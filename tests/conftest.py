"""Shared fixtures: tiny random models of every supported architecture and the real embedded model."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # measured faster than 2 threads on the 2-core CI machines, and deterministic


@pytest.fixture(autouse=True, scope="session")
def one_thread_for_loaded_models():
    """load_model's default thread count follows the CPUs free at load time; tests keep one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rag_mspoe.models.loading.default_threads", lambda: 1)
        yield


@pytest.fixture(scope="session")
def embedded():
    """The real embedded SmolLM2-135M-Instruct (converted once into the cache), as (model, tokenizer)."""
    from rag_mspoe import load_model

    return load_model()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The embedded Qwen2.5-Coder tokenizer (special tokens for tool calls and chat turns); the
    test skips where the model's part packages are not installed."""
    from transformers import AutoTokenizer

    from rag_mspoe.models import embedded_models

    try:
        folder = embedded_models.prepare("qwen2.5-coder-0.5b-instruct")
    except (RuntimeError, ValueError, OSError) as exc:
        pytest.skip(f"the embedded Qwen2.5-Coder-0.5B is not installed: {exc}")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_engine(embedded):
    """An engine over a tiny random Llama with the real SmolLM2 tokenizer; large random weights
    give a peaked, varied distribution, so changes show in the output."""
    from tiny_models import tiny_model

    from rag_mspoe.engine import Engine

    tokenizer = embedded[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, initializer_range=0.3)
    return Engine(model, tokenizer, name="tiny-llama")
