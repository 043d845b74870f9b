"""Positional hidden-state scaling: only the last prompt row changes, and cached decoding is exact."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCH_NAMES, prompt_ids, tiny_model

from rag_mspoe import Compose, HiddenScale, Uniform, rescaled
from rag_mspoe.rope.hooks import cache_argument, returned_cache

DIMENSION = 5


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.fixture(params=ARCH_NAMES)
def arch(request):
    return request.param


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_factor_one_matches_the_unmodified_model(arch, attn):
    model = tiny_model(arch, attn=attn)
    ids = prompt_ids()
    base = logits(model, ids)
    with rescaled(model, HiddenScale(dimension=DIMENSION, factor=1.0, layers=[1, 2, 3])):
        torch.testing.assert_close(logits(model, ids), base, atol=2e-5, rtol=1e-4)


def test_only_the_last_row_changes(arch):
    model = tiny_model(arch)
    ids = prompt_ids()
    base = logits(model, ids)
    with rescaled(model, HiddenScale(dimension=DIMENSION, factor=-4.0, layers=[1, 2, 3])):
        out = logits(model, ids)
    assert torch.equal(out[:, :-1], base[:, :-1])
    assert not torch.allclose(out[:, -1], base[:, -1], atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_decoding_matches_a_full_forward_with_more_scaled_rows(arch, attn):
    """Decoding k tokens after the prompt equals one forward whose last k + 1 rows take the scaled path."""
    model = tiny_model(arch, attn=attn)
    ids = prompt_ids(length=24)
    prompt_length, layers = 16, [0, 2, 3]
    with torch.no_grad(), rescaled(model, HiddenScale(dimension=DIMENSION, factor=-2.0, layers=layers)):
        out = model(ids[:, :prompt_length], use_cache=True)
        steps, cache = [out.logits[:, -1:]], returned_cache(out)
        for t in range(prompt_length, ids.shape[1]):
            out = model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True)
            cache = returned_cache(out)
            steps.append(out.logits)
    rows = ids.shape[1] - prompt_length + 1
    with rescaled(model, HiddenScale(dimension=DIMENSION, factor=-2.0, layers=layers, last_rows=rows)):
        full = logits(model, ids)[:, -rows:]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=5e-5, rtol=1e-4)


def test_left_padded_batch_matches_each_prompt_alone(arch):
    model = tiny_model(arch)
    long, short = prompt_ids(length=20, seed=2)[0], prompt_ids(length=13, seed=3)[0]
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, 7:], mask[1, 7:] = short, 1
    kwargs = dict(
        max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    with rescaled(model, HiddenScale(dimension=DIMENSION, factor=0.0, layers=[1, 2])), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kwargs)
        alone = [
            model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
            for p in (long, short)
        ]
    for row, single in enumerate(alone):
        for step_batch, step_single in zip(batch.logits, single.logits, strict=True):
            torch.testing.assert_close(step_batch[row], step_single[0], atol=5e-5, rtol=1e-4)


def test_default_layers_are_the_middle_of_the_model():
    assert HiddenScale(dimension=0).layer_indices(32, 64) == list(range(10, 26))
    with pytest.raises(ValueError, match="outside the model's hidden size 64"):
        HiddenScale(dimension=64).layer_indices(32, 64)
    with pytest.raises(ValueError, match="needs the hidden `dimension`"):
        HiddenScale()
    with pytest.raises(ValueError, match="does not compose"):
        Compose([HiddenScale(dimension=1), Uniform(1.5)])
