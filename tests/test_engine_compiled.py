"""The engine's compiled decode path (static KV cache, compiled forward), forced on for the CPU: the
same answers as eager decoding under every kind of method, with a left-padded batch."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from tiny_models import tiny_model
from torch._dynamo.utils import counters

from rag_mspoe import HiddenScale, MsPoE, Uniform
from rag_mspoe.engine import Engine

PROMPTS = ["What is the capital of France?", "Name three colours, please, and say why you like them."]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


def _model(tokenizer):
    # Large random weights give sharp attention, so a change of positions shows in the output.
    return tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, initializer_range=0.3)


def test_compile_is_off_on_the_cpu_by_default_and_checked(tokenizer):
    assert not Engine(_model(tokenizer), tokenizer).compiled
    assert Engine(_model(tokenizer), tokenizer, compile=True).compiled
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        Engine(_model(tokenizer), tokenizer, compile="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "method",
    [None, Uniform(1.7), MsPoE(1.2, 2.4, skip_layers=1), HiddenScale(dimension=5, factor=0.0, layers=[1, 2])],
    ids=["none", "uniform", "mspoe", "hidden"],
)
def test_compiled_decoding_gives_the_eager_answers(tokenizer, method):
    model = _model(tokenizer)
    eager = Engine(model, tokenizer, method=method, compile=False)
    expected = [r.text for r in eager.generate_batch(PROMPTS, max_new_tokens=8)]
    torch._dynamo.reset()
    counters.clear()
    compiled = Engine(model, tokenizer, method=method, compile=True, compile_backend="eager")
    try:
        got = [r.text for r in compiled.generate_batch(PROMPTS, max_new_tokens=8)]
        again = compiled.generate(PROMPTS[0], max_new_tokens=8).text  # a new batch size recompiles once
    finally:
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] >= 1  # the compiled forward really ran
    assert got == expected
    assert again == expected[0]


def test_switching_methods_compiles_each_once(tokenizer):
    model = _model(tokenizer)
    torch._dynamo.reset()
    engine = Engine(model, tokenizer, compile=True, compile_backend="eager")
    try:
        engine.generate(PROMPTS[0], max_new_tokens=4)
        engine.generate(PROMPTS[0], max_new_tokens=4, method=MsPoE(1.2, 2.4, skip_layers=1))
        with torch._dynamo.config.patch(error_on_recompile=True):  # back on the default: reused
            engine.generate(PROMPTS[0], max_new_tokens=4)
    finally:
        torch._dynamo.reset()


def test_prompt_lengths_compile_twice_at_most(tokenizer):
    # The static cache is sized to the prompt plus its new tokens (at least the longest before):
    # the first longer prompt recompiles, torch then treats the length as dynamic, and no prompt
    # length, shorter or longer, compiles again.
    model = _model(tokenizer)
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, tokenizer, compile=True, compile_backend="eager")
    try:
        for words in (5, 40):
            engine.generate(" ".join(["word"] * words), max_new_tokens=4)
        assert counters["stats"]["unique_graphs"] == 2
        with torch._dynamo.config.patch(error_on_recompile=True):
            for words in (20, 80, 60, 120):
                engine.generate(" ".join(["word"] * words), max_new_tokens=4)
    finally:
        torch._dynamo.reset()
