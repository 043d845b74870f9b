"""The unmodified model's KV caches of prompt starts (`DocumentPrefixCache`): a start that several
prefixes share is computed once, and a prefix run on a copy of it holds the cache the whole prefix
gives when run in one go."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCH_NAMES, tiny_model

from rag_mspoe.engine.document_prefix import DocumentPrefixCache


def counting_rows(model):
    """Wrap the model's forward to count the token rows it runs."""
    rows: list[int] = []
    forward = model.forward

    def counted(input_ids=None, **kwargs):
        rows.append(int(input_ids.shape[1]))
        return forward(input_ids=input_ids, **kwargs)

    model.forward = counted
    return rows


def layer_tensors(cache):
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_shared_start_is_run_once_and_changes_no_cache(arch):
    model = tiny_model(arch)
    template = list(range(3, 11))
    prefixes = [[*template, *range(20 + 7 * k, 26 + 7 * k)] for k in range(3)]
    shared_cache, whole_cache = DocumentPrefixCache(model), DocumentPrefixCache(model)
    rows = counting_rows(model)
    shared = [shared_cache.copy_of(prefix, shared=len(template)) for prefix in prefixes]
    assert rows == [len(template), 6, 6, 6]  # the template once, then each prefix's own rows
    assert shared_cache.computed == 4
    for prefix, cache in zip(prefixes, shared, strict=True):
        whole = whole_cache.copy_of(prefix)
        for mine, theirs in zip(layer_tensors(cache), layer_tensors(whole), strict=True):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    # Asked again, nothing runs; a prefix no longer than the shared start is run as it is.
    rows.clear()
    shared_cache.copy_of(prefixes[1], shared=len(template))
    shared_cache.copy_of(template[:5], shared=len(template))
    assert rows == [5]


def full_attention_model(arch: str, attn: str):
    """A tiny model whose layers all attend to every earlier row (the tiny Qwen2 has sliding ones)."""
    if arch == "qwen2":
        return tiny_model(arch, attn, use_sliding_window=False, layer_types=["full_attention"] * 4)
    return tiny_model(arch, attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prefix_kept_with_its_first_layers_is_finished_into_the_rows_of_one_forward(arch, attn):
    model = full_attention_model(arch, attn)
    prefix = list(range(3, 40))
    cut, whole = DocumentPrefixCache(model), DocumentPrefixCache(model)
    lower = cut.first_layers_of(prefix, 2)
    filled = [layer for layer in lower.layers if getattr(layer, "keys", None) is not None]
    assert len(filled) == 2  # the upper layers did not run
    reference = whole.copy_of(prefix)
    for mine, theirs in zip(layer_tensors(lower)[:4], layer_tensors(reference)[:4], strict=True):
        assert torch.equal(mine, theirs)
    # Wanted whole (a copy, or an answer that starts with the prefix), it is finished once.
    finished = cut.copy_of(prefix)
    for mine, theirs in zip(layer_tensors(finished), layer_tensors(reference), strict=True):
        assert torch.equal(mine, theirs)
    again = DocumentPrefixCache(model)
    again.first_layers_of(prefix, 3)
    start, length = again.start_of([*prefix, 50, 51], at_least=10)
    assert length == len(prefix)
    for mine, theirs in zip(layer_tensors(start), layer_tensors(reference), strict=True):
        assert torch.equal(mine, theirs)
    assert cut.computed == again.computed == 1


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3_text"])
def test_a_model_with_sliding_window_layers_is_not_cut(arch):
    model = tiny_model(arch)
    cache = DocumentPrefixCache(model).first_layers_of(list(range(3, 30)), 1)
    assert all(layer.keys.numel() for layer in cache.layers)


def test_a_prefix_kept_again_in_its_own_place_counts_once_against_the_budget():
    model = full_attention_model("llama", "sdpa")
    first, second = list(range(3, 40)), list(range(50, 87))
    whole = DocumentPrefixCache(model)
    whole.copy_of(first)
    cut = DocumentPrefixCache(model, max_bytes=2 * whole._bytes)  # room for two whole prefixes
    cut.first_layers_of(first, 1)
    cut.first_layers_of(first, 2)  # more layers than kept: kept again, in its place
    cut.copy_of(first)  # finished
    cut.copy_of(second)
    computed = cut.computed
    cut.copy_of(first)
    assert cut.computed == computed  # both still kept
