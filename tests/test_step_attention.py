"""Attention on the CPU: decoding steps in float32 products, bf16 prompts read whole in blocks of
query rows; the same attention as SDPA's, masks and all, and as exact as its kernel."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_models import ARCH_NAMES, prompt_ids, tiny_model, tiny_tokenizer

from rag_mspoe import load_model, rescale, unrescale
from rag_mspoe.attention import document_spans
from rag_mspoe.methods import AttentionCalibration
from rag_mspoe.models import embedded_models, step_attention
from rag_mspoe.models.prompt_attention import BLOCK_ROWS, blocked_causal_attention
from rag_mspoe.models.step_attention import (
    NAME,
    STEP_TOKENS,
    STEPS_ONLY_NAME,
    float32_attention,
    use_step_attention,
)


def _tensors(batch: int, heads: int, kv_heads: int, rows: int, keys: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(rows * 100 + keys)
    shape = (batch, heads, rows, 16), (batch, kv_heads, keys, 16)
    query = torch.randn(*shape[0], generator=generator).to(dtype)
    key, value = (torch.randn(*shape[1], generator=generator).to(dtype) for _ in range(2))
    return query, key, value


def _sdpa(query, key, value, mask=None, is_causal=False, scale=None):
    """torch's SDPA in float64, KV heads repeated: the reference, [B, Tq, H, D]."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(group, dim=1) for t in (key, value))
    mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(
        query.double(), key, value, attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return out.transpose(1, 2)


def _cached_causal(rows: int, keys: int) -> torch.Tensor:
    """Each of the last `rows` rows reads the keys up to its own."""
    return torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)[None, None]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows", "keys", "mask_kind"),
    [
        (4, 2, 1, 9, "none"),  # a decoding step
        (4, 2, 5, 14, "bool"),  # a drafted step's check over a cache
        (6, 6, 3, 7, "bool"),  # no grouped KV heads
        (4, 1, 4, 10, "additive"),
        (4, 2, 1, 9, "padding"),  # a batch whose first row is left-padded
    ],
)
def test_float32_attention_equals_sdpa(heads, kv_heads, rows, keys, mask_kind):
    batch = 2 if mask_kind == "padding" else 1
    query, key, value = _tensors(batch, heads, kv_heads, rows, keys)
    mask = None
    if mask_kind == "bool":
        mask = _cached_causal(rows, keys)
    elif mask_kind == "additive":
        bias = 0.3 * torch.randn(1, heads, rows, keys)
        mask = torch.where(_cached_causal(rows, keys), 0.0, float("-inf")) + bias
    elif mask_kind == "padding":
        mask = torch.ones(batch, 1, rows, keys, dtype=torch.bool)
        mask[0, :, :, :3] = False
    got = float32_attention(query, key, value, mask, None)
    assert got.shape == (batch, rows, heads, 16)
    torch.testing.assert_close(got.double(), _sdpa(query, key, value, mask), atol=1e-5, rtol=1e-5)


def test_bf16_inputs_are_attended_in_float32_more_exactly_than_the_bf16_kernel():
    query, key, value = _tensors(1, 12, 2, 1, 600, dtype=torch.bfloat16)
    query = query * 4  # scores large enough for the kernel's rounding to show
    exact = _sdpa(query, key, value)
    ours = (float32_attention(query, key, value, None, None).double() - exact).abs().max()
    kernel = F.scaled_dot_product_attention(query, key, value, enable_gqa=True).transpose(1, 2)
    assert ours <= (kernel.double() - exact).abs().max()
    assert ours < 1e-2  # within bf16's rounding of the output


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows"), [(12, 2, 2 * BLOCK_ROWS + 37), (4, 4, BLOCK_ROWS - 5)]
)
@pytest.mark.parametrize("magnitude", [1.0, 40.0, 3000.0])
def test_a_bf16_prompt_read_whole_is_as_close_to_float64_as_the_kernel(heads, kv_heads, rows, magnitude):
    # Scores in the tens and thousands, as real layers have (the Qwen models' first layer runs to
    # ~10^5 before scaling): a plain bf16 product rounds them by more than softmax forgives.
    generator = torch.Generator().manual_seed(rows)
    query = (magnitude * torch.randn(1, heads, rows, 64, generator=generator)).bfloat16()
    key, value = (torch.randn(1, kv_heads, rows, 64, generator=generator).bfloat16() for _ in range(2))
    exact = _sdpa(query, key, value, is_causal=True)
    ours = blocked_causal_attention(query, key, value, 64**-0.5)
    kernel = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    assert ours.shape == (1, rows, heads, 64)
    assert _relative_error(ours, exact) <= 1.5 * _relative_error(kernel.transpose(1, 2), exact) + 1e-4


@pytest.fixture
def block_calls(monkeypatch) -> list[int]:
    """Grows by one for each call `step_attention` makes to `blocked_causal_attention`."""
    calls: list[int] = []
    blocked = step_attention.blocked_causal_attention
    monkeypatch.setattr(
        step_attention, "blocked_causal_attention", lambda *args: calls.append(1) or blocked(*args)
    )
    return calls


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_bf16_model_reads_prompts_in_blocks_as_exactly_as_through_sdpa(arch, block_calls):
    exact = tiny_model(arch)  # float32
    stock, ours = copy.deepcopy(exact).bfloat16(), copy.deepcopy(exact).bfloat16()
    use_step_attention(ours)
    ids = prompt_ids(BLOCK_ROWS + 50)  # two blocks, past the sliding windows of 12
    padded = torch.cat([torch.zeros_like(ids[:, :5]), ids[:, :-5]], dim=1)  # a batch read takes SDPA
    with torch.inference_mode():
        reference = exact(ids).logits.double()
        got, kernel = ours(ids).logits, stock(ids).logits
        pair = {"input_ids": torch.cat([ids, padded]), "attention_mask": torch.cat([ids.ne(0), padded.ne(0)])}
        batch, stock_batch = ours(**pair).logits, stock(**pair).logits
    # The layers attending to the whole prompt took the blocks; the tiny Mistral has none (every
    # layer's window of 12 comes as a mask, which SDPA reads).
    assert bool(block_calls) == (arch != "mistral")
    assert _relative_error(got, reference) <= 1.5 * _relative_error(kernel, reference) + 1e-4
    torch.testing.assert_close(batch, stock_batch, atol=0, rtol=0)


def _pieces_against_whole(model) -> float:
    """The largest change of the last 30 rows' logits when `model` reads them after a kept start
    instead of in one whole read."""
    from transformers.cache_utils import DynamicCache

    ids = prompt_ids(BLOCK_ROWS + 50)
    start, rest = ids[:, : BLOCK_ROWS + 20], ids[:, BLOCK_ROWS + 20 :]
    with torch.inference_mode():
        whole = model(ids).logits[:, -rest.shape[1] :].float()
        cache = DynamicCache(config=model.config)
        model(start, past_key_values=cache)
        pieces = model(rest, past_key_values=cache).logits.float()
    return float((pieces - whole).abs().max())


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_the_rest_of_a_bf16_prompt_after_a_kept_start_reads_as_the_whole_read_does(arch, monkeypatch):
    ours = tiny_model(arch).bfloat16()
    use_step_attention(ours)
    blocks = _pieces_against_whole(ours)
    monkeypatch.setattr(step_attention, "_plainly_causal_after_start", lambda *args: False)
    kernel = _pieces_against_whole(ours)  # the rest through SDPA, as before
    assert blocks <= kernel
    if not getattr(ours.config, "sliding_window", None):  # windowed layers take SDPA both ways
        assert blocks == 0  # row for row what the whole read computed
        assert kernel > 0


def test_a_model_without_prompt_blocks_reads_prompts_through_the_kernel(block_calls):
    stock = tiny_model("qwen2").bfloat16()
    ours = copy.deepcopy(stock)
    use_step_attention(ours, prompt_blocks=False)
    assert ours.config._attn_implementation == STEPS_ONLY_NAME
    ids = prompt_ids(BLOCK_ROWS + 50)
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, atol=0, rtol=0)
    assert not block_calls


def test_blocks_load_only_on_a_quantised_path_of_a_model_measured_with_them(tmp_path, monkeypatch):
    tiny_model("qwen2").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    measured = embedded_models.MODELS["qwen2.5-coder-1.5b-instruct"]
    assert not measured.prompt_blocks  # its default path drifted past the bound with them
    monkeypatch.setattr(embedded_models, "prepare", lambda name: tmp_path)
    model, _ = load_model(measured.name, dtype=torch.float32, device="cpu", threads=1, quantize="none")
    assert model.config._attn_implementation == STEPS_ONLY_NAME
    other, _ = load_model(
        "qwen2.5-coder-0.5b-instruct", dtype=torch.float32, device="cpu", threads=1, quantize="int8"
    )
    assert other.config._attn_implementation == NAME
    # Unquantised, the model measured with blocks reads prompts as stock transformers does.
    plain, _ = load_model(
        "qwen2.5-coder-0.5b-instruct", dtype=torch.float32, device="cpu", threads=1, quantize="none"
    )
    assert plain.config._attn_implementation == STEPS_ONLY_NAME


def _decoded_logits(model, ids: torch.Tensor, steps: int, drafted: int) -> torch.Tensor:
    """Logits of a prompt read whole, then `steps` single-token steps, then one call of `drafted`
    tokens, all through the model's cache: [rows, vocab]."""
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        follow = prompt_ids(steps + drafted, seed=7)
        for step in range(steps):
            out = model(follow[:, step : step + 1], past_key_values=cache, use_cache=True)
            rows.append(out.logits[0])
        out = model(follow[:, steps:], past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
    return torch.cat(rows)


@pytest.mark.parametrize("prompt_blocks", [True, False])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_decoding_through_step_attention_equals_sdpa_and_the_full_read(arch, prompt_blocks):
    stock = tiny_model(arch)
    ours = tiny_model(arch)
    use_step_attention(ours, prompt_blocks=prompt_blocks)
    assert ours.config._attn_implementation == (NAME if prompt_blocks else STEPS_ONLY_NAME)
    ids = prompt_ids(STEP_TOKENS + 4)  # the prompt itself is read by SDPA
    steps, drafted = 15, 4  # past the tiny Qwen2's and Mistral's sliding windows of 12
    expected = _decoded_logits(stock, ids, steps, drafted)
    got = _decoded_logits(ours, ids, steps, drafted)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    whole = torch.cat([ids, prompt_ids(steps + drafted, seed=7)], dim=1)
    with torch.inference_mode():
        full = ours(whole).logits[0]
    torch.testing.assert_close(got, full, atol=2e-5, rtol=1e-4)


def test_a_short_prompt_read_whole_is_causal():
    stock, ours = tiny_model("llama"), tiny_model("llama")
    use_step_attention(ours)
    ids = prompt_ids(6)  # every row through the float32 products, no mask given
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, atol=2e-5, rtol=1e-4)


def test_load_model_uses_it_on_the_cpu_unless_an_implementation_is_named(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype=torch.float32, device="cpu", threads=1)
    assert model.config._attn_implementation == STEPS_ONLY_NAME  # not quantised: stock prompts
    quantised, _ = load_model(tmp_path, dtype=torch.float32, device="cpu", threads=1, quantize="int8")
    assert quantised.config._attn_implementation == NAME
    named, _ = load_model(tmp_path, dtype=torch.float32, device="cpu", threads=1, attn_implementation="sdpa")
    assert named.config._attn_implementation == "sdpa"
    eager = tiny_model("qwen2", attn="eager")
    use_step_attention(eager)  # only a model on SDPA changes
    assert eager.config._attn_implementation == "eager"


def test_an_attention_level_method_runs_over_it_and_hands_it_back():
    model = tiny_model("llama")
    use_step_attention(model)
    ids = prompt_ids(STEP_TOKENS + 4)
    before = _decoded_logits(model, ids, 3, 2)
    rescale(model, AttentionCalibration(bias="zero"))
    assert model.config._attn_implementation not in (NAME, "sdpa")
    with document_spans(model, [[(2, 8), (8, 14)]]), torch.inference_mode():
        calibrated = _decoded_logits(model, ids, 3, 2)
    assert not torch.allclose(calibrated, before)  # the method's attention ran
    unrescale(model)
    assert model.config._attn_implementation == NAME
    torch.testing.assert_close(_decoded_logits(model, ids, 3, 2), before, atol=0, rtol=0)
