"""The generation engine: stop strings, streaming, batching, token counts, context limits, sampling,
per-call methods and concurrent callers. Mechanics run on a tiny random Llama with the real
SmolLM2 tokenizer; one check runs the real embedded model."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import tiny_model

from rag_mspoe import Compose, LayerWise, Uniform, current_method, parse_method, rescale, unrescale
from rag_mspoe.engine import (
    ENGINE_DEFAULT,
    Engine,
    GenerationCancelled,
    GenerationTimeout,
    PromptTooLongError,
)
from rag_mspoe.engine.stopping import TextTracker

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}],
    "Count to five, please, slowly and carefully.",
]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


@pytest.fixture(scope="module")
def engine(tokenizer):
    # Large random weights give sharp attention, so a change of positions shows in the output.
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, initializer_range=0.3)
    return Engine(model, tokenizer, name="tiny-llama")


def reference_ids(engine, prompt, max_new_tokens):
    """Greedy continuation straight from transformers, without the engine."""
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = engine.model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return ids, out[0, len(ids) :].tolist()


def test_greedy_generation_matches_transformers_and_counts_tokens(engine):
    ids, new_ids = reference_ids(engine, PROMPTS[0], 12)
    result = engine.generate(PROMPTS[0], max_new_tokens=12)
    assert result.text == engine.tokenizer.decode(new_ids, skip_special_tokens=True)
    assert result.prompt_tokens == len(ids) == engine.count_tokens(PROMPTS[0])
    assert result.completion_tokens == 12
    assert result.finish_reason == "length"
    assert result.method == "none"
    assert result.truncation is None


def test_stop_string_cuts_the_answer_in_both_paths(engine):
    full = engine.generate(PROMPTS[1], max_new_tokens=24).text
    stop = full[6:14]  # spans several tokens and starts inside one
    expected = full[: full.index(stop)]

    result = engine.generate(PROMPTS[1], max_new_tokens=24, stop=[stop])
    assert result.text == expected
    assert result.finish_reason == "stop"
    assert result.completion_tokens < 24

    stream = engine.stream(PROMPTS[1], max_new_tokens=24, stop=[stop])
    pieces = list(stream)
    # Pieces are never taken back, so a leaked start of the stop string would show up here.
    assert "".join(pieces) == expected
    assert stream.result == result


def test_earliest_of_several_stop_strings_wins(engine):
    full = engine.generate(PROMPTS[1], max_new_tokens=24).text
    late, early = full[12:16], full[4:7]
    result = engine.generate(PROMPTS[1], max_new_tokens=24, stop=[late, early])
    assert result.text == full[: full.index(early)]


def test_stream_pieces_join_to_the_generated_text(engine):
    stream = engine.stream(PROMPTS[2], max_new_tokens=20)
    pieces = list(stream)
    assert len(pieces) > 1
    result = engine.generate(PROMPTS[2], max_new_tokens=20)
    assert "".join(pieces) == result.text
    assert stream.result == result


def test_tracker_holds_back_a_possible_stop_string_until_it_is_decided(tokenizer):
    tracker = TextTracker(tokenizer, stop=["world peace"])
    streamed = []
    for token in tokenizer("Hello world war", add_special_tokens=False)["input_ids"]:
        tracker.push(token)
        streamed.append(tracker.take_streamable())
    # "world" might have begun "world peace": it waits until " war" rules that out.
    assert streamed == ["Hello", " ", "world war"]
    assert not tracker.done

    tracker = TextTracker(tokenizer, stop=["world peace"])
    for token in tokenizer("Hello world peace now", add_special_tokens=False)["input_ids"]:
        tracker.push(token)
    assert tracker.text == "Hello " and tracker.done and tracker.take_rest() == "Hello "


def test_tracker_never_streams_half_a_character(tokenizer):
    text = "Cats 🐈‍⬛ and 日本語 text"
    tracker = TextTracker(tokenizer)
    pieces = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        tracker.push(token)
        pieces.append(tracker.take_streamable())
    tracker.flush()
    pieces.append(tracker.take_rest())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_batch_gives_the_answers_of_single_calls(engine):
    batch = engine.generate_batch(PROMPTS, max_new_tokens=10)
    singles = [engine.generate(p, max_new_tokens=10) for p in PROMPTS]
    assert [r.text for r in batch] == [r.text for r in singles]
    assert [r.prompt_tokens for r in batch] == [engine.count_tokens(p) for p in PROMPTS]
    assert len({r.prompt_tokens for r in batch}) > 1  # the batch really needed padding


def test_raw_prompt_skips_the_chat_template(engine):
    text = "Once upon a time"
    result = engine.generate(text, raw=True, max_new_tokens=4)
    assert result.prompt_tokens == engine.count_tokens(text, raw=True) == len(engine.encode(text))
    assert engine.count_tokens(text) > result.prompt_tokens


def test_too_long_prompt_is_an_error_naming_length_and_limit(engine):
    long_prompt = "word " * 300
    with pytest.raises(
        PromptTooLongError, match=r"(?s)prompt is \d+ tokens.*window.*is 256.*truncate='middle'"
    ):
        engine.generate(long_prompt, max_new_tokens=8)
    with pytest.raises(PromptTooLongError, match="lower max_new_tokens"):
        engine.generate("hi", max_new_tokens=256)


def test_middle_truncation_keeps_both_ends_and_reports_the_cut(engine):
    prompt = "START " + " ".join(f"w{i}" for i in range(300)) + " END"
    full_length = engine.count_tokens(prompt)
    result = engine.generate(prompt, max_new_tokens=8, truncate="middle")
    assert result.prompt_tokens == 256 - 8
    cut = result.truncation
    assert cut is not None and cut.removed_tokens == full_length - result.prompt_tokens
    assert "w150" in cut.removed_text and "START" not in cut.removed_text and "END" not in cut.removed_text


def test_seeded_sampling_repeats_and_leaves_global_randomness_alone(engine):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = engine.generate(PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=7).text
    assert torch.rand(1) == expected_next
    assert engine.generate(PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=7).text == first
    assert engine.generate(PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=8).text != first


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_tokens": 5}, r"Unknown generation setting\(s\) \['max_tokens'\]"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"stop": [""]}, "non-empty strings"),
        ({"truncate": "left"}, "'error' or 'middle'"),
        ({"method": "bogus"}, "Unknown method 'bogus'"),
    ],
)
def test_bad_settings_are_named(engine, settings, message):
    with pytest.raises((TypeError, ValueError), match=message):
        engine.generate("hi", max_new_tokens=4, **settings)


def test_bad_messages_are_named(engine):
    with pytest.raises(ValueError, match="role 'robot'; use one of system, user, assistant"):
        engine.generate([{"role": "robot", "content": "hi"}])
    with pytest.raises(TypeError, match="raw=True takes a plain string prompt or one message, got 2"):
        engine.generate([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], raw=True)
    one = engine.generate([{"role": "user", "content": "hi"}], raw=True, max_new_tokens=3)
    assert one.text == engine.generate("hi", raw=True, max_new_tokens=3).text


def test_timeout_while_waiting_for_a_busy_model(engine):
    started = threading.Event()

    def long_call():
        stream = engine.stream(PROMPTS[0], max_new_tokens=200)
        for _ in stream:
            started.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    started.wait(10)
    with pytest.raises(GenerationTimeout, match="raise timeout or retry"):
        engine.generate(PROMPTS[1], max_new_tokens=4, timeout=0.01)
    worker.join()


def test_leaving_a_stream_early_frees_the_model_at_once(engine):
    for _ in engine.stream(PROMPTS[0], max_new_tokens=200):  # about half a second of work
        break
    # Still generating, the model would be busy for far longer than this.
    assert engine.generate(PROMPTS[1], max_new_tokens=2, timeout=0.1).completion_tokens == 2


def test_leaving_an_async_stream_early_frees_the_model_at_once(engine):
    async def main():
        async for _ in engine.astream(PROMPTS[0], max_new_tokens=200):
            break
        return await engine.agenerate(PROMPTS[1], max_new_tokens=2, timeout=0.1)

    assert asyncio.run(main()).completion_tokens == 2


def test_a_cancelled_call_stops_waiting_for_the_model_or_generating(engine):
    # A pre-hook makes the model as slow as the test needs: no race against the machine's speed.
    release, forwards, cancel = threading.Event(), [], threading.Event()

    def slow_model(module, args):
        forwards.append(1)
        release.wait(timeout=30)

    hook = engine.model.model.layers[0].register_forward_pre_hook(slow_model)
    try:
        busy = engine.stream(PROMPTS[0], max_new_tokens=200)  # holds the model until released
        while not forwards:
            threading.Event().wait(0.01)
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(engine.generate, PROMPTS[1], max_new_tokens=4, cancel=cancel)
            cancel.set()
            with pytest.raises(GenerationCancelled, match="waiting"):
                waiting.result(timeout=5)
        busy.close()
        release.set()
    finally:
        hook.remove()

    cancel, forwards = threading.Event(), []

    def cancel_at_the_third_forward(module, args):  # the prompt's read gives token 1, then 2, 3
        forwards.append(1)
        if len(forwards) == 3:
            cancel.set()

    hook = engine.model.model.layers[0].register_forward_pre_hook(cancel_at_the_third_forward)
    try:
        with pytest.raises(GenerationCancelled, match="after 3 tokens"):
            engine.generate(PROMPTS[0], max_new_tokens=200, cancel=cancel)
    finally:
        hook.remove()
    assert engine.generate(PROMPTS[1], max_new_tokens=2, timeout=0.5).completion_tokens == 2


def test_threads_get_the_answers_of_sequential_calls(engine):
    sequential = [engine.generate(p, max_new_tokens=10).text for p in PROMPTS]
    with ThreadPoolExecutor(max_workers=len(PROMPTS) * 2) as pool:
        generated = pool.map(lambda p: engine.generate(p, max_new_tokens=10).text, PROMPTS * 2)
        streamed = pool.map(lambda p: "".join(engine.stream(p, max_new_tokens=10)), PROMPTS * 2)
        assert list(generated) == sequential * 2
        assert list(streamed) == sequential * 2


def test_asyncio_tasks_get_the_answers_of_sequential_calls_without_blocking_the_loop(engine):
    sequential = [engine.generate(p, max_new_tokens=10).text for p in PROMPTS]

    async def collect(prompt):
        return "".join([piece async for piece in engine.astream(prompt, max_new_tokens=10)])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        clock = asyncio.create_task(ticker())
        results = await asyncio.gather(
            *(engine.agenerate(p, max_new_tokens=10) for p in PROMPTS), *(collect(p) for p in PROMPTS)
        )
        clock.cancel()
        return results, ticks

    results, ticks = asyncio.run(main())
    assert [r.text for r in results[: len(PROMPTS)]] == sequential
    assert results[len(PROMPTS) :] == sequential
    assert ticks > 20  # the loop kept running while the model worked


def test_per_call_method_applies_once_and_the_default_comes_back(engine):
    before = engine.generate(PROMPTS[3], max_new_tokens=16)
    logits_before = engine.model(torch.tensor([engine.encode(PROMPTS[3])])).logits

    scaled = engine.generate(PROMPTS[3], max_new_tokens=16, method="pi")
    assert scaled.method == "pi"
    assert current_method(engine.model) is None
    assert torch.equal(engine.model(torch.tensor([engine.encode(PROMPTS[3])])).logits, logits_before)
    assert engine.generate(PROMPTS[3], max_new_tokens=16) == before


def test_method_changes_the_output(engine):
    long_prompt = " ".join(f"item {i}" for i in range(40))
    plain = engine.generate(long_prompt, max_new_tokens=16)
    for spec in ("pi", "mspoe"):
        assert engine.generate(long_prompt, max_new_tokens=16, method=spec).text != plain.text


def test_engine_default_method_and_set_method(engine, tokenizer):
    mspoe = Engine(engine.model, tokenizer, method="mspoe")
    assert mspoe.method == parse_method("mspoe")
    assert mspoe.generate(PROMPTS[0], max_new_tokens=8) == engine.generate(
        PROMPTS[0], max_new_tokens=8, method="mspoe"
    )
    assert current_method(engine.model) is None
    mspoe.set_method("none")
    assert mspoe.generate(PROMPTS[0], max_new_tokens=8) == engine.generate(PROMPTS[0], max_new_tokens=8)


def test_engine_methods_take_the_spec_grammar(engine, tokenizer):
    assert Engine(engine.model, tokenizer, method="pi:2").method == Uniform(factor=2.0)
    stacked = Engine(engine.model, tokenizer, method="layerwise+pi")
    assert isinstance(stacked.method, Compose)
    assert [type(m) for m in stacked.method.methods] == [LayerWise, Uniform]
    long_prompt = " ".join(f"item {i}" for i in range(40))
    by_spec = engine.generate(long_prompt, max_new_tokens=12, method="layerwise+pi")
    assert by_spec == engine.generate(long_prompt, max_new_tokens=12, method=stacked.method)
    assert by_spec.text != engine.generate(long_prompt, max_new_tokens=12).text
    assert current_method(engine.model) is None


def test_engine_refuses_model_variants_and_orders_where_it_names_them(engine, tokenizer):
    with pytest.raises(ValueError, match="'yarn:2' .* is a RoPE type.*rag-mspoe sweep"):
        Engine(engine.model, tokenizer, method="pi+yarn:2")
    with pytest.raises(ValueError, match="'longcontextreorder' .* is a document order"):
        engine.generate(PROMPTS[0], max_new_tokens=4, method="longcontextreorder")


def test_engine_default_means_the_engines_method_and_none_the_unmodified_model(engine, tokenizer):
    pi = Engine(engine.model, tokenizer, method="pi")
    default = pi.generate(PROMPTS[0], max_new_tokens=8)
    assert default.method == "pi"
    assert pi.generate(PROMPTS[0], max_new_tokens=8, method=ENGINE_DEFAULT) == default
    unmodified = pi.generate(PROMPTS[0], max_new_tokens=8, method=None)
    assert unmodified.method == "none"
    assert unmodified == pi.generate(PROMPTS[0], max_new_tokens=8, method="none")
    assert Engine(engine.model, tokenizer, method=None).method is None
    pi.set_method(None)  # a spec, not a call: None is the unmodified model
    assert pi.method is None


def test_engine_adopts_the_method_already_on_the_model(engine, tokenizer):
    rescale(engine.model, parse_method("mspoe"))
    try:
        adopted = Engine(engine.model, tokenizer)
        assert adopted.generate(PROMPTS[0], max_new_tokens=8).method == "mspoe"
        assert adopted.generate(PROMPTS[0], max_new_tokens=8, method="none").method == "none"
        assert current_method(engine.model) == parse_method("mspoe")
    finally:
        unrescale(engine.model)


@pytest.mark.slow
def test_embedded_model_answers_and_stops_at_end_of_turn(embedded):
    engine = Engine(*embedded)
    result = engine.generate("What is the capital of France?", max_new_tokens=30)
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert "<|im_end|>" not in result.text
    assert engine.context_window == 8192
    assert engine.name == "smollm2-135m-instruct"


def test_a_temperature_too_small_to_sample_with_is_greedy_decoding(tiny_engine):
    greedy = tiny_engine.generate("Paris is", max_new_tokens=5)
    assert tiny_engine.generate("Paris is", max_new_tokens=5, temperature=1e-38, seed=3) == greedy
