"""Log-probabilities of generated tokens (`logprobs=`): equal to a teacher-forced forward of the
stock model, cut with the text at stop strings, the same streamed, batched and under a grammar,
and exact bytes on the Qwen tokenizer, whose tokens split characters."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.engine.stopping import TextTracker
from rag_mspoe.engine.token_logprobs import TokenLogprob, token_text
from rag_mspoe.tools.grammar import Grammar, grammar_tokenizer

QUESTION = "What is the capital of France?"
PROMPTS = [QUESTION, "Name three colours, then say why the sky is blue."]


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def forced_logprobs(engine, prompt: str, answer_ids: list[int]) -> torch.Tensor:
    """Log-probabilities of answer_ids after the chat-templated prompt, from one plain forward."""
    prompt_ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_equal_a_teacher_forced_forward_and_top_is_sorted(engine):
    result = engine.generate(QUESTION, max_new_tokens=10, logprobs=3)
    tokens = result.logprobs
    assert tokens and len(tokens) == result.completion_tokens
    expected = forced_logprobs(engine, QUESTION, [t.id for t in tokens])
    for step, token in enumerate(tokens):
        assert token.logprob == pytest.approx(float(expected[step, token.id]), abs=1e-4)
        assert len(token.top) == 3
        assert [t.logprob for t in token.top] == sorted((t.logprob for t in token.top), reverse=True)
        assert token.top[0].id == token.id  # greedy picks the likeliest
        assert token.top[1].logprob == pytest.approx(float(expected[step].topk(2).values[1]), abs=1e-4)
    assert "".join(t.token for t in tokens) == result.text
    assert [t.text_offset for t in tokens] == [
        len("".join(t.token for t in tokens[:i])) for i in range(len(tokens))
    ]


def test_no_logprobs_unless_asked(engine):
    assert engine.generate(QUESTION, max_new_tokens=4).logprobs is None
    assert engine.generate(QUESTION, max_new_tokens=4, logprobs=0).logprobs[0].top == ()


def test_a_stop_string_ends_the_tokens_where_it_ends_generation(engine):
    free = engine.generate(QUESTION, max_new_tokens=10, logprobs=0)
    stop = free.text[len(free.text) // 2 :][:3]
    stopped = engine.generate(QUESTION, max_new_tokens=10, logprobs=0, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(stop)]
    kept = stopped.logprobs
    assert len(kept) == stopped.completion_tokens < free.completion_tokens
    assert [t.id for t in kept] == [t.id for t in free.logprobs[: len(kept)]]
    assert "".join(t.token for t in kept).startswith(stopped.text + stop)  # through the stop string
    cut = [t for t in kept if t.text_offset == len(stopped.text)]  # those that wrote none of the text
    assert [t.text_offset for t in kept] == [
        min(t.text_offset, len(stopped.text)) for t in free.logprobs[: len(kept)]
    ]
    assert cut or kept[-1].text_offset < len(stopped.text)


def test_the_token_that_ended_the_turn_is_counted(engine):
    """The grammar ends the answer after "Paris": the end-of-turn token follows, writes no text,
    and its log-probability (the model's own) is the answer's last."""
    result = engine.generate(QUESTION, max_new_tokens=10, logprobs=0, grammar=Grammar.choice(["Paris"]))
    assert result.text == "Paris" and result.finish_reason == "stop"
    tokens = result.logprobs
    assert len(tokens) == result.completion_tokens and tokens[-1].id in engine._eos_ids
    assert tokens[-1].text_offset == len("Paris") and "".join(t.token for t in tokens[:-1]) == "Paris"
    expected = forced_logprobs(engine, QUESTION, [t.id for t in tokens])
    assert tokens[-1].logprob == pytest.approx(float(expected[-1, tokens[-1].id]), abs=1e-4)
    streamed = engine.stream(QUESTION, max_new_tokens=10, logprobs=0, grammar=Grammar.choice(["Paris"]))
    assert tuple(t for piece in streamed for t in piece.tokens) == tokens


def test_streamed_pieces_carry_the_tokens_that_start_in_them(engine):
    whole = engine.generate(QUESTION, max_new_tokens=10, logprobs=2)
    stream = engine.stream(QUESTION, max_new_tokens=10, logprobs=2)
    pieces = list(stream)
    assert "".join(pieces) == whole.text
    assert tuple(t for piece in pieces for t in piece.tokens) == whole.logprobs == stream.result.logprobs
    offset = 0
    for piece in pieces:  # tokens past the text (the end of turn) come with the last piece
        assert all(
            offset <= t.text_offset < offset + len(piece) or t.text_offset == len(whole.text)
            for t in piece.tokens
        )
        offset += len(piece)


def test_a_batch_gives_each_row_its_own_logprobs(engine):
    alone = [engine.generate(p, max_new_tokens=8, logprobs=1) for p in PROMPTS]
    together = engine.generate_batch(PROMPTS, max_new_tokens=8, logprobs=1)
    for one, batched in zip(alone, together, strict=True):
        assert [t.id for t in batched.logprobs] == [t.id for t in one.logprobs]
        for a, b in zip(one.logprobs, batched.logprobs, strict=True):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_under_a_grammar_the_logprobs_are_the_models_own(engine):
    """The mask makes the chosen token certain for the sampler, not for the model."""
    result = engine.generate(
        QUESTION, max_new_tokens=8, logprobs=1, grammar=Grammar.choice(["Paris", "Lyon"])
    )
    assert result.text in ("Paris", "Lyon")
    expected = forced_logprobs(engine, QUESTION, [t.id for t in result.logprobs])
    for step, token in enumerate(result.logprobs):
        assert token.logprob == pytest.approx(float(expected[step, token.id]), abs=1e-4)
    assert min(t.logprob for t in result.logprobs) < -0.1  # the random model is unsure of them


@pytest.mark.parametrize(
    "bad, error", [(21, ValueError), (-1, ValueError), (True, TypeError), ("3", TypeError)]
)
def test_a_bad_logprobs_setting_names_the_range(engine, bad, error):
    with pytest.raises(error, match="logprobs"):
        engine.generate(QUESTION, max_new_tokens=2, logprobs=bad)


def test_qwen_tokens_that_split_a_character_keep_exact_bytes(qwen_tokenizer):
    """A tracker fed the Qwen tokens of text whose emoji spans several tokens: each token's bytes
    are exact, the partial ones read as 'bytes:...', and they add up to the text."""
    text = "Parrots 🦜 talk <tool_call> back"
    ids = qwen_tokenizer.encode(text)
    vocabulary = grammar_tokenizer(qwen_tokenizer, len(qwen_tokenizer), [qwen_tokenizer.eos_token_id])
    pieces = [vocabulary.decode_bytes([i]) for i in ids]
    assert any(token_text(p).startswith("bytes:") for p in pieces)  # the emoji is split
    tracker = TextTracker(qwen_tokenizer, stop=[" back"])
    for token_id, data in zip(ids, pieces, strict=True):
        tracker.push(token_id, TokenLogprob(id=token_id, token=token_text(data), bytes=data, logprob=-1.0))
    assert tracker.text == "Parrots 🦜 talk <tool_call>"
    kept = tracker.answer_tokens()
    assert b"".join(t.bytes for t in kept).decode() == text  # through the stop string
    assert kept[-1].token == " back" and kept[-1].text_offset == len(tracker.text)
    split = [t for t in kept if t.token.startswith("bytes:")]  # the space and the emoji's pieces
    assert len(split) >= 2 and all(t.text_offset == tracker.text.index(" 🦜") for t in split)


# -- the prompt's own tokens (`prompt_logprobs`, the API's echo) ---------------------------------

PASSAGE = "Paris is the capital of France. Lyon is known for its food, and Marseille for its port."


def forced_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


@pytest.mark.parametrize(
    "arch, overrides", [("llama", {}), ("gemma3_text", {"final_logit_softcapping": 5.0})]
)
def test_prompt_logprobs_equal_one_forward_in_chunks_of_rows(embedded, monkeypatch, arch, overrides):
    """Scored a few rows at a time (as long prompts are), with the model's logit soft-capping."""
    monkeypatch.setattr("rag_mspoe.engine.engine_scoring._LOGIT_ROWS", 5)
    tokenizer = embedded[1]
    model = tiny_model(
        arch, vocab_size=len(tokenizer), max_position_embeddings=256, initializer_range=0.3, **overrides
    )
    engine = Engine(model, tokenizer, name="tiny")
    tokens = engine.prompt_logprobs(PASSAGE, raw=True, top=2)
    ids = [t.id for t in tokens]
    assert ids == tokenizer.encode(PASSAGE) and len(ids) > 10
    expected = forced_prompt_logprobs(model, ids)
    assert tokens[0].logprob is None and tokens[0].top == ()
    for row, token in enumerate(tokens[1:]):
        assert token.logprob == pytest.approx(float(expected[row, token.id]), abs=1e-4)
        assert [t.id for t in token.top] == expected[row].topk(2).indices.tolist()
    assert "".join(t.token for t in tokens) == PASSAGE
    assert [t.text_offset for t in tokens] == [
        len("".join(t.token for t in tokens[:i])) for i in range(len(tokens))
    ]


def test_prompt_logprobs_under_a_method_are_the_methods(engine):
    from rag_mspoe import rescaled

    plain = engine.prompt_logprobs(PASSAGE, raw=True)
    scaled = engine.prompt_logprobs(PASSAGE, raw=True, method="pi")
    with rescaled(engine.model, "pi"):
        expected = forced_prompt_logprobs(engine.model, [t.id for t in scaled])
    assert [t.logprob for t in scaled[1:]] == pytest.approx(
        [float(expected[row, t.id]) for row, t in enumerate(scaled[1:])], abs=1e-4
    )
    assert [t.logprob for t in scaled[1:]] != pytest.approx([t.logprob for t in plain[1:]], abs=1e-3)


def test_prompt_logprobs_refuse_a_method_that_rewrites_the_prompt(engine):
    prompt = "Document [1] (Title: A) Paris.\nDocument [2] (Title: B) Lyon.\n\nQuestion: capital of France?"
    with pytest.raises(ValueError, match="rewrites the prompt"):
        engine.prompt_logprobs(prompt, raw=True, method="calibrated-reorder")
