"""Prompts that start alike, read in one forward as a tree of their tokens: each prompt's logits are
the ones it gets read alone, and shared tokens are read once."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from rag_mspoe.attention.token_tree import TokenTree, tree_logits
from rag_mspoe.models import step_attention
from rag_mspoe.models.prompt_attention import blocked_masked_attention
from rag_mspoe.models.step_attention import use_step_attention

START = [5, 6, 7, 8, 9, 10, 11]
QUESTION = [40, 41, 42, 43, 44]


def _prompts() -> list[list[int]]:
    """A template, one document each, then either the question or its first words and a judge's
    question: the shape of a document ranking's prompts."""
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for length in (3, 9, 4, 17):
        document = torch.randint(12, 90, (length,), generator=generator).tolist()
        prompts.append([*START, *document, *QUESTION])
        prompts.append([*START, *document, *QUESTION[:2], 50, 51, 52])
    return prompts


def test_a_tree_holds_each_shared_token_once_and_each_prompt_as_a_path():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]
    tree = TokenTree.of(prompts, start=2)
    assert tree.tokens == [3, 4, 5, 6, 7]
    assert tree.parents == [-1, 0, 0, 2, -1]
    assert tree.depths == [0, 1, 1, 2, 0]
    assert [[tree.tokens[n] for n in path] for path in tree.paths] == [p[2:] for p in prompts]
    visible = tree.mask()
    assert visible.shape == (5, 2 + 5)
    assert visible[3].tolist() == [True, True, True, False, True, True, False]  # start, 3, 5, 6
    with pytest.raises(ValueError, match="shorter than the start"):
        TokenTree.of([[1]], start=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_prompt_reads_in_the_tree_as_it_reads_alone(arch, dtype):
    model = tiny_model(arch).to(dtype)
    use_step_attention(model)  # the attention a loaded model runs on the CPU
    prompts = _prompts()
    tree = TokenTree.of(prompts, len(START))
    assert len(tree.tokens) < sum(len(p) - len(START) for p in prompts)
    with torch.inference_mode():
        start = model(torch.tensor([START]), use_cache=True).past_key_values
    rows = [range(len(START) + 1, len(p)) for p in prompts]
    read = tree_logits(model, tree, start, rows)
    for prompt, prompt_rows, logits in zip(prompts, rows, read, strict=True):
        with torch.inference_mode():
            alone = model(torch.tensor([prompt])).logits[0].float()[list(prompt_rows)]
        tolerance = 1e-5 if dtype == torch.float32 else 0.015  # bf16: about 3x its rounding here
        torch.testing.assert_close(logits, alone, atol=tolerance, rtol=0)


def test_a_model_with_a_sliding_window_is_refused_by_name():
    model = tiny_model("mistral")
    tree = TokenTree.of(_prompts(), len(START))
    with pytest.raises(ValueError, match="sliding window"):
        tree_logits(model, tree, None, [[len(START)]] * len(tree.paths))


def test_a_tree_mask_read_in_blocks_of_visible_keys_equals_sdpa():
    tree = TokenTree.of(_prompts() * 3, len(START))  # > one block of rows, branches across blocks
    mask = tree.mask()[None, None]
    generator = torch.Generator().manual_seed(1)
    rows, keys = mask.shape[2], mask.shape[3]
    query = torch.randn(1, 4, rows, 16, generator=generator)
    key, value = (torch.randn(1, 2, keys, 16, generator=generator) for _ in range(2))
    stock = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask
    ).transpose(1, 2)
    ours = blocked_masked_attention(query, key, value, mask, 16**-0.5)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)


def test_only_a_tree_read_attends_in_blocks_of_visible_keys(monkeypatch):
    model = tiny_model("llama")
    use_step_attention(model)
    calls = []
    original = step_attention.blocked_masked_attention
    monkeypatch.setattr(
        step_attention, "blocked_masked_attention", lambda *a: calls.append(1) or original(*a)
    )
    prompts = _prompts()
    tree = TokenTree.of(prompts, 0)
    tree_logits(model, tree, None, [[len(p) - 1] for p in prompts])
    assert len(calls) == model.config.num_hidden_layers
    # A padded batch outside a tree read keeps SDPA's kernel.
    length = len(prompts[0])
    padded = torch.ones(2, length, dtype=torch.long)
    padded[1, :3] = 0
    with torch.inference_mode():
        model(torch.tensor([prompts[0], prompts[1][:length]]), attention_mask=padded)
    assert len(calls) == model.config.num_hidden_layers
