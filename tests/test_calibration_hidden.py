"""Positional-dimension search: monotonicity, smoothness, candidates, and a small real search."""

from __future__ import annotations

import numpy as np
import pytest

from rag_mspoe import HiddenScale
from rag_mspoe.eval.settings_search.hidden_dims import (
    DimensionSearchSettings,
    candidate_dimensions,
    monotone_layer_counts,
    search_positional_dimension,
    smoothness,
    validation_loss,
)

LAYERS, LENGTH, SKIP = 8, 200, 20


def synthetic_profile() -> np.ndarray:
    """Dimension 0: a smooth ramp everywhere; 1: a noisy ramp; 2: a sine wave; 3: constant;
    4: a ramp in only 2 of 8 layers (noise elsewhere)."""
    rng = np.random.default_rng(0)
    t = np.linspace(0, 1, LENGTH)
    profile = rng.normal(size=(LAYERS, LENGTH, 5)) * 0.3
    profile[:, :, 0] = np.log1p(5 * t)
    profile[:, :, 1] = 3 * t + rng.normal(size=(LAYERS, LENGTH)) * 0.05
    profile[:, :, 2] = np.sin(6 * np.pi * t)
    profile[:, :, 3] = 1.0
    profile[:2, :, 4] = 2 * t
    return profile


def test_monotone_counts_follow_the_shapes():
    counts = monotone_layer_counts(synthetic_profile(), SKIP)
    assert counts[0] == LAYERS and counts[1] == LAYERS
    assert counts[2] == 0 and counts[3] == 0
    assert 2 <= counts[4] < LAYERS


def test_smooth_ramp_beats_noisy_ramp():
    scores = smoothness(synthetic_profile(), SKIP, [0, 1], window=21, order=3)
    assert scores[0] < scores[1]


def test_candidates_are_monotone_in_enough_layers_smoothest_first():
    settings = DimensionSearchSettings(length=LENGTH, skip=SKIP, monotone_fraction=0.25, savgol_window=21)
    found = candidate_dimensions(synthetic_profile(), settings)
    assert [c["dimension"] for c in found] == [0, 1]  # dimension 4 is monotone in only 2 of 8 layers


@pytest.mark.slow
def test_small_search_on_the_embedded_model(embedded):
    from rag_mspoe.engine import Engine

    engine = Engine(*embedded)
    validation = [
        ('Extract the value for the key "sun" from: {"moon": "4411", "sun": "7302", "star": "9020"}', "7302"),
        (
            'Extract the value for the key "star" from: {"moon": "1181", "sun": "5550", "star": "6093"}',
            "6093",
        ),
    ]
    settings = DimensionSearchSettings(
        samples=1, length=160, skip=32, top_k=2, factors=(0.0, -1.0), savgol_window=15
    )
    result = search_positional_dimension(engine, validation, settings, progress=False)
    assert result.baseline_loss == pytest.approx(validation_loss(engine, validation, "none"))
    assert 1 <= len(result.candidates) <= 2
    losses = [loss for c in result.candidates for loss in c["losses"].values()]
    assert len(losses) == 2 * len(result.candidates)
    if result.config is None:
        assert min(losses) >= result.baseline_loss
    else:
        assert isinstance(result.config, HiddenScale)
        assert min(losses) < result.baseline_loss
        assert validation_loss(engine, validation, result.config) == pytest.approx(min(losses))
