"""Log-probabilities of generated tokens (`logprobs=`): equal to a teacher-forced forward of the
stock model, cut with the text at stop strings, the same streamed, batched and under a grammar,
and exact bytes on the Qwen tokenizer, whose tokens split characters."""

from __future__ import annotations

import pytest
import torch

from rag_mspoe.grammar import Grammar, grammar_tokenizer
from rag_mspoe.stopping import TextTracker
from rag_mspoe.token_logprobs import TokenLogprob, token_text

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
    assert tokens and len(tokens) <= result.completion_tokens
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


def test_a_stop_string_cuts_the_tokens_with_the_text(engine):
    free = engine.generate(QUESTION, max_new_tokens=10, logprobs=0)
    stop = free.text[len(free.text) // 2 :][:3]
    stopped = engine.generate(QUESTION, max_new_tokens=10, logprobs=0, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(stop)]
    kept = stopped.logprobs
    assert kept == free.logprobs[: len(kept)]
    assert kept[-1].text_offset < len(stopped.text)  # the last token wrote some of the text
    later = free.logprobs[len(kept) :]
    assert later and later[0].text_offset >= len(stopped.text)  # the next one wrote none of it


def test_streamed_pieces_carry_the_tokens_that_start_in_them(engine):
    whole = engine.generate(QUESTION, max_new_tokens=10, logprobs=2)
    stream = engine.stream(QUESTION, max_new_tokens=10, logprobs=2)
    pieces = list(stream)
    assert "".join(pieces) == whole.text
    assert tuple(t for piece in pieces for t in piece.tokens) == whole.logprobs == stream.result.logprobs
    for piece in pieces:
        offset = sum(len(p) for p in pieces[: pieces.index(piece)])
        assert all(offset <= t.text_offset < offset + len(piece) for t in piece.tokens)


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
    assert b"".join(t.bytes for t in kept).decode() == tracker.text
    split = [t for t in kept if t.token.startswith("bytes:")]  # the space and the emoji's pieces
    assert len(split) >= 2 and all(t.text_offset == tracker.text.index(" 🦜") for t in split)
