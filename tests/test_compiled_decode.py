"""Every method stays on the compiled fast path: a cached decoding step compiles as one graph
(fullgraph=True, no graph break), does not recompile after warm-up, not even for a new prompt
with a new Ms-PoE head ranking, and decodes the tokens the eager model decodes.

The "eager" backend runs dynamo's tracing (where graph breaks and recompiles happen) without
inductor's code generation, so these tests stay fast on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from tiny_models import prompt_ids, tiny_model
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache

from rag_mspoe import Compose, HiddenScale, LayerWise, MsPoE, Uniform, rescale
from rag_mspoe.rope.hooks import cache_argument

ORDER = [[0, 1], [1, 0], [0, 1], [1, 0]]  # per layer, KV heads from most position-aware
QUERY_ORDER = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2], [2, 3, 0, 1]]
METHODS = {
    "none": None,
    "uniform": Uniform(1.7),
    "layerwise": LayerWise(factors=[1.0, 1.4, 2.2, 1.6]),
    "layerwise+pi": Compose([LayerWise(factors=[1.0, 1.4, 2.2, 1.6]), Uniform(1.5)]),
    "mspoe": MsPoE(1.2, 2.4, skip_layers=1),
    "mspoe-query-head": MsPoE(1.2, 2.4, skip_layers=1, gqa_policy="query_head"),
    "mspoe-static": MsPoE(1.2, 2.4, skip_layers=1, head_order=ORDER),
    "mspoe-static-query-head": MsPoE(
        1.2, 2.4, skip_layers=1, gqa_policy="query_head", head_order=QUERY_ORDER
    ),
    "mspoe+layerwise": Compose([MsPoE(1.2, 2.4, skip_layers=1), LayerWise(factors=[1.0, 1.4, 2.2, 1.6])]),
    "hidden": HiddenScale(dimension=5, factor=0.0, layers=[1, 2], last_rows=2),
}
STEPS = 3
CACHE_LENGTH = 40


def _padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 20 and 14 tokens, left-padded: per-example ranking and padding both matter."""
    ids = prompt_ids(20, batch=2, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    return ids, mask


def _greedy(model, step_call, ids, mask, cache, static: bool) -> list[torch.Tensor]:
    """Prefill with the eager model, then decode STEPS tokens with `step_call`; each step's logits."""
    batch, length = ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full_mask = torch.ones(batch, CACHE_LENGTH, dtype=mask.dtype)
    full_mask[:, :length] = mask
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, **cache_argument(cache))
        logits = [out.logits[:, -1]]
        for step in range(STEPS):
            token = logits[-1].argmax(-1, keepdim=True)
            at = length + step
            step_mask = full_mask if static else full_mask[:, : at + 1]
            out = step_call(
                token,
                attention_mask=step_mask,
                position_ids=positions[:, -1:] + step + 1,
                cache_position=torch.tensor([at]),
                **cache_argument(cache),
            )
            logits.append(out.logits[:, -1])
    return logits


@pytest.fixture
def no_recompiles():
    """Reset dynamo before and after; `strict()` turns any later recompilation into an error."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=False):
        yield lambda: torch._dynamo.config.patch(error_on_recompile=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(METHODS))
def test_decode_step_compiles_whole_and_matches_eager(name, no_recompiles):
    model = tiny_model("llama")
    rescale(model, METHODS[name])
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LENGTH)

    first_ids, first_mask = _padded_batch(seed=1)
    first = _greedy(model, compiled, first_ids, first_mask, cache, static=True)  # warm-up compiles
    with no_recompiles():  # a new prompt (and a new head ranking) reuses the compiled step
        cache.reset()
        second_ids, second_mask = _padded_batch(seed=2)
        second = _greedy(model, compiled, second_ids, second_mask, cache, static=True)
    assert counters["stats"]["unique_graphs"] == 1  # the first decode step's graph served every step

    for ids, mask, got in ((first_ids, first_mask, first), (second_ids, second_mask, second)):
        expected = _greedy(model, model, ids, mask, DynamicCache(config=model.config), static=False)
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(g.argmax(-1), e.argmax(-1)), f"token {step} differs"
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_qk_normalised_architecture_compiles_too(no_recompiles):
    model = tiny_model("qwen3")
    rescale(model, METHODS["mspoe"])
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LENGTH)
    ids, mask = _padded_batch(seed=1)
    _greedy(model, compiled, ids, mask, cache, static=True)
    with no_recompiles():
        cache.reset()
        got = _greedy(model, compiled, ids, mask, cache, static=True)
    expected = _greedy(model, model, ids, mask, DynamicCache(config=model.config), static=False)
    assert [g.argmax(-1).tolist() for g in got] == [e.argmax(-1).tolist() for e in expected]
