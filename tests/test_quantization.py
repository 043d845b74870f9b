"""quantize= on load: clear refusals, the manifest names the scheme, the embedded model still answers.

The layers themselves and the methods on them: tests/test_weight_only.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from rag_mspoe import load_model
from rag_mspoe.engine import Engine
from rag_mspoe.eval.runs.manifest import model_facts
from rag_mspoe.models.devices import default_dtype
from rag_mspoe.models.embedded_models import DEFAULT_MODEL
from rag_mspoe.models.quantization import (
    AUTO,
    INT4_DECODING,
    INT8_DECODING,
    INT8_PROMPT,
    INT8_PROMPT_INT4_DECODING,
    QuantizationError,
    answering_scheme,
    check_quantize,
    quantization_of,
    quantize_model,
    resolve_quantize,
)

QWEN_05B, QWEN_15B = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def test_quantisation_is_refused_on_a_gpu_and_with_another_dtype_with_the_fix():
    with pytest.raises(QuantizationError, match="CPU only.*--device cpu"):
        check_quantize("int4", torch.device("cuda", 0))
    with pytest.raises(QuantizationError, match="bfloat16 or float32, not float16; drop --dtype"):
        check_quantize("int8", torch.device("cpu"), "float16")
    with pytest.raises(QuantizationError, match="one of: auto, none, int4, int8"):
        check_quantize("int2", torch.device("cpu"))
    check_quantize("int8", torch.device("cpu"), "float32")
    check_quantize("int8", torch.device("cpu"), torch.bfloat16)
    check_quantize(None, torch.device("cuda", 0), "bfloat16")


def test_none_names_no_quantisation_and_the_schemes_are_checked():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_quantize("none", gpu) is None and resolve_quantize("int8", cpu) == "int8"
    with pytest.raises(QuantizationError, match="CPU only"):
        resolve_quantize("int4", gpu)


def test_load_model_quantizes_and_the_manifest_says_so(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    before = torch.get_num_threads()
    try:
        model, tokenizer = load_model(tmp_path / "m", threads=1, quantize="int4")
    finally:
        torch.set_num_threads(before)
    facts = model_facts(model)
    dtype = str(default_dtype("cpu")).removeprefix("torch.")  # the embeddings and norms
    assert facts["quantization"] == "int4" and facts["dtype"] == dtype
    result = Engine(model, tokenizer, method="mspoe").generate("abc", raw=True, max_new_tokens=3)
    assert result.completion_tokens == 3


@pytest.mark.slow
def test_embedded_int8_model_answers_and_scores_close_to_fp32_under_methods():
    fp32, tokenizer = load_model(dtype=torch.float32, threads=1)
    int8, _ = load_model(threads=1, quantize="int8")
    question, answer = "What is the capital of France?", "The capital of France is Paris."
    for method in ("none", "mspoe", "layerwise"):
        engine = Engine(int8, tokenizer, method=method)
        assert "paris" in engine.generate(question, max_new_tokens=12).text.lower(), method
        (total, tokens), (reference, _) = (
            Engine(model, tokenizer, method=method).score_continuations(question, [answer])[0]
            for model in (int8, fp32)
        )
        # int8 weights on the file's own 4-bit values; docs/cpu-inference.md has the 0.5B on real prompts.
        assert abs(total - reference) / tokens < 0.15, (method, total, reference)


def test_auto_is_a_models_measured_answering_scheme_on_the_cpu_and_none_elsewhere():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for dtype in (torch.bfloat16, "bfloat16"):
        assert answering_scheme(AUTO, QWEN_05B, cpu, dtype) == INT8_PROMPT
        # It decodes on its file's codes and int8 ones (docs/cpu-inference.md, int8-prompt+int4-decoding).
        assert answering_scheme(AUTO, QWEN_15B, cpu, dtype) == INT8_PROMPT_INT4_DECODING
    # SmolLM2 moved 0.083 nats/token (docs/cpu-inference.md); no measurement in float32 or on a GPU;
    # a folder or hub id: not measured.
    assert answering_scheme(AUTO, DEFAULT_MODEL, cpu, torch.bfloat16) is None
    # In float32 (a CPU without native bf16): decoding on int8 codes, the 1.5B on its file's 4-bit
    # codes where it has them (docs/cpu-inference.md); SmolLM2 not measured; float16 never.
    assert answering_scheme(AUTO, QWEN_05B, cpu, torch.float32) == INT8_DECODING
    assert answering_scheme(AUTO, QWEN_15B, cpu, "float32") == INT4_DECODING
    assert answering_scheme(AUTO, DEFAULT_MODEL, cpu, torch.float32) is None
    assert answering_scheme(AUTO, QWEN_05B, cpu, torch.float16) is None
    assert answering_scheme(AUTO, QWEN_05B, gpu, "auto") is None
    assert answering_scheme(AUTO, "my-model", cpu, torch.bfloat16) is None
    # A scheme named is the scheme used; "auto" is never refused, on any device.
    assert answering_scheme("int8", DEFAULT_MODEL, cpu, torch.float32) == "int8"
    assert answering_scheme(None, QWEN_05B, cpu, torch.bfloat16) is None
    assert resolve_quantize(AUTO, gpu, "float16") == AUTO


def test_auto_on_a_model_without_a_name_is_refused_with_the_fix():
    model = tiny_model("qwen2")
    with pytest.raises(QuantizationError, match="depends on the model's name.*load_model.*int8-prompt"):
        quantize_model(model, AUTO)


def test_engine_load_reads_the_prompt_in_int8_by_default_where_measured(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    before = torch.get_num_threads()
    try:
        # A folder: nothing measured, so "auto" loads it as it is; "int8-prompt" named applies.
        assert quantization_of(Engine.load(tmp_path / "m", threads=1).model) is None
        named = Engine.load(tmp_path / "m", threads=1, quantize=INT8_PROMPT)
        assert quantization_of(named.model) == INT8_PROMPT
    finally:
        torch.set_num_threads(before)


def test_int8_prompt_warns_where_this_cpus_int8_matmul_is_a_slow_fallback(monkeypatch):
    messages = {}
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quantize_model(tiny_model("llama"), INT8_PROMPT)
        messages[capability] = [str(w.message) for w in caught if "torch._int_mm" in str(w.message)]
    assert not messages["AVX512"]
    (message,) = messages["AVX2"]
    assert "AVX2" in message and "--quantize auto" in message
