"""Bezier curves over layer index, the parameterisation of the layer-specific scaling paper."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

import numpy as np


def bezier_points(control_points: Sequence[tuple[float, float]], samples: int = 2001) -> np.ndarray:
    """Points (x, y) along the Bezier curve with the given control points, `samples` of them."""
    cps = np.asarray(control_points, dtype=np.float64)
    degree = len(cps) - 1
    t = np.linspace(0.0, 1.0, samples)[:, None]
    weights = [comb(degree, i) * t**i * (1 - t) ** (degree - i) for i in range(degree + 1)]
    return sum(w * cp for w, cp in zip(weights, cps, strict=True))  # type: ignore[return-value]


def bezier_layer_factors(control_points: Sequence[tuple[float, float]], num_layers: int) -> list[float]:
    """One factor per layer: the curve's y where its x is nearest each layer index.

    The curve is parameterised by t, not x, so we sample it densely and read y at the
    sample whose x is closest to each integer layer index (x runs over [0, num_layers - 1]).
    """
    pts = bezier_points(control_points)
    factors = []
    for layer in range(num_layers):
        nearest = int(np.argmin(np.abs(pts[:, 0] - layer)))
        factors.append(float(pts[nearest, 1]))
    return factors
