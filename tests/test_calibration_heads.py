"""Static Ms-PoE calibration: the frozen order follows the mean position-awareness scores."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt_ids, tiny_model

from rag_mspoe import MsPoE, head_ratios, rescaled
from rag_mspoe.engine import Engine
from rag_mspoe.eval.settings_search.heads import calibrate_head_order


class _IdsTokenizer:
    """Just enough tokenizer for an engine that is only given token ids."""

    pad_token_id = 0
    eos_token_id = 1


@pytest.fixture
def engine():
    model = tiny_model("llama", seed=3)
    with torch.no_grad():  # sharpen attention so heads differ in position-awareness
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.weight, std=0.3)
            torch.nn.init.normal_(layer.self_attn.k_proj.weight, std=0.3)
    return Engine(model, _IdsTokenizer(), name="tiny")


def test_frozen_order_ranks_heads_by_mean_score(engine):
    prompts = [prompt_ids(length=40, seed=s)[0].tolist() for s in range(6)]
    config, report = calibrate_head_order(
        engine, prompts, base=MsPoE(skip_layers=1, alpha=1.5), progress=False
    )
    assert config.is_static and config.skip_layers == 1 and config.alpha == 1.5
    assert report["head_order"][0] == [0, 1]  # skipped layer: identity
    assert any(max(m) > min(m) for m in report["mean_scores"].values()), "the check needs heads that differ"
    for layer, means in report["mean_scores"].items():
        assert config.head_order[layer][0] == max(range(len(means)), key=lambda h: (means[h], -h))
    # Means are the average of the per-prompt scores the engine reports.
    per_prompt = [engine.prefill(p, method=MsPoE(skip_layers=1, alpha=1.5)).head_scores[2] for p in prompts]
    torch.testing.assert_close(
        torch.stack(per_prompt).double().mean(0), torch.tensor(report["mean_scores"][2], dtype=torch.float64)
    )
    # Applied, the most position-aware head on average gets min_ratio on every prompt.
    with rescaled(engine.model, config):
        ratios = head_ratios(engine.model)
    for layer in range(1, 4):
        assert ratios[layer][0, config.head_order[layer][0]] == pytest.approx(1.2)


def test_static_base_is_refused(engine):
    with pytest.raises(ValueError, match="rank heads per prompt"):
        calibrate_head_order(engine, [[1, 2, 3]], base=MsPoE(head_order=[[0, 1]] * 4))
