"""Position interpolation (PI): RoPE positions divided by one factor, in every layer or in some."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rag_mspoe.methods.method_config import MethodConfig, check_factor, number_argument
from rag_mspoe.rope.rotary_scaling import RopeScaling


@dataclass
class Uniform(RopeScaling):
    """Position interpolation: RoPE positions divided by `factor` in the chosen layers (all by default)."""

    kind: ClassVar[str] = "uniform"
    presets: ClassVar[dict[str, dict[str, Any]]] = {"pi": {"factor": 1.5}}
    argument_name: ClassVar[str] = "pi"
    factor: float = 1.5
    layers: list[int] | None = None

    def __post_init__(self) -> None:
        check_factor("factor", self.factor)
        if self.layers is not None and any(i < 0 for i in self.layers):
            raise ValueError(f"layers must be non-negative layer indices, got {self.layers}")

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        return cls(factor=number_argument(part, argument))

    def layer_factors(self, num_layers: int) -> list[float]:
        factors = [1.0] * num_layers
        for layer in self.layers if self.layers is not None else range(num_layers):
            if layer >= num_layers:
                raise ValueError(f"Uniform.layers has layer {layer}; the model has {num_layers} layers.")
            factors[layer] *= self.factor
        return factors
