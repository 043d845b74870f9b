"""The benchmark's turned residual stream (bench_int8_prefill --rotate) computes the same function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny_models import VOCAB, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_int8_prefill import rotated  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_turned_stream_gives_the_same_logits_in_float32(arch, tied):
    model = tiny_model(arch, tie_word_embeddings=tied)
    if tied:
        model.tie_weights()
    with torch.no_grad():  # norms of ones would make their folding trivial
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    turned = rotated(model)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, got = model(ids).logits, turned(ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.equal(turned.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert turned.get_output_embeddings().weight is not turned.model.embed_tokens.weight
