"""Prompt-lookup speculative decoding: greedy answers drafted from the prompt are the answers plain
greedy decoding gives, token for token, in fewer forwards when the answer copies the documents."""

from __future__ import annotations

import pytest
from forward_counts import counted_forwards

from rag_mspoe.engine import Engine

DOCUMENT = (
    "Gull Point Light stands on the northern tip of Vellin Cay. Its lamp was first lit on "
    "2 November 1874 by Maren Holt, a salt raker's widow who kept the light for thirty-one years."
)
PROMPTS = [
    f"Context:\n{DOCUMENT}\n\nQuestion: Copy the sentence that says who first lit the lamp.\nAnswer:",
    f"Context:\n{DOCUMENT}\n\nQuestion: Who kept the light for thirty-one years?\nAnswer:",
]


@pytest.fixture(scope="module")
def engine():
    """The real embedded model in float32: in bf16 a check of several tokens rounds differently
    from a step of one, so where two tokens' logits tie within bf16's step (this prompt has two
    such ties) a drafted answer may take the other one (docs/cpu-inference.md)."""
    from rag_mspoe import load_model

    return Engine(*load_model(dtype="float32"), method="none")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_drafted_answers_are_the_greedy_answers_in_fewer_forwards(engine, prompt):
    engine.prompt_lookup_tokens = 0
    plain, plain_counts = counted_forwards(engine, lambda: engine.generate(prompt, max_new_tokens=40))
    engine.prompt_lookup_tokens = 10
    try:
        drafted, drafted_counts = counted_forwards(engine, lambda: engine.generate(prompt, max_new_tokens=40))
        assert drafted == plain  # text, token counts, finish reason
        # Tokens copied from the prompt came several a forward.
        assert drafted_counts.forwards < plain_counts.forwards
        streamed = engine.stream(prompt, max_new_tokens=40)
        assert "".join(streamed) == plain.text and streamed.result == plain
        # A stop string inside a drafted run of tokens ends the answer where plain decoding does.
        stop = plain.text.split()[2]
        assert engine.generate(prompt, max_new_tokens=40, stop=[stop]) == (
            Engine(engine.model, engine.tokenizer, method="none").generate(
                prompt, max_new_tokens=40, stop=[stop]
            )
        )
    finally:
        engine.prompt_lookup_tokens = 0


def test_drafting_is_for_one_greedy_unmodified_answer(tiny_engine):
    prompt = PROMPTS[0]
    tiny_engine.prompt_lookup_tokens = 10
    try:
        # Sampled, batched, with log-probabilities or under a hooked method: decoded as before.
        for settings in ({"temperature": 0.7, "seed": 1}, {"logprobs": 2}, {"method": "mspoe"}):
            tiny_engine.prompt_lookup_tokens = 10
            drafted = tiny_engine.generate(prompt, max_new_tokens=6, **settings)
            tiny_engine.prompt_lookup_tokens = 0
            assert drafted == tiny_engine.generate(prompt, max_new_tokens=6, **settings)
        tiny_engine.prompt_lookup_tokens = 10
        batch = tiny_engine.generate_batch(PROMPTS, max_new_tokens=6)
        assert batch == [tiny_engine.generate(p, max_new_tokens=6) for p in PROMPTS]
    finally:
        tiny_engine.prompt_lookup_tokens = 0
