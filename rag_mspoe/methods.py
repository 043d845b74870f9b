"""Method configs: small validated dataclasses that save to and load from JSON next to a model.

A config only describes a method; `rag_mspoe.rope.rescaling.rescale` applies it to a model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rag_mspoe.files import atomic_write
from rag_mspoe.rope.bezier import bezier_layer_factors

logger = logging.getLogger(__name__)

METHOD_FILE = "rag_mspoe_method.json"
GqaPolicy = Literal["kv_group", "query_head"]


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rag-mspoe")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class MethodConfig:
    """Base of every method config: JSON round trip and a registry keyed by `kind`."""

    kind: ClassVar[str] = ""
    registry: ClassVar[dict[str, type[MethodConfig]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            MethodConfig.registry[cls.kind] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.kind, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodConfig:
        data = dict(data)
        kind = data.pop("method", None)
        if kind not in MethodConfig.registry:
            raise ValueError(
                f"Unknown method {kind!r} in config; known methods: {sorted(MethodConfig.registry)}."
            )
        target = MethodConfig.registry[kind]
        names = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(set(data) - names - {"rag_mspoe_version", "base_model"})
        if unknown:
            logger.warning(
                "Ignoring unknown keys %s in the %s config (saved by another version?)", unknown, kind
            )
        return target._from_fields({k: v for k, v in data.items() if k in names})

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> MethodConfig:
        return cls(**fields)

    def save(self, path: str | os.PathLike[str], base_model: str | None = None) -> Path:
        """Write the config as JSON: to `path` if it ends in .json, else to `path/rag_mspoe_method.json`."""
        target = Path(path)
        if target.suffix != ".json":
            target = target / METHOD_FILE
        payload = {**self.to_dict(), "rag_mspoe_version": _package_version(), "base_model": base_model}
        atomic_write(target, (json.dumps(payload, indent=2) + "\n").encode())
        return target


def load_method(path: str | os.PathLike[str]) -> MethodConfig:
    """Read a config saved by `MethodConfig.save` (a .json file or the folder holding one)."""
    target = Path(path)
    if target.is_dir():
        target = target / METHOD_FILE
    if not target.is_file():
        raise FileNotFoundError(f"No method config at {target}; save one with config.save(folder).")
    try:
        data = json.loads(target.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{target} is not valid JSON ({exc}); re-save the method config.") from exc
    try:
        return MethodConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{target}: {exc}; fix the value or re-save the method config.") from exc


def _check_factor(name: str, value: float) -> None:
    _check_finite(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_finite(name: str, value: float) -> None:
    # JSON reads 1e309 as inf: a factor like that rescales every position to nothing.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass
class Uniform(MethodConfig):
    """Position interpolation: RoPE positions divided by `factor` in the chosen layers (all by default)."""

    kind: ClassVar[str] = "uniform"
    factor: float = 1.5
    layers: list[int] | None = None

    def __post_init__(self) -> None:
        _check_factor("factor", self.factor)
        if self.layers is not None and any(i < 0 for i in self.layers):
            raise ValueError(f"layers must be non-negative layer indices, got {self.layers}")


@dataclass
class MsPoE(MethodConfig):
    """Ms-PoE: per-head position ratios from `min_ratio` to `max_ratio` (Eq. 2 of the paper).

    Heads are ranked by the position-awareness score (Eq. 1, threshold `alpha` x the row mean)
    of the last prompt token, computed per prompt and per batch element; the most
    position-aware head gets `min_ratio`. Give `head_order` (per layer, head indices from most
    to least position-aware) to freeze the ranking instead (static Ms-PoE).

    gqa_policy, for models with grouped KV heads:
      "kv_group"   one ratio per KV head, shared by its query heads; heads are ranked by the
                   mean score of the group. The KV cache is unchanged.
      "query_head" one ratio per query head, as in the paper; keys and values are expanded to
                   one head per query head, so the KV cache grows by the group size.
    """

    kind: ClassVar[str] = "mspoe"
    min_ratio: float = 1.2
    max_ratio: float = 1.8
    skip_layers: int = 2
    alpha: float = 3.0
    gqa_policy: GqaPolicy = "kv_group"
    head_order: list[list[int]] | None = None

    def __post_init__(self) -> None:
        _check_factor("min_ratio", self.min_ratio)
        _check_factor("max_ratio", self.max_ratio)
        if self.max_ratio < self.min_ratio:
            raise ValueError(f"max_ratio ({self.max_ratio}) must be at least min_ratio ({self.min_ratio})")
        if self.skip_layers < 0:
            raise ValueError(f"skip_layers must be >= 0, got {self.skip_layers}")
        _check_factor("alpha", self.alpha)
        if self.gqa_policy not in ("kv_group", "query_head"):
            raise ValueError(f"gqa_policy must be 'kv_group' or 'query_head', got {self.gqa_policy!r}")
        if self.head_order is not None:
            for layer, order in enumerate(self.head_order):
                if sorted(order) != list(range(len(order))):
                    raise ValueError(
                        f"head_order[{layer}] = {order} is not a permutation of 0..{len(order) - 1}"
                    )

    @property
    def is_static(self) -> bool:
        return self.head_order is not None

    def ratios(self, num_heads: int) -> list[float]:
        """Eq. 2: the ratios by rank, nearest 1 first (a single head gets the midpoint)."""
        if num_heads == 1:
            return [(self.min_ratio + self.max_ratio) / 2]
        step = (self.max_ratio - self.min_ratio) / (num_heads - 1)
        return [self.min_ratio + i * step for i in range(num_heads)]


@dataclass
class LayerWise(MethodConfig):
    """One position-interpolation factor per layer: a list, or Bezier control points over layer index.

    control_points are (x, y) pairs with x in [0, num_layers - 1]; the factor of layer l is the
    curve's y at x = l (the layer-specific scaling paper). With x_is_fraction, x runs over
    [0, 1] instead and is stretched to the model's depth, so one curve fits any model.
    """

    kind: ClassVar[str] = "layerwise"
    factors: list[float] | None = None
    control_points: list[tuple[float, float]] | None = None
    x_is_fraction: bool = False

    def __post_init__(self) -> None:
        if (self.factors is None) == (self.control_points is None):
            raise ValueError("LayerWise needs exactly one of `factors` or `control_points`.")
        if self.factors is not None:
            for i, f in enumerate(self.factors):
                _check_factor(f"factors[{i}]", f)
        if self.control_points is not None:
            self.control_points = [tuple(map(float, p)) for p in self.control_points]  # type: ignore[misc]
            if len(self.control_points) < 2 or any(len(p) != 2 for p in self.control_points):
                raise ValueError("control_points must be at least two (x, y) pairs.")
            for x, y in self.control_points:
                _check_factor(f"control point y at x={x}", y)

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


@dataclass
class HiddenScale(MethodConfig):
    """Positional hidden-state scaling: one dimension of the attention input scaled by `factor`.

    In `layers` (default: the middle of the model, layers 10-25 of 32 as in the paper, scaled to
    the model's depth), the query of the last prompt token and the keys it reads are computed
    from the input with `dimension` multiplied by `factor`; every other row of attention stays
    as it was. Those scaled keys go to the KV cache and generated tokens use the scaled query
    and keys too. Values are never scaled. `last_rows` > 1 gives the scaled path to more of the
    final prompt rows (with the causal mask aligned bottom-right). Find `dimension` with the
    calibration search; factors the paper used: 0, -1, 0.2.
    """

    kind: ClassVar[str] = "hidden"
    dimension: int = -1
    factor: float = 0.0
    layers: list[int] | None = None
    last_rows: int = 1

    def __post_init__(self) -> None:
        _check_finite("factor", self.factor)
        if self.dimension < 0:
            raise ValueError(
                "HiddenScale needs the hidden `dimension` to scale; find it with the calibration search."
            )
        if self.last_rows < 1:
            raise ValueError(f"last_rows must be at least 1, got {self.last_rows}")
        if self.layers is not None and any(i < 0 for i in self.layers):
            raise ValueError(f"layers must be non-negative layer indices, got {self.layers}")

    def layer_indices(self, num_layers: int, hidden_size: int) -> list[int]:
        if self.dimension >= hidden_size:
            raise ValueError(f"dimension {self.dimension} is outside the model's hidden size {hidden_size}.")
        if self.layers is None:
            return list(range(round(num_layers * 10 / 32), round(num_layers * 25 / 32) + 1))
        bad = [i for i in self.layers if i >= num_layers]
        if bad:
            raise ValueError(f"HiddenScale.layers has {bad}; the model has {num_layers} layers.")
        return sorted(set(self.layers))


@dataclass
class Compose(MethodConfig):
    """Several methods at once: per-layer factors multiply (e.g. layer-wise on top of PI).

    At most one Ms-PoE may take part; its per-head ratios are multiplied by the layer factors.
    """

    kind: ClassVar[str] = "compose"
    methods: list[MethodConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("Compose needs at least one method.")
        if sum(isinstance(m, MsPoE) for m in self.methods) > 1:
            raise ValueError("Compose accepts at most one Ms-PoE method.")
        if any(isinstance(m, HiddenScale) for m in self.methods):
            raise ValueError("HiddenScale does not compose with RoPE methods; apply it on its own.")
        attention = [m.kind for m in self.methods if m.kind in ATTENTION_KINDS]
        if attention:
            raise ValueError(
                f"{attention[0]} changes attention, not RoPE, and does not compose with other methods; "
                "apply it on its own."
            )
        if any(isinstance(m, Compose) for m in self.methods):
            raise ValueError("Nest methods flat: Compose(methods=[a, b, c]), not Compose inside Compose.")

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.kind, "methods": [m.to_dict() for m in self.methods]}

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> MethodConfig:
        return cls(methods=[MethodConfig.from_dict(m) for m in fields.get("methods", [])])


# Names a user can type (CLI, connectors, server model names) for the methods with defaults.
NAMED_METHODS: dict[str, MethodConfig] = {
    "pi": Uniform(factor=1.5),
    "mspoe": MsPoE(),
    "mspoe-query-head": MsPoE(gqa_policy="query_head"),
    # Hand-set, not calibrated: larger factors in early and middle layers, smaller in late ones,
    # the shape the layer-specific paper's searches found. Calibrate for your model instead.
    "layerwise": LayerWise(
        control_points=[(0.0, 1.0), (0.33, 1.8), (0.67, 1.6), (1.0, 1.2)], x_is_fraction=True
    ),
}
# The attention-level methods (rag_mspoe.attention) subclass MethodConfig and add their names to
# NAMED_METHODS when their modules load, which must follow both; they change attention, not RoPE.
ATTENTION_KINDS = {"attention-calibration", "pine"}
import rag_mspoe.attention.calibration  # noqa: E402
import rag_mspoe.attention.pine  # noqa: E402, F401

UNMODIFIED_NAMES = {"none", "unmodified", "original", "baseline"}
# Resolves per model, to the config shipped for it (rag_mspoe.calibrated).
CALIBRATED = "calibrated"


# What every `method=` argument takes: a config, a spec string (rag_mspoe.method_spec), a saved
# config's path, or None (the unmodified model).
MethodSpec = MethodConfig | str | os.PathLike[str] | None


def parse_method(spec: MethodSpec, model_name: str | None = None) -> MethodConfig | None:
    """The rescaling config a method spec means; None (like "none") is the unmodified model.

    `spec` is a config, a saved config's path, or a spec string in the grammar of
    `rag_mspoe.method_spec` ("mspoe", "pi:2", "layerwise+pi", "cal=runs/cal.json", ...).
    "calibrated" is the config calibrated for the model `model_name` (the name `load_model`
    gives it, see `model_display_name`); it needs that name. RoPE types and document orders
    are refused: only the evaluation commands can apply them.
    """
    if spec is None or isinstance(spec, MethodConfig):
        return spec
    # Imported here: the spec parser is built on this module's configs.
    from rag_mspoe.method_spec import rescaling_config

    return rescaling_config(spec, model_name)


def method_name(method: MethodConfig | None) -> str:
    """A short display name: the registered name when the config equals one, else its kind."""
    if method is None:
        return "none"
    for name, named in NAMED_METHODS.items():
        if named == method:
            return name
    if isinstance(method, Compose):
        return "+".join(method_name(m) for m in method.methods)
    return method.kind
