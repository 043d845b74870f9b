"""Attention calibration: the properties that define it, on tiny random models of every architecture."""

from __future__ import annotations

import json

import pytest
import torch
from attention_helpers import block_prompt, incremental_logits, left_padded, logits, random_blocks
from tiny_models import ARCH_NAMES, tiny_model

from rag_mspoe import parse_method, rescale, rescaled, unrescale
from rag_mspoe.attention import PositionalBias, document_spans
from rag_mspoe.methods import AttentionCalibration, Compose, MsPoE, load_method


def _prompt(seed: int = 0, documents: int = 4) -> tuple[list[int], list[tuple[int, int]]]:
    blocks = random_blocks([5, *[6 + i for i in range(documents)], 7], seed)
    return block_prompt(blocks[0], blocks[1:-1], blocks[-1])


def _bias_file(tmp_path, model, documents: int, values: torch.Tensor | None = None) -> str:
    config = model.config
    shape = (config.num_hidden_layers, config.num_attention_heads, documents)
    table = values if values is not None else torch.linspace(0.0, 0.3, documents).expand(shape)
    path = tmp_path / "bias.json"
    PositionalBias("tiny", {documents: table.clone()}).save(path)
    return str(path)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_zero_bias_is_the_unmodified_model(arch):
    model = tiny_model(arch)
    ids, spans = _prompt()
    before = logits(model, ids)
    with rescaled(model, AttentionCalibration(bias="zero")):
        calibrated = logits(model, ids, spans)
    torch.testing.assert_close(calibrated, before, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bias_equal_in_every_slot_changes_nothing_and_a_sloped_one_does(arch, tmp_path):
    model = tiny_model(arch)
    ids, spans = _prompt()
    before = logits(model, ids)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    flat = _bias_file(tmp_path, model, 4, torch.full((layers, heads, 4), 0.2))
    with rescaled(model, AttentionCalibration(bias=flat)):
        torch.testing.assert_close(logits(model, ids, spans), before, atol=2e-5, rtol=1e-5)
    sloped = _bias_file(tmp_path, model, 4)
    with rescaled(model, AttentionCalibration(bias=sloped)):
        changed = logits(model, ids, spans)
    assert (changed[spans[-1][1] :] - before[spans[-1][1] :]).abs().max() > 1e-3
    # Rows before the last document are not calibrated.
    torch.testing.assert_close(changed[: spans[-1][1]], before[: spans[-1][1]], atol=2e-5, rtol=1e-5)


def test_strength_scales_the_bias_subtracted(tmp_path):
    model = tiny_model("llama")
    ids, spans = _prompt()
    before = logits(model, ids)
    sloped = _bias_file(tmp_path, model, 4)
    with rescaled(model, AttentionCalibration(bias=sloped, strength=0.0)):
        torch.testing.assert_close(logits(model, ids, spans), before, atol=2e-5, rtol=1e-5)
    changes = []
    for strength in (1.0, 2.0):
        with rescaled(model, AttentionCalibration(bias=sloped, strength=strength)):
            changes.append((logits(model, ids, spans) - before).abs().max())
    assert 1e-3 < changes[0] < changes[1]
    with pytest.raises(ValueError, match="strength must be 0 or more"):
        AttentionCalibration(strength=-1.0)


def test_no_documents_is_the_unmodified_model():
    model = tiny_model("llama")
    ids, _ = _prompt()
    before = logits(model, ids)
    with rescaled(model, AttentionCalibration(temperature=0.1, bias="zero")):
        assert torch.equal(logits(model, ids, []), before)


@pytest.mark.parametrize("temperature", [None, 0.05])
def test_cached_decoding_equals_one_full_forward(temperature, tmp_path):
    model = tiny_model("llama")
    ids, spans = _prompt()
    prompt = len(ids) - 4
    rescale(model, AttentionCalibration(temperature=temperature, bias=_bias_file(tmp_path, model, 4)))
    full = logits(model, ids, spans)[prompt - 1 : -1]
    torch.testing.assert_close(incremental_logits(model, ids, spans, prompt), full, atol=2e-5, rtol=1e-5)


def test_a_left_padded_batch_equals_each_prompt_alone(tmp_path):
    model = tiny_model("qwen2")
    first, first_spans = _prompt(seed=1)
    second, second_spans = _prompt(seed=2)
    second, second_spans = second[6:], [(s - 6, e - 6) for s, e in second_spans[1:]]  # 3 documents
    bias_path = tmp_path / "bias.json"
    config = model.config
    shape = (config.num_hidden_layers, config.num_attention_heads)
    PositionalBias("tiny", {n: torch.linspace(0.0, 0.3, n).expand(*shape, n).clone() for n in (3, 4)}).save(
        bias_path
    )
    rescale(model, AttentionCalibration(bias=str(bias_path)))
    alone = [logits(model, first, first_spans), logits(model, second, second_spans)]
    batch = left_padded([first, second])
    with document_spans(model, [first_spans, second_spans]), torch.no_grad():
        out = model(**batch).logits
    torch.testing.assert_close(out[0, -len(first) :], alone[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, -len(second) :], alone[1], atol=2e-5, rtol=1e-5)


def test_a_prompt_without_spans_fails_saying_how_to_pass_them():
    model = tiny_model("llama")
    rescale(model, AttentionCalibration(bias="zero"))
    with pytest.raises(ValueError, match=r"document_spans\(model, spans\)"), torch.no_grad():
        model(input_ids=torch.tensor([_prompt()[0]]))


def test_spans_beyond_the_prompt_are_refused():
    model = tiny_model("llama")
    rescale(model, AttentionCalibration(bias="zero"))
    with document_spans(model, [[(2, 400)]]), pytest.raises(ValueError, match="another prompt"):
        model(input_ids=torch.tensor([_prompt()[0]]))


def test_a_missing_reference_estimate_names_the_function_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path))
    model = tiny_model("llama")
    ids, spans = _prompt()
    rescale(model, AttentionCalibration())
    with document_spans(model, [spans]), pytest.raises(ValueError, match="estimate_positional_bias"):
        model(input_ids=torch.tensor([ids]))


def test_unrescale_restores_the_attention_implementation():
    model = tiny_model("llama")
    ids, spans = _prompt()
    before = logits(model, ids)
    rescale(model, "attention-calibration:0.5")
    assert model.config._attn_implementation != "sdpa"
    unrescale(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)


def test_config_round_trip_spec_and_composition(tmp_path):
    config = AttentionCalibration(temperature=0.2, layers=[1, 2], query_rows=3)
    assert load_method(config.save(tmp_path / "m.json")) == config
    assert json.loads((tmp_path / "m.json").read_text())["method"] == "attention-calibration"
    assert parse_method("attention-calibration") == AttentionCalibration()
    assert parse_method("attention-calibration:0.5") == AttentionCalibration(temperature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        AttentionCalibration(temperature=0)
    with pytest.raises(ValueError, match="does not compose"):
        Compose(methods=[MsPoE(), AttentionCalibration()])
    with pytest.raises(ValueError, match="does not compose"):
        parse_method("attention-calibration+pi")


def test_the_reference_bias_is_estimated_once_per_layout_and_then_used(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from rag_mspoe.attention import bias_cache_path, estimate_positional_bias, prompt_with_spans
    from rag_mspoe.models import embedded_models
    from rag_mspoe.prompts.qa_prompt import render_qa_prompt

    tokenizer = AutoTokenizer.from_pretrained(embedded_models.prepare("smollm2-135m-instruct"))
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path))
    model = tiny_model("llama", vocab_size=len(tokenizer))
    estimate = estimate_positional_bias(model, tokenizer, [3])
    table = estimate.layouts[3]
    assert table.shape == (4, 4, 3)
    assert bool((table >= 0).all()) and bool((table.sum(-1) <= 1 + 1e-6).all())
    assert bias_cache_path("").is_file()

    documents = [("Lanterns", "The lantern burns nine hours."), ("Bridges", "Rebuilt in 1841.")]
    prompt, char_spans = render_qa_prompt("How long does the lantern burn?", [*documents, documents[0]])
    ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
    rescale(model, AttentionCalibration(bias="zero"))
    before = logits(model, ids, spans)
    rescale(model, AttentionCalibration())
    after = logits(model, ids, spans)
    # A random model's bias is mild, but it is read and used: the last row moves.
    assert (after[-1] - before[-1]).abs().max() > 1e-5
    prompt, char_spans = render_qa_prompt("How long does the lantern burn?", documents)
    ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
    with pytest.raises(ValueError, match=r"estimate_positional_bias\(model, tokenizer, 2\)"):
        logits(model, ids, spans)
