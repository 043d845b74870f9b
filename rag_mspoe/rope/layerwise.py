"""Layer-specific RoPE scaling: one position-interpolation factor per layer, listed or from a Bezier curve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rag_mspoe.methods.method_config import check_factor
from rag_mspoe.rope.bezier import bezier_layer_factors
from rag_mspoe.rope.rotary_scaling import RopeScaling


@dataclass
class LayerWise(RopeScaling):
    """One position-interpolation factor per layer: a list, or Bezier control points over layer index.

    control_points are (x, y) pairs with x in [0, num_layers - 1]; the factor of layer l is the
    curve's y at x = l (the layer-specific scaling paper). With x_is_fraction, x runs over
    [0, 1] instead and is stretched to the model's depth, so one curve fits any model.
    """

    kind: ClassVar[str] = "layerwise"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # Hand-set, not calibrated: larger factors in early and middle layers, smaller in late ones,
        # the shape the layer-specific paper's searches found. Calibrate for your model instead.
        "layerwise": {
            "control_points": [(0.0, 1.0), (0.33, 1.8), (0.67, 1.6), (1.0, 1.2)],
            "x_is_fraction": True,
        }
    }
    factors: list[float] | None = None
    control_points: list[tuple[float, float]] | None = None
    x_is_fraction: bool = False

    def __post_init__(self) -> None:
        if (self.factors is None) == (self.control_points is None):
            raise ValueError("LayerWise needs exactly one of `factors` or `control_points`.")
        if self.factors is not None:
            for i, f in enumerate(self.factors):
                check_factor(f"factors[{i}]", f)
        if self.control_points is not None:
            self.control_points = [tuple(map(float, p)) for p in self.control_points]  # type: ignore[misc]
            if len(self.control_points) < 2 or any(len(p) != 2 for p in self.control_points):
                raise ValueError("control_points must be at least two (x, y) pairs.")
            for x, y in self.control_points:
                check_factor(f"control point y at x={x}", y)

    def layer_factors(self, num_layers: int) -> list[float]:
        if self.factors is not None:
            if len(self.factors) != num_layers:
                raise ValueError(
                    f"LayerWise has {len(self.factors)} factors but the model has {num_layers} layers; "
                    "give one factor per layer."
                )
            return list(self.factors)
        assert self.control_points is not None
        stretch = (num_layers - 1) if self.x_is_fraction else 1.0
        return bezier_layer_factors([(x * stretch, y) for x, y in self.control_points], num_layers)
