"""PINE: the answer does not depend on the documents' order; no documents is the unmodified model."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from attention_helpers import (
    answer_loglikelihood,
    block_prompt,
    in_dtype,
    incremental_logits,
    left_padded,
    logits,
    random_blocks,
    unnumbered_documents_prompt,
)
from tiny_models import tiny_model

from rag_mspoe import parse_method, rescale, rescaled
from rag_mspoe.attention import document_spans
from rag_mspoe.methods import Pine
from rag_mspoe.rope.hooks import cache_argument

FULL_ATTENTION = {"layer_types": ["full_attention"] * 4, "use_sliding_window": False, "sliding_window": None}
ARCHS = {
    "llama": {},
    "qwen2": FULL_ATTENTION,
    "qwen3": FULL_ATTENTION,
    "mistral": {"sliding_window": None},
    "gemma3_text": {"layer_types": ["full_attention"] * 4, "sliding_window": 4096},
}
ANSWER = 4


def _blocks(seed: int = 0, documents: int = 4) -> tuple[list[int], list[list[int]], list[int]]:
    blocks = random_blocks([5, *[4 + 2 * i for i in range(documents)], 6 + ANSWER], seed)
    return blocks[0], blocks[1:-1], blocks[-1]


ORDERS = [(0, 1, 2, 3), (3, 1, 0, 2), (2, 3, 1, 0)]


def _scores_in_orders(model, method, orders=ORDERS) -> list[float]:
    """The answer's log-likelihood under `method` (None: unmodified) with the same four
    documents in each order."""
    prefix, documents, suffix = _blocks()
    prompts = [block_prompt(prefix, [documents[i] for i in order], suffix) for order in orders]
    with rescaled(model, method):
        return [answer_loglikelihood(model, ids, spans, ANSWER) for ids, spans in prompts]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_permuting_the_documents_leaves_the_answer_unchanged(arch):
    model = tiny_model(arch, **ARCHS[arch])
    unmodified = _scores_in_orders(model, None)
    assert max(unmodified) - min(unmodified) > 1e-3  # the order matters to the model itself
    scores = _scores_in_orders(model, Pine())
    assert max(scores) - min(scores) < 1e-4, scores


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_in_bf16_permuting_the_documents_leaves_the_answer_unchanged(arch):
    # The rounding is the same in every order: q and k before RoPE, sums in the documents'
    # content order (0.003 nats apart in these orders when PINE un-rotated them).
    model = tiny_model(arch, **ARCHS[arch]).to(torch.bfloat16)
    unmodified = _scores_in_orders(model, None)
    assert max(unmodified) - min(unmodified) > 1e-2
    scores = _scores_in_orders(model, Pine())
    assert max(scores) - min(scores) < 1e-3, scores


def test_placing_the_important_documents_first_is_order_invariant_too():
    model = tiny_model("llama")
    scores = _scores_in_orders(model, Pine(important_first=True), ORDERS[:2])
    (nearest,) = _scores_in_orders(model, Pine(), ORDERS[:1])
    assert max(scores) - min(scores) < 1e-4, scores
    assert abs(scores[0] - nearest) > 1e-4  # another placement: another answer


def test_a_smooth_sort_is_order_invariant_and_becomes_the_hard_sort_as_it_sharpens():
    model = tiny_model("llama")
    smooth = _scores_in_orders(model, Pine(softness=0.5))
    (sharp,) = _scores_in_orders(model, Pine(softness=1e-6), ORDERS[:1])
    (hard,) = _scores_in_orders(model, Pine(), ORDERS[:1])
    assert max(smooth) - min(smooth) < 1e-4, smooth
    assert abs(smooth[0] - hard) > 1e-4  # the documents stand elsewhere
    assert abs(sharp - hard) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_isolated_documents_are_order_invariant(arch):
    model = tiny_model(arch, **ARCHS[arch])
    scores = _scores_in_orders(model, Pine(isolated=True))
    (both_ways,) = _scores_in_orders(model, Pine(), ORDERS[:1])
    assert max(scores) - min(scores) < 1e-4, scores
    assert abs(scores[0] - both_ways) > 1e-4  # the documents read each other under plain PINE


def test_an_isolated_document_reads_as_if_it_stood_alone_first():
    # Each document's rows see only the text before the documents and the document itself, at
    # the positions it would have right after that text: the model's rows for prefix + document.
    model = tiny_model("qwen2", **FULL_ATTENTION)
    prefix, documents, suffix = _blocks()
    ids, spans = block_prompt(prefix, documents, suffix)
    with rescaled(model, Pine(isolated=True)):
        together = logits(model, ids, spans)
    for (start, end), document in zip(spans, documents, strict=True):
        alone = logits(model, prefix + document)
        torch.testing.assert_close(together[start:end], alone[len(prefix) :], atol=2e-5, rtol=1e-5)


def test_isolated_cached_decoding_equals_one_full_forward():
    model = tiny_model("llama")
    ids, spans = block_prompt(*_blocks())
    prompt = len(ids) - ANSWER
    rescale(model, Pine(isolated=True))
    full = logits(model, ids, spans)[prompt - 1 : -1]
    torch.testing.assert_close(incremental_logits(model, ids, spans, prompt), full, atol=2e-5, rtol=1e-5)


def test_isolated_needs_the_documents_rows_recomputed():
    with pytest.raises(ValueError, match="choose one"):
        Pine(isolated=True, bidirectional=False)


def test_no_documents_is_the_unmodified_model():
    model = tiny_model("llama")
    prefix, documents, suffix = _blocks()
    ids, _ = block_prompt(prefix, documents, suffix)
    before = logits(model, ids)
    with rescaled(model, Pine()):
        assert torch.equal(logits(model, ids, []), before)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_text_before_the_documents_is_untouched(attn):
    model = tiny_model("llama", attn=attn)
    ids, spans = block_prompt(*_blocks())
    before = logits(model, ids)
    with rescaled(model, Pine()):
        after = logits(model, ids, spans)
    torch.testing.assert_close(after[: spans[0][0]], before[: spans[0][0]], atol=1e-6, rtol=1e-6)
    assert (after[spans[0][0] :] - before[spans[0][0] :]).abs().max() > 1e-3


def test_a_single_document_is_read_as_the_unmodified_model_reads_it():
    # One document: nothing to reorder and no other document to read, so PINE changes nothing.
    model = tiny_model("qwen2", **FULL_ATTENTION)
    prefix, documents, suffix = _blocks()
    ids, spans = block_prompt(prefix, documents[:1], suffix)
    before = logits(model, ids)
    with rescaled(model, Pine()):
        torch.testing.assert_close(logits(model, ids, spans), before, atol=2e-5, rtol=1e-5)


def test_cached_decoding_equals_one_full_forward():
    model = tiny_model("llama")
    ids, spans = block_prompt(*_blocks())
    prompt = len(ids) - ANSWER
    rescale(model, Pine())
    full = logits(model, ids, spans)[prompt - 1 : -1]
    torch.testing.assert_close(incremental_logits(model, ids, spans, prompt), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_left_padded_batch_equals_each_prompt_alone(attn):
    # Padding gives the attention a mask of its own: the rows PINE leaves to the model's kernel
    # (before the documents) are computed from that mask cut to those rows.
    model = tiny_model("llama", attn=attn)
    first, first_spans = block_prompt(*_blocks(seed=1))
    prefix, documents, suffix = _blocks(seed=2, documents=3)
    second, second_spans = block_prompt(prefix[:2], documents, suffix)
    rescale(model, Pine())
    alone = [logits(model, first, first_spans), logits(model, second, second_spans)]
    with document_spans(model, [first_spans, second_spans]), torch.no_grad():
        out = model(**left_padded([first, second])).logits
    torch.testing.assert_close(out[0, -len(first) :], alone[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, -len(second) :], alone[1], atol=2e-5, rtol=1e-5)


def test_causal_pine_leaves_the_documents_rows_and_replaces_them_for_the_question():
    model = tiny_model("llama")
    ids, spans = block_prompt(*_blocks())
    end = spans[-1][1]
    before = logits(model, ids)
    with rescaled(model, Pine(bidirectional=False)):
        after = logits(model, ids, spans)
        prompt = len(ids) - ANSWER
        torch.testing.assert_close(
            incremental_logits(model, ids, spans, prompt), after[prompt - 1 : -1], atol=2e-5, rtol=1e-5
        )
    torch.testing.assert_close(after[:end], before[:end], atol=2e-5, rtol=1e-5)
    assert (after[end:] - before[end:]).abs().max() > 1e-3
    with rescaled(model, Pine()):
        assert (logits(model, ids, spans)[end:] - after[end:]).abs().max() > 1e-3


def test_pine_in_some_layers_only():
    model = tiny_model("llama")
    ids, spans = block_prompt(*_blocks())
    before = logits(model, ids)
    with rescaled(model, Pine(layers=[])):
        torch.testing.assert_close(logits(model, ids, spans), before, atol=1e-6, rtol=1e-6)
    with rescaled(model, Pine()):
        everywhere = logits(model, ids, spans)
    with rescaled(model, Pine(layers=[1, 3])):
        some = logits(model, ids, spans)
    assert (some - before).abs().max() > 1e-3 and (some - everywhere).abs().max() > 1e-3
    with pytest.raises(ValueError, match="Pine.layers has \\[9\\]"):
        rescale(model, Pine(layers=[9]))
    with pytest.raises(ValueError, match="non-negative layer indices"):
        Pine(layers=[-1])


def test_models_with_sliding_windows_are_refused():
    with pytest.raises(ValueError, match="sliding window"):
        rescale(tiny_model("mistral"), Pine())


def test_spec_names_pine():
    assert parse_method("pine") == Pine()
    assert parse_method("pine:0.5") == Pine(softness=0.5)
    with pytest.raises(ValueError, match="softness must be 0"):
        parse_method("pine:-1")
    with pytest.raises(ValueError, match="does not compose with other methods: it computes the attention"):
        parse_method("pine+mspoe")


@pytest.mark.slow
def test_permuting_documents_leaves_the_embedded_models_answer_unchanged(embedded):
    from rag_mspoe.prompts.chat_template import render_text

    model, tokenizer = embedded
    documents = [
        "(Title: Lanterns) The harbour lantern burns for nine hours on one filling of oil.\n",
        "(Title: Bridges) The old stone bridge was rebuilt after the flood of 1841.\n",
        "(Title: Bakery) The bakery on the square opens at six and sells rye bread first.\n",
    ]
    marker = "@@DOCUMENTS@@"
    text = render_text(
        tokenizer, f"Answer from the search results.\n\n{marker}\nQuestion: How long does the lantern burn?"
    )
    before, after = text.split(marker)

    def tokens(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    answer = tokens("Nine hours.")
    # Each piece tokenized alone: permuting the documents permutes whole token blocks.
    prompts = [
        block_prompt(tokens(before), [tokens(documents[i]) for i in order], tokens(after))
        for order in itertools.permutations(range(3))
    ]
    with in_dtype(model, torch.float32):
        unmodified = [answer_loglikelihood(model, ids + answer, spans, len(answer)) for ids, spans in prompts]
        with rescaled(model, Pine()):
            scores = [answer_loglikelihood(model, ids + answer, spans, len(answer)) for ids, spans in prompts]
    assert max(unmodified) - min(unmodified) > 1e-2, unmodified
    assert max(scores) - min(scores) < 1e-3, scores


def _rendered_benchmark_prompts(tokenizer: Any) -> tuple[list[tuple[list[int], list[tuple[int, int]]]], int]:
    """Three orders of 8 documents in the benchmark's layout, through the real chat template and
    tokenizer (the tokens at the documents' edges are the tokenizer's own), each with the answer's
    tokens after it; and the answer's length. The last document stays last: its closing text
    meets the question's blank line, not the next document, so it is tokenized differently."""
    lines = (Path(__file__).parent / "data" / "nq-open-sample-passages.jsonl").read_text().splitlines()
    passages = [json.loads(line) for line in lines][:8]
    answer = list(tokenizer("Wilhelm Conrad Röntgen", add_special_tokens=False)["input_ids"])

    def prompt(order: tuple[int, ...]) -> tuple[list[int], list[tuple[int, int]]]:
        documents = [(passages[i]["title"], passages[i]["text"]) for i in (*order, 7)]
        question = "who got the first nobel prize in physics\nAnswer:"
        ids, spans = unnumbered_documents_prompt(tokenizer, documents, question)
        return ids + answer, spans

    orders = [(0, 1, 2, 3, 4, 5, 6), (6, 4, 2, 0, 1, 3, 5), (3, 5, 6, 1, 0, 2, 4)]
    return [prompt(order) for order in orders], len(answer)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_embedded_model_is_order_invariant_on_a_rendered_benchmark_prompt_in_every_dtype(embedded, dtype):
    model, tokenizer = embedded
    prompts, answer = _rendered_benchmark_prompts(tokenizer)
    # PINE reads q and k before RoPE and sums over the documents in an order of their content, so
    # the orders compute the same numbers: 0.0 nats apart in every dtype (before: 0.3 in bf16,
    # 2e-4 in fp32 on 4 documents).
    with in_dtype(model, dtype):
        unmodified = [answer_loglikelihood(model, ids, spans, answer) for ids, spans in prompts]
        with rescaled(model, Pine()):
            scores = [answer_loglikelihood(model, ids, spans, answer) for ids, spans in prompts]
    assert max(unmodified) - min(unmodified) > 1e-2, unmodified
    assert max(scores) - min(scores) < 1e-3, scores


@pytest.mark.slow
def test_a_smooth_sort_keeps_the_order_invariance_in_fp32(embedded):
    model, tokenizer = embedded
    prompts, answer = _rendered_benchmark_prompts(tokenizer)
    with in_dtype(model, torch.float32), rescaled(model, Pine(softness=1.0)):
        scores = [answer_loglikelihood(model, ids, spans, answer) for ids, spans in prompts]
    assert max(scores) - min(scores) < 1e-4, scores


def test_continuations_of_one_prefilled_prompt_equal_full_forwards():
    # How the engine scores several answers: prefill once, expand the cache, run the answers.
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids, spans = block_prompt(*_blocks())
    prompt, answers = ids[:-ANSWER], [ids[-ANSWER:], ids[-ANSWER:][::-1]]
    rescale(model, Pine())
    cache = DynamicCache(config=model.config)
    with document_spans(model, [spans]), torch.no_grad():
        model(input_ids=torch.tensor([prompt]), **cache_argument(cache), use_cache=True)
        cache.batch_repeat_interleave(2)
        together = model(input_ids=torch.tensor(answers), **cache_argument(cache), use_cache=True).logits
    for row, answer in enumerate(answers):
        alone = logits(model, prompt + answer, spans)[-ANSWER:]
        torch.testing.assert_close(together[row], alone, atol=2e-5, rtol=1e-5)
