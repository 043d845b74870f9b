"""Method specs: the one language every `method=` argument, `--method` and `--methods` option speaks.

A spec is '[label=]part+part+...'. Each part is one of:
- a rescaling config applied per call through hooks: a name (`pi`, `mspoe`, `layerwise`, ...),
  a name with arguments (`pi:2`, `mspoe:1.2-1.8`, `hidden:DIM,FACTOR`), `calibrated` (the config
  shipped for the model, so it needs the model's name), `auto` (that config on the prompts of the
  document counts it was validated at, the unmodified model elsewhere and where none ships) or a
  saved config (.json file or its folder); several compose into one `Compose`;
- RoPE parameters of transformers' own RoPE types (`dynamic-ntk`, `yarn`, with `:factor`): these
  need a model variant, a second model object with its own config and rotary module;
- a prompt-level document order (`longcontextreorder`, `random`);
- an unmodified name (`none`, `baseline`, ...), which adds nothing.

    resolve("layerwise+pi")              # layer-wise factors on top of uniform PI
    resolve("pi:2")                      # PI with factor 2
    resolve("mspoe:1.2-1.8")             # Ms-PoE with its ratio range
    resolve("dynamic-ntk:2+layerwise")   # evaluation only: a model variant plus per-call hooks
    resolve("hidden:17,-1")              # positional hidden-state scaling of dimension 17 by -1
    resolve("cal=runs/cal/method.json")  # a saved config under its own label

`resolve` gives a `ResolvedMethod` (all three parts); `parse_method` gives only the rescaling
config and refuses the parts a per-call rescaling cannot apply. None and every unmodified name
mean the unmodified model. Method names and their ':ARG' forms come from the registered methods
(`rag_mspoe.methods.method_config`).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from rag_mspoe.methods.method_config import (
    NAMED_METHODS,
    Compose,
    MethodConfig,
    argument_methods,
    load_method,
    method_name,
    number_argument,
)
from rag_mspoe.methods.registry import registered_methods
from rag_mspoe.prompts.document_order import long_context_reorder

T = TypeVar("T")
Order = Literal["given", "reorder", "random"]
PartKind = Literal["rescaling", "rope", "order", "none"]

UNMODIFIED_NAMES = {"none", "unmodified", "original", "baseline"}
# Resolves per model, to the config shipped for it (rag_mspoe.calibrated).
CALIBRATED = "calibrated"
# Resolves per model too: the shipped config on the prompts of the document counts it was
# validated at, the unmodified model elsewhere (rag_mspoe.methods.where_validated); "none" where
# no config ships.
AUTO = "auto"
DEFAULT_ROPE_FACTOR = 2.0
# Characters of the spec grammar (arguments, parts, paths): a label holding one reads as a spec.
SPEC_SYNTAX = (":", "+", "/", "\\")
ORDER_NAMES: dict[str, Order] = {"longcontextreorder": "reorder", "reorder": "reorder", "random": "random"}
ROPE_NAMES = {"dynamic-ntk": "dynamic", "dynamic": "dynamic", "ntk": "dynamic", "yarn": "yarn"}
# Where the parts a per-call rescaling cannot apply (model variants, document orders) work.
EVALUATION_COMMANDS = "the evaluation commands' --methods (rag-mspoe sweep, e2e; perplexity for RoPE types)"


# What every `method=` argument takes: a config, a spec string, a saved config's path, or None
# (the unmodified model).
MethodSpec = MethodConfig | str | os.PathLike[str] | None


def parse_method(spec: MethodSpec, model_name: str | None = None) -> MethodConfig | None:
    """The rescaling config a method spec means; None (like "none") is the unmodified model.

    `spec` is a config (returned as it is), a saved config's path, or a spec string in this
    module's grammar ("mspoe", "pi:2", "layerwise+pi", "cal=runs/cal.json", ...).
    "calibrated" is the config calibrated for the model `model_name` (the name `load_model`
    gives it, see `model_display_name`); it needs that name. RoPE types and document orders
    are refused: only the evaluation commands can apply them.
    """
    if spec is None or isinstance(spec, MethodConfig):
        return spec
    return rescaling_config(spec, model_name)


@dataclass(frozen=True)
class ResolvedMethod:
    """A spec resolved once: its label, rescaling config, transformers RoPE parameters, document order.

    Plain data, so it pickles to worker processes as it is.
    """

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
    def from_dict(cls, data: dict[str, Any]) -> ResolvedMethod:
        config = data.get("method")
        return cls(
            name=data["name"],
            method=MethodConfig.from_dict(config) if config else None,
            rope=tuple(sorted((data.get("rope_parameters") or {}).items())),
            order=data.get("order", "given"),
        )


@dataclass(frozen=True)
class SpecPart:
    """One '+'-separated part of a spec, as written and as parsed."""

    text: str
    kind: PartKind
    value: Any = None  # a MethodConfig, a rope_parameters dict or an Order


def known_names() -> list[str]:
    """Every name a spec part may be (the error messages of both entry points list these)."""
    return sorted({*UNMODIFIED_NAMES, CALIBRATED, AUTO, *NAMED_METHODS, *ORDER_NAMES, *ROPE_NAMES})


def resolve(spec: str | os.PathLike[str] | ResolvedMethod, model_name: str | None = None) -> ResolvedMethod:
    """A method from a spec (see the module docstring); `model_name` is needed only by 'calibrated'."""
    if isinstance(spec, ResolvedMethod):
        return spec
    label, parts = split_spec(spec, model_name)
    configs: list[MethodConfig] = []
    rope: dict[str, Any] = {}
    order: Order = "given"
    for part in parts:
        if part.kind == "rescaling":
            configs.append(part.value)
        elif part.kind == "rope":
            if rope:
                raise ValueError(f"{str(spec)!r} sets two RoPE types; keep one of them.")
            rope = part.value
        elif part.kind == "order":
            if order != "given":
                raise ValueError(f"{str(spec)!r} sets two document orders; keep one of them.")
            order = part.value
    method = combine(configs)
    name = label or _display_name(parts, method, rope, order)
    return ResolvedMethod(name=name, method=method, rope=tuple(sorted(rope.items())), order=order)


def resolve_all(specs: Sequence[str], model_name: str | None = None) -> list[ResolvedMethod]:
    """Resolve several specs; names must be unique, since records are keyed by them."""
    methods = [resolve(s, model_name) for s in specs]
    names = [m.name for m in methods]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Methods {duplicates} appear twice; give each a label, e.g. 'pi2=pi:2'.")
    return methods


def split_spec(spec: str | os.PathLike[str], model_name: str | None = None) -> tuple[str, list[SpecPart]]:
    """The label ('' when none) and the parsed parts of a spec."""
    text = os.fspath(spec).strip()
    if not isinstance(spec, str) or (_may_split(text) and _is_path(text)):
        # A path object, or an existing path whose name holds '+' or '=': one saved config.
        return "", [SpecPart(text, "rescaling", load_method(_expanded(text)))]
    label, sep, body = text.partition("=")
    if not sep:
        label, body = "", text
    if not body.strip():
        raise ValueError(f"Empty method spec {text!r}; use e.g. 'none', 'pi' or 'layerwise+pi'.")
    pieces = [part.strip() for part in _JOIN.split(body)]
    if not all(pieces):
        # An empty part would otherwise be read as the path '', the current folder's saved config.
        raise ValueError(
            f"Method spec {text!r} has an empty part (a '+' with nothing on one side); "
            "remove the stray '+' or name a method there, e.g. 'mspoe+pi'."
        )
    parts = [_parse_part(piece, model_name) for piece in pieces]
    label = label.strip()
    _check_reserved_label(text, label, parts, model_name)
    return label, parts


def _check_reserved_label(text: str, label: str, parts: list[SpecPart], model_name: str | None) -> None:
    """Refuse a label that reads as a method spec but binds another method ('none=pi',
    'pi:2=none', 'mspoe+pi=none'): results and reports keyed by the label would show another
    method's numbers under a name that says which method they are. A label that spells its own
    method ('pi=pi:1.5') is kept."""
    syntax = [repr(mark) for mark in SPEC_SYNTAX if mark in label]
    if label.endswith(".json"):
        syntax.append("'.json'")
    if label.lower() not in known_names() and not syntax:
        return
    if _spells(label, parts, model_name):
        return
    body = text.partition("=")[2].strip()
    plain = re.sub(r"[:+/\\]+", "-", label.lower()).removesuffix(".json")
    example = f"'my-{plain}={body}'"
    if not syntax:
        raise ValueError(
            f"{text!r} binds the method name {label!r} to another method; labels that are method "
            f"names ({', '.join(known_names())}) may only name that method. Pick another label, "
            f"e.g. {example}."
        )
    raise ValueError(
        f"{text!r} binds the label {label!r}, written like a method spec (it holds {', '.join(syntax)}), "
        f"to another method: a report row {label!r} would show that method's scores. Pick a label "
        f"without ':', '+', '/' or '.json', e.g. {example}."
    )


def _spells(label: str, parts: list[SpecPart], model_name: str | None) -> bool:
    """Whether `label`, read as a spec, means what `parts` mean."""
    pieces = [piece.strip() for piece in _JOIN.split(label)]
    try:
        named = [_parse_part(piece, model_name) for piece in pieces if piece]
    except (ValueError, OSError):  # 'calibrated' without a model, a path to nothing: cannot agree
        return False
    return len(named) == len(pieces) and _meaning(named) == _meaning(parts)


def _meaning(parts: Sequence[SpecPart]) -> tuple[Any, ...]:
    """What parts do, independent of how they are written ('none' and 'baseline' are alike)."""
    rescaling = combine([p.value for p in parts if p.kind == "rescaling"])
    others = sorted((p.kind, repr(p.value)) for p in parts if p.kind in ("rope", "order"))
    return rescaling, tuple(others)


def combine(configs: Sequence[MethodConfig]) -> MethodConfig | None:
    """One config for several rescaling parts: None for none, the config itself for one, else one
    flat Compose (a saved Compose among the parts contributes its methods)."""
    if len(configs) < 2:
        return configs[0] if configs else None
    flat = [m for config in configs for m in (config.methods if isinstance(config, Compose) else [config])]
    return Compose(methods=flat)


# A '+' joins parts, except in a number: an exponent's sign ('pi:1e+16', as Python writes large
# floats) or a sign after ':' or ','.
_JOIN = re.compile(r"(?<![0-9.][eE])(?<![:,])\+")


def _may_split(text: str) -> bool:
    return "+" in text or "=" in text


def _is_path(text: str, folder: bool = False) -> bool:
    """Whether `text` names an existing path (a folder, with `folder`). A name the system cannot
    look up (too long, a NUL byte, '~nobody') names none, so the spec reads as names instead."""
    try:
        path = _expanded(text)
        return path.is_dir() if folder else path.exists()
    except (OSError, ValueError):
        return False


def _expanded(text: str) -> Path:
    """`text` as a path, '~' expanded where a home folder is known ('~nobody' stays as written)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        return Path(text)


def _parse_part(part: str, model_name: str | None) -> SpecPart:
    name, sep, arg = part.lower().partition(":")
    argument = arg if sep else None
    if argument is None:
        # Names before paths: a folder called "pi" in the working directory does not shadow PI.
        if name in UNMODIFIED_NAMES:
            return SpecPart(part, "none")
        if name in ORDER_NAMES:
            return SpecPart(part, "order", ORDER_NAMES[name])
        if name == CALIBRATED:
            return SpecPart(part, "rescaling", _calibrated(model_name))
        if name == AUTO:
            return _auto(part, model_name)
        if name in NAMED_METHODS:
            return SpecPart(part, "rescaling", NAMED_METHODS[name])
    if name in ROPE_NAMES:
        factor = DEFAULT_ROPE_FACTOR if argument is None else number_argument(part, argument)
        if factor < 1:  # number_argument refused NaN and infinities
            raise ValueError(f"{part!r}: the RoPE scaling factor must be at least 1.")
        return SpecPart(part, "rope", {"rope_type": ROPE_NAMES[name], "factor": factor})
    takes_argument = argument_methods()
    if argument is not None and name in takes_argument:
        try:
            return SpecPart(part, "rescaling", takes_argument[name].from_argument(part, argument))
        except ValueError as exc:  # a config's own check ('factor must be ...') names no part
            raise ValueError(str(exc) if part in str(exc) else f"{part!r}: {exc}") from None
    if Path(part).suffix == ".json" or _is_path(part, folder=True):
        return SpecPart(part, "rescaling", load_method(_expanded(part)))
    if argument is not None and name in known_names():
        raise ValueError(f"{part!r}: {name!r} takes no ':' argument.")
    shown = repr(part) if len(part) <= 80 else f"{part[:60]!r}... ({len(part)} characters)"
    raise ValueError(
        f"Unknown method {shown}. Use {', '.join(known_names())}, "
        "'name:arg' (pi:2, mspoe:1.2-1.8, dynamic-ntk:2, yarn:2, hidden:DIM,FACTOR), "
        "the path of a saved method config (.json or its folder), "
        "or combine parts with '+' (layerwise+pi)."
    )


def _calibrated(model_name: str | None, name: str = CALIBRATED) -> MethodConfig:
    if model_name is None:
        raise ValueError(
            f"'{name}' is the config calibrated for one model, so it needs the model: use it "
            f"where a model is at hand (Engine.load(model, method='{name}'), --method {name}), "
            "or pass model_name."
        )
    from rag_mspoe.calibrated import calibrated_method

    return calibrated_method(model_name)


def _auto(part: str, model_name: str | None) -> SpecPart:
    """'auto': the shipped config where it was validated (`WhereValidated`), none where none ships."""
    from rag_mspoe.calibrated import calibrated_config_path

    if model_name is not None and calibrated_config_path(model_name) is None:
        return SpecPart(part, "none")
    shipped = _calibrated(model_name, AUTO)
    if not shipped.rewrites_prompt() or shipped.validated_documents is None:
        return SpecPart(part, "rescaling", shipped)  # a batch's one method: see where_validated
    # Through the registry: the wrapper's module imports the methods it wraps, which import this one.
    return SpecPart(part, "rescaling", registered_methods()["where-validated"](shipped=shipped))


def _display_name(
    parts: Sequence[SpecPart], method: MethodConfig | None, rope: dict[str, Any], order: Order
) -> str:
    """The parts as written, lower-cased; with a saved config among them, names built from the values."""
    if not any(Path(p.text).suffix == ".json" for p in parts):
        return "+".join(p.text.lower() for p in parts)
    names = [method_name(method)] if method is not None else []
    if rope:
        names.append(f"{rope['rope_type']}:{rope['factor']:g}")
    if order != "given":
        names.append("longcontextreorder" if order == "reorder" else order)
    return "+".join(names) or "none"


# What a per-call rescaling cannot do with the other kinds of part.
_NOT_PER_CALL = {
    "rope": "is a RoPE type: it needs a second model built with another config",
    "order": "is a document order: it reorders retrieved documents",
}


def rescaling_config(spec: str | os.PathLike[str], model_name: str | None = None) -> MethodConfig | None:
    """The rescaling config of a spec, for the places that apply one per call (see `parse_method`).

    RoPE types and document orders are refused, naming the part: a per-call rescaling can
    neither build another model nor reorder documents.
    """
    _, parts = split_spec(spec, model_name)
    for part in parts:
        if part.kind in _NOT_PER_CALL:
            raise ValueError(
                f"{part.text!r} (in {str(spec)!r}) {_NOT_PER_CALL[part.kind]}, which a per-call rescaling "
                f"(Engine, rescale(), the server, ask --method) cannot do. Use it in {EVALUATION_COMMANDS}, "
                "or drop it."
            )
    return combine([p.value for p in parts if p.kind == "rescaling"])
