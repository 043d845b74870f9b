"""Search spaces of `calibrate search`: for a model, the candidate configs of one method.

Each space is a function of the model's number of layers that returns labelled configs, a grid
small enough for a 2-core CPU (tens of candidates, trimmed by successive halving). Layer bands
split the layers into thirds or halves, because what a layer does to positions differs with
depth (the papers this package implements calibrate per layer for that reason).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from rag_mspoe.attention.attention_calibration import AttentionCalibration
from rag_mspoe.attention.invariant_reorder import BEST_PLACES, InvariantReorder
from rag_mspoe.attention.pine import Pine
from rag_mspoe.attention.reorder import CalibratedReorder
from rag_mspoe.methods.method_config import MethodConfig
from rag_mspoe.rope.layerwise import LayerWise
from rag_mspoe.rope.mspoe import MsPoE

Space = Callable[[int], dict[str, MethodConfig]]


def layer_bands(num_layers: int) -> dict[str, list[int] | None]:
    """Named sets of layers: all, the lower and upper half, and each third."""
    third, half = num_layers // 3, num_layers // 2
    return {
        "all": None,
        "low": list(range(half)),
        "high": list(range(half, num_layers)),
        "first3": list(range(third)),
        "mid3": list(range(third, num_layers - third)),
        "last3": list(range(num_layers - third, num_layers)),
    }


def attention_calibration_space(num_layers: int) -> dict[str, MethodConfig]:
    """Bias subtracted at several strengths (and the paper's softmax form at several
    temperatures), in every layer or in one band."""
    bands = layer_bands(num_layers)
    candidates: dict[str, MethodConfig] = {}
    for (band, layers), strength in itertools.product(
        [(b, bands[b]) for b in ("all", "low", "high", "mid3")], (0.5, 1.0, 2.0, 4.0)
    ):
        candidates[f"calibration-s{strength:g}-{band}"] = AttentionCalibration(
            strength=strength, layers=layers
        )
    for band, temperature in itertools.product(("all", "high"), (0.05, 0.2, 1.0)):
        candidates[f"calibration-t{temperature:g}-{band}"] = AttentionCalibration(
            temperature=temperature, layers=bands[band]
        )
    return candidates


def pine_space(num_layers: int) -> dict[str, MethodConfig]:
    """PINE as published (every layer, documents reading each other) and cheaper variants: causal
    (documents read as the model reads them, re-placed for the question), in one band of layers,
    with the most important document placed nearest the question or farthest from it."""
    bands = layer_bands(num_layers)
    candidates: dict[str, MethodConfig] = {}
    for bidirectional, band, first in itertools.product(
        (True, False), ("all", "low", "high", "last3"), (False, True)
    ):
        if bidirectional and band in ("low", "last3"):
            continue  # three times the prefill each: only the paper's and one band
        label = f"pine-{'bi' if bidirectional else 'causal'}-{band}{'-important-first' if first else ''}"
        candidates[label] = Pine(layers=bands[band], bidirectional=bidirectional, important_first=first)
    return candidates


def layerwise_space(num_layers: int) -> dict[str, MethodConfig]:
    """One interpolation factor per third of the layers, below and above 1."""
    third = num_layers // 3
    sizes = (third, num_layers - 2 * third, third)
    candidates: dict[str, MethodConfig] = {}
    for factors in itertools.product((0.7, 1.0, 1.3), repeat=3):
        if factors == (1.0, 1.0, 1.0):
            continue
        per_layer = [f for f, size in zip(factors, sizes, strict=True) for _ in range(size)]
        candidates["layerwise-" + "-".join(f"{f:g}" for f in factors)] = LayerWise(factors=per_layer)
    return candidates


def mspoe_space(num_layers: int) -> dict[str, MethodConfig]:
    """Ms-PoE's ratio range, narrower and wider than the paper's 1.2-1.8, from the third layer on
    (the paper's) or in the upper half only."""
    candidates: dict[str, MethodConfig] = {}
    for (low, high), skip in itertools.product(
        ((1.0, 1.2), (1.0, 1.5), (1.2, 1.8), (1.5, 2.5)), (2, num_layers // 2)
    ):
        candidates[f"mspoe-{low:g}-{high:g}-from{skip}"] = MsPoE(
            min_ratio=low, max_ratio=high, skip_layers=skip
        )
    return candidates


def calibrated_reorder_space(num_layers: int) -> dict[str, MethodConfig]:
    """The layers whose calibrated attention ranks the documents, the bias strength, and where the
    top-ranked document goes."""
    # CalibratedReorder's layers=None is the upper half, so "all" names every layer itself.
    bands = {**layer_bands(num_layers), "all": list(range(num_layers))}
    candidates: dict[str, MethodConfig] = {}
    for band, strength in itertools.product(("high", "last3", "mid3", "all"), (0.5, 1.0, 2.0)):
        label = f"reorder-{band}-s{strength:g}"
        candidates[label] = CalibratedReorder(layers=bands[band], strength=strength)
    for place in ("sorted", "last"):
        candidates[f"reorder-high-s1-{place}"] = CalibratedReorder(layers=bands["high"], place=place)
    return candidates


def invariant_reorder_space(num_layers: int) -> dict[str, MethodConfig]:
    """What scores each document read alone (the question's likelihood, or the attention of a band
    of layers, among them the third quarter), where the top-ranked document goes, and how many of
    the best-ranked documents the model reads, and whether the first document given keeps its place
    unless another is ranked above it."""
    bands = {**layer_bands(num_layers), "all": list(range(num_layers))}
    bands["q3"] = InvariantReorder(score="attention").ranking_layers(num_layers)  # its default band
    candidates: dict[str, MethodConfig] = {
        f"invariant-question-best-{best}": InvariantReorder(best=best) for best in BEST_PLACES
    }
    for keep in (1, 2, 3, 5):
        candidates[f"invariant-question-keep-{keep}"] = InvariantReorder(keep=keep)
    # For a model that reads its first document best: the retriever's first stays unless outranked.
    for score in ("question", "question+judge"):
        candidates[f"invariant-{score.replace('+', '-')}-keep-first"] = InvariantReorder(
            score=score, first_margin=0.0
        )
    for (band, layers), best in itertools.product(bands.items(), BEST_PLACES):
        candidates[f"invariant-attention-{band}-best-{best}"] = InvariantReorder(
            score="attention", layers=layers, best=best
        )
    return candidates


SPACES: dict[str, Space] = {
    "attention-calibration": attention_calibration_space,
    "calibrated-reorder": calibrated_reorder_space,
    "invariant-reorder": invariant_reorder_space,
    "pine": pine_space,
    "layerwise": layerwise_space,
    "mspoe": mspoe_space,
}


def space_candidates(name: str, num_layers: int) -> dict[str, MethodConfig]:
    """The labelled candidates of the space `name` for a model with `num_layers` layers."""
    if name not in SPACES:
        raise ValueError(f"Unknown search space {name!r}; choose from {', '.join(SPACES)}.")
    return SPACES[name](num_layers)
