"""Static Ms-PoE: average the position-awareness scores over a calibration set and freeze the head order.

Per-prompt Ms-PoE ranks the heads on every prompt (one `[heads, T]` product per layer); a
frozen order skips that work and gives every prompt the same ranking. The scores are taken
while per-prompt Ms-PoE runs, so each layer sees the inputs it will see when the order is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from rag_mspoe.methods import MsPoE

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike


def calibrate_head_order(
    engine: EngineLike, prompts: Sequence[Any], *, base: MsPoE | None = None, progress: bool = True
) -> tuple[MsPoE, dict[str, Any]]:
    """A static `MsPoE` (base's settings, head_order frozen) and a report of the mean scores.

    prompts: texts or message lists, rendered with the engine's chat template; token-id lists too.
    """
    base = base or MsPoE()
    if base.is_static:
        raise ValueError("base must rank heads per prompt (head_order=None); it is the method being frozen.")
    if not prompts:
        raise ValueError("Give at least one calibration prompt.")
    totals: dict[int, torch.Tensor] = {}
    for prompt in tqdm(prompts, desc="head scores", disable=not progress):
        scores = engine.prefill(prompt, method=base).head_scores
        for layer, layer_scores in scores.items():
            totals[layer] = totals.get(layer, 0) + layer_scores.double()  # type: ignore[assignment]
    num_layers = engine.model.config.num_hidden_layers
    num_heads = len(next(iter(totals.values())))
    means = {layer: total / len(prompts) for layer, total in totals.items()}
    order = [
        torch.argsort(-means[layer], stable=True).tolist() if layer in means else list(range(num_heads))
        for layer in range(num_layers)
    ]
    report = {
        "prompts": len(prompts),
        "gqa_policy": base.gqa_policy,
        "mean_scores": {layer: means[layer].tolist() for layer in sorted(means)},
        "head_order": order,
    }
    return dataclasses.replace(base, head_order=order), report
