"""Named evaluation methods: what a sweep compares, side by side.

An evaluation method has up to three parts, composed with "+":
- a model-level rescaling config applied per call through the engine (`pi`, `mspoe`,
  `layerwise`, a saved config JSON, ...); several compose into one `Compose`;
- RoPE parameters of transformers' own RoPE types (`dynamic-ntk`, `yarn`): these need a model
  variant, a second model object that shares the weights but has its own config and rotary module;
- a prompt-level document order (`longcontextreorder`, `random`).

    resolve("layerwise+pi")           # layer-wise factors on top of uniform PI
    resolve("pi:2")                   # PI with factor 2
    resolve("mspoe:1.2-1.8")          # Ms-PoE with its ratio range
    resolve("dynamic-ntk:2+layerwise")
    resolve("hidden:17,-1")           # positional hidden-state scaling of dimension 17 by -1
    resolve("cal=runs/cal/method.json")  # a calibrated config under its own label
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from rag_mspoe import NAMED_METHODS, Compose, MethodConfig, MsPoE, Uniform, load_method, method_name
from rag_mspoe.methods import UNMODIFIED_NAMES, HiddenScale
from rag_mspoe.pipelines.packing import long_context_reorder
from rag_mspoe.rope.variants import rope_variant

T = TypeVar("T")
Order = Literal["given", "reorder", "random"]

DEFAULT_ROPE_FACTOR = 2.0
ORDER_NAMES: dict[str, Order] = {"longcontextreorder": "reorder", "reorder": "reorder", "random": "random"}
ROPE_NAMES = {"dynamic-ntk": "dynamic", "dynamic": "dynamic", "ntk": "dynamic", "yarn": "yarn"}


@dataclass(frozen=True)
class EvalMethod:
    """One column of a sweep: a rescaling config, transformers RoPE parameters, a document order."""

    name: str
    method: MethodConfig | None = None
    rope: tuple[tuple[str, Any], ...] = ()  # rope_parameters overrides, as sorted items (hashable)
    order: Order = "given"

    @property
    def needs_variant(self) -> bool:
        """True when the model itself must differ (another RoPE type), not only the per-call hooks."""
        return bool(self.rope)

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return dict(self.rope)

    def arrange(self, items: Sequence[T], seed: int) -> tuple[list[T], list[int]]:
        """The items in prompt order, and for each prompt slot the index of the item it holds.

        Items come best first (the retrieval order a sweep's gold position stands for).
        """
        indices = list(range(len(items)))
        if self.order == "reorder":
            indices = long_context_reorder(indices)
        elif self.order == "random":
            random.Random(seed).shuffle(indices)
        return [items[i] for i in indices], indices

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.method.to_dict() if self.method is not None else None,
            "rope_parameters": self.rope_parameters or None,
            "order": self.order,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalMethod:
        config = data.get("method")
        return cls(
            name=data["name"],
            method=MethodConfig.from_dict(config) if config else None,
            rope=tuple(sorted((data.get("rope_parameters") or {}).items())),
            order=data.get("order", "given"),
        )


def _number(part: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{part!r}: {text!r} is not a number; write e.g. 'pi:2' or 'yarn:1.5'.") from None


def _model_part(name: str, arg: str | None, part: str) -> MethodConfig | None:
    if name == "pi" and arg is not None:
        return Uniform(factor=_number(part, arg))
    if name == "hidden" and arg is not None:
        dimension, _, factor = arg.partition(",")
        return HiddenScale(dimension=int(_number(part, dimension)), factor=_number(part, factor or "0"))
    if name == "mspoe" and arg is not None:
        low, sep, high = arg.partition("-")
        if not sep:
            raise ValueError(f"{part!r}: give Ms-PoE's ratio range as min-max, e.g. 'mspoe:1.2-1.8'.")
        return MsPoE(min_ratio=_number(part, low), max_ratio=_number(part, high))
    if arg is not None:
        raise ValueError(f"{part!r}: {name!r} takes no ':' argument.")
    if name in NAMED_METHODS:
        return dataclasses.replace(NAMED_METHODS[name])
    return None


def _parse_part(part: str) -> tuple[str, Any]:
    """("model", config) | ("rope", params) | ("order", order) | ("none", None) for one spec part."""
    text = part.strip()
    path = Path(text).expanduser()
    if path.suffix == ".json" or path.is_dir():
        return "model", load_method(path)
    name, sep, arg = text.lower().partition(":")
    argument = arg if sep else None
    if name in UNMODIFIED_NAMES and argument is None:
        return "none", None
    if name in ORDER_NAMES and argument is None:
        return "order", ORDER_NAMES[name]
    if name in ROPE_NAMES:
        factor = DEFAULT_ROPE_FACTOR if argument is None else _number(part, argument)
        if factor < 1:
            raise ValueError(f"{part!r}: the RoPE scaling factor must be at least 1.")
        return "rope", {"rope_type": ROPE_NAMES[name], "factor": factor}
    config = _model_part(name, argument, part)
    if config is not None:
        return "model", config
    raise ValueError(
        f"Unknown method {part!r}. Use {', '.join(known_names())}, "
        "'name:arg' (pi:2, mspoe:1.2-1.8, dynamic-ntk:2, yarn:2, hidden:DIM,FACTOR), a saved config .json, "
        "or combine parts with '+' (layerwise+pi)."
    )


def known_names() -> list[str]:
    return sorted({"none", *NAMED_METHODS, *ORDER_NAMES, *ROPE_NAMES})


def resolve(spec: str | EvalMethod) -> EvalMethod:
    """An evaluation method from a spec: '[label=]part+part+...' (see the module docstring)."""
    if isinstance(spec, EvalMethod):
        return spec
    label, sep, body = spec.partition("=")
    if not sep:
        label, body = "", spec
    if not body.strip():
        raise ValueError(f"Empty method spec {spec!r}; use e.g. 'none', 'pi' or 'layerwise+pi'.")
    configs: list[MethodConfig] = []
    rope: dict[str, Any] = {}
    order: Order = "given"
    for part in body.split("+"):
        kind, value = _parse_part(part)
        if kind == "model":
            configs.extend(value.methods if isinstance(value, Compose) else [value])
        elif kind == "rope":
            if rope:
                raise ValueError(f"{spec!r} sets two RoPE types; keep one of them.")
            rope = value
        elif kind == "order":
            if order != "given":
                raise ValueError(f"{spec!r} sets two document orders; keep one of them.")
            order = value
    method: MethodConfig | None = None
    if len(configs) == 1:
        method = configs[0]
    elif configs:
        method = Compose(methods=configs)
    name = label.strip() or _display_name(body, method, rope, order)
    return EvalMethod(name=name, method=method, rope=tuple(sorted(rope.items())), order=order)


def _display_name(body: str, method: MethodConfig | None, rope: dict[str, Any], order: Order) -> str:
    if any(Path(p.strip()).suffix == ".json" for p in body.split("+")):
        parts = [method_name(method)] if method is not None else []
        if rope:
            parts.append(f"{rope['rope_type']}:{rope['factor']:g}")
        if order != "given":
            parts.append("longcontextreorder" if order == "reorder" else order)
        return "+".join(parts) or "none"
    return "+".join(p.strip().lower() for p in body.split("+"))


def require_given_order(methods: Sequence[EvalMethod], where: str) -> None:
    """Refuse document-order methods where there is no list of retrieved documents to reorder."""
    reordering = [m.name for m in methods if m.order != "given"]
    if reordering:
        raise ValueError(f"{reordering} reorder retrieved documents, which means nothing {where}; drop them.")


def resolve_all(specs: Sequence[str]) -> list[EvalMethod]:
    """Resolve several specs; names must be unique, since records are keyed by them."""
    methods = [resolve(s) for s in specs]
    names = [m.name for m in methods]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Methods {duplicates} appear twice; give each a label, e.g. 'pi2=pi:2'.")
    return methods


def stable_seed(*parts: object) -> int:
    """A seed from any values, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class EngineSet:
    """The base model, its RoPE variants and an engine over each, built on first use and kept."""

    def __init__(self, model: Any, tokenizer: Any, make_engine: Callable[[Any, Any], Any] | None = None):
        from rag_mspoe.engine import Engine

        self.model = model
        self.tokenizer = tokenizer
        # Eager decoding: on the compiled path each of a run's methods would compile, and past
        # torch's recompile limit (8 by default) decoding turns eager anyway.
        self._make = make_engine or (lambda m, t: Engine(m, t, method="none", compile=False))
        self._models: dict[tuple[tuple[str, Any], ...], Any] = {(): model}
        self._engines: dict[tuple[tuple[str, Any], ...], Any] = {}

    def model_for(self, method: EvalMethod) -> Any:
        if method.rope not in self._models:
            self._models[method.rope] = rope_variant(self.model, method.rope_parameters)
        return self._models[method.rope]

    def engine_for(self, method: EvalMethod) -> Any:
        if method.rope not in self._engines:
            self._engines[method.rope] = self._make(self.model_for(method), self.tokenizer)
        return self._engines[method.rope]
