"""The real embedded SmolLM2-135M-Instruct under every named method."""

from __future__ import annotations

import pytest
import torch

from rag_mspoe import NAMED_METHODS, frozen_head_order, parse_method, rescaled
from rag_mspoe.attention import document_spans, prompt_with_spans
from rag_mspoe.attention.document_hooks import RowDocuments
from rag_mspoe.attention.pine_hooks import document_blocks
from rag_mspoe.methods import AttentionCalibration, Pine
from rag_mspoe.prompts.qa_prompt import render_qa_prompt
from rag_mspoe.rope.hooks import cache_argument, returned_cache

# Methods that read the prompt alone; those that need the documents' spans are tested below.
PROMPT_ONLY_METHODS = [name for name in NAMED_METHODS if not parse_method(name).needs_document_spans()]

QUESTIONS = [
    ("What is the capital of France?", "paris"),
    ("What is the capital of Germany?", "berlin"),
]


def answer(model, tokenizer, question, max_new_tokens=16):
    messages = [{"role": "user", "content": question}]
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none", *PROMPT_ONLY_METHODS])
def test_embedded_model_answers_under_each_method(embedded, name):
    model, tokenizer = embedded
    with rescaled(model, parse_method(name)):
        for question, expected in QUESTIONS:
            reply = answer(model, tokenizer, question)
            assert expected in reply.lower(), f"{name}: {question!r} -> {reply!r}"


DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps."),
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention-calibration", "pine"])
def test_embedded_model_answers_over_documents_under_attention_methods(embedded, tmp_path, name):
    from rag_mspoe.attention import estimate_positional_bias

    model, tokenizer = embedded
    prompt, char_spans = render_qa_prompt("What is the capital of France?", DOCUMENTS)
    ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
    if name == "pine":
        method = Pine()
    else:
        bias = tmp_path / "bias.json"
        estimate_positional_bias(model, tokenizer, len(DOCUMENTS), save=bias)
        method = AttentionCalibration(bias=str(bias))
    with rescaled(model, method), document_spans(model, [spans]), torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    reply = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "paris" in reply.lower(), f"{name}: {reply!r}"


@pytest.fixture(scope="module")
def embedded_fp32():
    from rag_mspoe import load_model

    return load_model(dtype=torch.float32)


@pytest.mark.slow
def test_embedded_model_reads_each_isolated_document_as_a_lone_one(embedded_fp32):
    # Real chat template and tokenizer: each document's rows (with the separator after it) are
    # the model's rows for the text before the documents followed by that document alone.
    model, tokenizer = embedded_fp32
    prompt, char_spans = render_qa_prompt("What is the capital of France?", DOCUMENTS)
    ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
    begin = spans[0][0]
    with rescaled(model, Pine(isolated=True)), document_spans(model, [spans]), torch.no_grad():
        together = model(torch.tensor([ids])).logits[0]
    for start, end in document_blocks(RowDocuments(tuple(spans))):
        with torch.no_grad():
            alone = model(torch.tensor([ids[:begin] + ids[start:end]])).logits[0, begin:]
        torch.testing.assert_close(together[start:end], alone, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mspoe", "mspoe-query-head", "layerwise"])
def test_embedded_model_cached_decoding_matches_full_forward(embedded_fp32, name):
    model, tokenizer = embedded_fp32
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt")["input_ids"]
    prompt_length = ids.shape[1] - 6
    with rescaled(model, parse_method(name)), torch.no_grad():
        out = model(ids[:, :prompt_length], use_cache=True)
        steps, cache = [out.logits[:, -1:]], returned_cache(out)
        for t in range(prompt_length, ids.shape[1]):
            out = model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True)
            steps.append(out.logits)
        with frozen_head_order(model):
            full = model(ids).logits[:, prompt_length - 1 :]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-4, rtol=1e-4)
