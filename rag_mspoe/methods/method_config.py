"""What a method is: a small validated config that saves to JSON and declares, on its class, all
the rest of the package needs to know about it.

A method is one module: its config (a `MethodConfig` subclass) and the hooks that apply it.
Defining the subclass registers it (`rag_mspoe.methods.registry`), as a PEFT type is registered:

    @dataclass
    class Toy(MethodConfig):
        kind = "toy"                       # its name in saved JSON
        hooks = ToyHooks                   # a ModelHooks subclass (rag_mspoe.rope.hooks)
        presets = {"toy": {}}              # names users can type for ready configs
        argument_name = "toy"              # optional, with from_argument: the spec 'toy:2'
        strength: float = 1.0

        @classmethod
        def from_argument(cls, part, argument):
            return cls(strength=number_argument(part, argument))

Everything that reads these declarations (`rescale`, `Compose`, the spec language, the
evaluation's batching and scoring, the remote engine, the server's model list) asks the config,
never a table of its own or the config's class (docs/writing-a-method.md lists what it asks).

A method in another package registers through the entry-point group `rag_mspoe.methods`
(in that package's pyproject.toml: `[project.entry-points."rag_mspoe.methods"] toy = "toy_pkg:Toy"`);
the first lookup of a method name imports it, and then every command and the server know it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from rag_mspoe.files import atomic_write
from rag_mspoe.methods.registry import register, registered_methods

if TYPE_CHECKING:
    from rag_mspoe.methods.document_orders import QuestionLikelihoodOrder, RecordedRanking

logger = logging.getLogger(__name__)

METHOD_FILE = "rag_mspoe_method.json"
VALIDATED_DOCUMENTS = "validated_documents"  # the saved key of MethodConfig.validated_documents


class AppliedHooks(Protocol):
    """What `rescale` needs from the hooks that apply a method (`rag_mspoe.rope.hooks.ModelHooks`)."""

    @property
    def method(self) -> MethodConfig: ...

    def install(self) -> None: ...

    def uninstall(self) -> None: ...


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rag-mspoe")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class MethodConfig:
    """Base of every method config: JSON round trip, and the declarations every method makes once.

    Class attributes a method sets:
      kind          the name saved in JSON ("method"); a class with a kind is registered when defined
      hooks         what applies it to a model: called as hooks(model, config), it returns hooks
                    with install()/uninstall() (a `rag_mspoe.rope.hooks.ModelHooks` subclass)
      presets       names users can type for ready configs, each with its field values
      argument_name the spec name of its 'name:ARG' form, parsed by `from_argument` (none if empty)
      composes      Compose may stack it with other composing methods applied by the same hooks
      alone_because why it does not compose (for the error a user sees), when it does not
      once_per_compose  at most one config of this kind in a Compose
    and may override the methods below that say what it needs or does (batching, prompts, caches,
    reordering, remote engines): code elsewhere asks a config these, never which class it is.
    """

    kind: ClassVar[str] = ""
    hooks: ClassVar[Callable[[Any, Any], AppliedHooks]]
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    argument_name: ClassVar[str] = ""
    composes: ClassVar[bool] = False
    alone_because: ClassVar[str] = ""
    once_per_compose: ClassVar[bool] = False
    # The prompt document counts a held-out validation showed this config to help at (a shipped
    # config's "validated_documents"); None: not recorded. Not a field: it says where the config
    # was measured, not what it does, so equal settings stay equal configs.
    validated_documents: ClassVar[tuple[int, ...] | None] = None
    # The name a config shipped for a model answers to ("calibrated"), so every screen shows the
    # name users typed; None for others. Not a field, for the same reason.
    shipped_as: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:  # without one: a shared base of several methods, not a method
            register(cls)

    # -- what other parts of the package ask a method --------------------------------------------
    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        """The config of the spec part 'name:argument' (`part` is the whole part, for messages)."""
        raise NotImplementedError(f"{cls.__name__} sets argument_name but not from_argument.")

    def hooks_class(self) -> Callable[[Any, Any], AppliedHooks]:
        """What applies this config to a model (a Compose: what applies its parts)."""
        hooks = getattr(type(self), "hooks", None)
        if hooks is None:
            raise TypeError(
                f"No hooks apply a {type(self).__name__} (kind {self.kind!r}): its class declares none "
                "(set `hooks` on it, see rag_mspoe.methods.method_config)."
            )
        return hooks

    def reads_last_row(self) -> bool:
        """Whether it reads the last row of each sequence in a prefill, so that a right-padded batch
        (lm-evaluation-harness) would feed it padding: such methods run with batch size 1 there."""
        return False

    def needs_document_spans(self) -> bool:
        """Whether it needs to know where each document sits in the prompt (attention-level methods)."""
        return False

    def shares_prompt_prefixes(self) -> bool:
        """Whether a prompt's start computes the same under it whatever follows, so that prompts
        with a common start may share its KV cache (`rag_mspoe.engine.prefix_scoring`). Off unless a
        method declares it: a wrong yes would change scores silently."""
        return False

    def rewrites_prompt(self) -> bool:
        """Whether the method works by rewriting the prompt, after which the model reads the new
        prompt unmodified: the methods derived from `rag_mspoe.methods.prompt_rewriting.PromptRewriting`."""
        return False

    def keeps_rows_through_documents(self) -> bool:
        """Whether every prompt row up to the end of its last document computes exactly as in the
        unmodified model (the method changes only what reads the documents), so that the KV cache
        of those rows may come from the unmodified model, computed once for several such methods
        (`rag_mspoe.engine.document_prefix`). Off unless a method declares it."""
        return False

    def applies_at(self, documents: int, question_follows: bool = True) -> bool:
        """Whether it changes anything on a prompt of this many documents, followed by a question
        or not: all do, but a shipped method applied where it was validated only
        (`rag_mspoe.methods.where_validated`). Asked by a chain's document finder (nothing to warn
        about where it does nothing) and by the engine (a prompt that does not say where its
        documents are is read as one without them)."""
        return True

    def reorders_documents(self) -> bool:
        """Whether its rewriting reorders (or drops) the prompt's documents, so that the documents
        the model read, and where each went, are read off the two prompts (evaluation records them).
        Off unless a method declares it."""
        return False

    def reads_documents_as_a_set(self) -> bool:
        """Whether the model, under it, reads the documents as a set, its output independent of
        their order, so that a prompt should give each document the same text wherever it stands
        (no place number, which would tell the order). Off unless a method declares it."""
        return False

    def recorded_ranking(self) -> RecordedRanking | None:
        """What ranks the documents, when the method reorders them by one ranking pass that a sweep
        can record with each item and rebuild the prompt from; None for other methods."""
        return None

    def shares_document_scores(self, other: MethodConfig) -> bool:
        """Whether `other` reorders by the same per-document scores as this method, which the
        engine keeps per document, so that rewriting a prompt whose documents this method just
        scored runs no model. Off unless a method declares it."""
        return False

    def question_likelihood_order(self) -> QuestionLikelihoodOrder | None:
        """What orders the documents, when the method reorders them by each one's question
        log-likelihood read alone: all an engine that offers only prompt log-probabilities needs
        to run it. None for other methods (a method that changes the model cannot run remotely)."""
        return None

    def prepare(self, model: Any, tokenizer: Any, spans: Sequence[Sequence[tuple[int, int]] | None]) -> None:
        """Make ready, before it is applied, what the method needs to run on prompts with these
        document spans (one row per prompt; attention calibration estimates its positional bias
        for a new number of documents). Most methods need nothing."""

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"method": self.kind, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodConfig:
        data = dict(data)
        kind = data.pop("method", None)
        methods = registered_methods()
        if kind not in methods:
            raise ValueError(f"Unknown method {kind!r} in config; known methods: {sorted(methods)}.")
        target = methods[kind]
        names = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(set(data) - names - {"rag_mspoe_version", "base_model", VALIDATED_DOCUMENTS})
        if unknown:
            logger.warning(
                "Ignoring unknown keys %s in the %s config (saved by another version?)", unknown, kind
            )
        config = target._from_fields({k: v for k, v in data.items() if k in names})
        if data.get(VALIDATED_DOCUMENTS) is not None:
            # Set on the instance (the class keeps None): a per-config fact that is not a field.
            object.__setattr__(config, VALIDATED_DOCUMENTS, document_counts(data[VALIDATED_DOCUMENTS]))
        return config

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> MethodConfig:
        return cls(**fields)

    def save(self, path: str | os.PathLike[str], base_model: str | None = None) -> Path:
        """Write the config as JSON: to `path` if it ends in .json, else to `path/rag_mspoe_method.json`."""
        target = Path(path)
        if target.suffix != ".json":
            target = target / METHOD_FILE
        payload = {**self.to_dict(), "rag_mspoe_version": _package_version(), "base_model": base_model}
        if self.validated_documents is not None:
            payload[VALIDATED_DOCUMENTS] = list(self.validated_documents)
        atomic_write(target, (json.dumps(payload, indent=2) + "\n").encode())
        return target


@dataclass
class Compose(MethodConfig):
    """Several methods at once, applied by the same hooks (e.g. layer-wise on top of PI: per-layer
    factors multiply; an Ms-PoE among them has its per-head ratios multiplied by the layer factors).

    Which methods compose is their own declaration (`composes`, `once_per_compose`).
    """

    kind: ClassVar[str] = "compose"
    methods: list[MethodConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("Compose needs at least one method.")
        if any(isinstance(m, Compose) for m in self.methods):
            raise ValueError("Nest methods flat: Compose(methods=[a, b, c]), not Compose inside Compose.")
        names = [type(m).__name__ for m in self.methods]
        for index, method in enumerate(self.methods):
            if not method.composes:
                reason = f": {method.alone_because}" if method.alone_because else ""
                others = ", ".join(name for i, name in enumerate(names) if i != index) or "anything"
                raise ValueError(
                    f"{names[index]} does not compose with other methods{reason}; apply it on its own, "
                    f"not with {others}."
                )
        for kind in {m.kind for m in self.methods if m.once_per_compose}:
            if sum(m.kind == kind for m in self.methods) > 1:
                raise ValueError(f"Compose accepts at most one {registered_methods()[kind].__name__} method.")
        first = self.methods[0].hooks_class()
        for index, method in enumerate(self.methods[1:], start=1):
            other = method.hooks_class()
            if other is not first:
                # Each hooks class assumes it alone changes what it hooks (rotary tables, attention
                # rows): two of them on one forward would each undo or double the other's change.
                raise ValueError(
                    f"{names[0]} and {names[index]} do not compose: they are applied by different hooks "
                    f"({getattr(first, '__name__', first)} and {getattr(other, '__name__', other)}), "
                    "which do not stack; apply them one at a time."
                )

    def hooks_class(self) -> Callable[[Any, Any], AppliedHooks]:
        return self.methods[0].hooks_class()

    def reads_last_row(self) -> bool:
        return any(m.reads_last_row() for m in self.methods)

    def needs_document_spans(self) -> bool:
        return any(m.needs_document_spans() for m in self.methods)

    def shares_prompt_prefixes(self) -> bool:
        return all(m.shares_prompt_prefixes() for m in self.methods)

    def keeps_rows_through_documents(self) -> bool:
        return all(m.keeps_rows_through_documents() for m in self.methods)

    def prepare(self, model: Any, tokenizer: Any, spans: Sequence[Sequence[tuple[int, int]] | None]) -> None:
        for method in self.methods:
            method.prepare(model, tokenizer, spans)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.kind, "methods": [m.to_dict() for m in self.methods]}

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> MethodConfig:
        return cls(methods=[MethodConfig.from_dict(m) for m in fields.get("methods", [])])


class _Presets(Mapping[str, MethodConfig]):
    """Every preset name of every registered method, read from the registry when asked (so a
    method registered later is there too); each lookup gives a fresh config."""

    def __getitem__(self, name: str) -> MethodConfig:
        for method in registered_methods().values():
            if name in method.presets:
                return method(**method.presets[name])
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for method in list(registered_methods().values()) for name in method.presets)

    def __len__(self) -> int:
        return sum(len(method.presets) for method in registered_methods().values())


# Names a user can type (CLI, connectors, server model names) for ready configs.
NAMED_METHODS: Mapping[str, MethodConfig] = _Presets()


def argument_methods() -> dict[str, type[MethodConfig]]:
    """The method of each 'name:ARG' spec name."""
    return {method.argument_name: method for method in registered_methods().values() if method.argument_name}


def load_method(path: str | os.PathLike[str]) -> MethodConfig:
    """Read a config saved by `MethodConfig.save` (a .json file or the folder holding one)."""
    target = Path(path)
    try:
        if target.is_dir():
            target = target / METHOD_FILE
        if not target.is_file():
            raise FileNotFoundError(f"No method config at {target}; save one with config.save(folder).")
        data = json.loads(target.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{target} is not valid JSON ({exc}); re-save the method config.") from exc
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        # A name too long to look up, a folder that cannot be read: a message, not a traceback.
        reason = exc.strerror if isinstance(exc, OSError) else exc
        raise ValueError(f"Cannot read a method config at {str(target)[:200]!r}: {reason}.") from None
    try:
        return MethodConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{target}: {exc}; fix the value or re-save the method config.") from exc


def method_name(method: MethodConfig | None) -> str:
    """A short display name: the preset name when the config equals one, else its kind."""
    if method is None:
        return "none"
    if method.shipped_as:
        return method.shipped_as
    for name, named in NAMED_METHODS.items():
        if named == method:
            return name
    if isinstance(method, Compose):
        return "+".join(method_name(m) for m in method.methods)
    return method.kind


# -- checks and argument parsing that methods share ------------------------------------------------
def document_counts(value: Any) -> tuple[int, ...]:
    """A config's `validated_documents`: a non-empty list of positive document counts."""
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value)
    ):
        raise ValueError(
            f"{VALIDATED_DOCUMENTS} must be a non-empty list of positive document counts, e.g. [5, 10], "
            f"got {value!r}"
        )
    return tuple(sorted(set(value)))


# RoPE positions are divided by a factor: far below this one rotary angles overflow float32
# (1e-300 made every position inf and every logit NaN), long after a factor means anything.
MIN_POSITION_FACTOR = 1e-6


def check_factor(name: str, value: float) -> None:
    """A factor RoPE positions are divided by: finite and at least MIN_POSITION_FACTOR."""
    check_finite(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if value < MIN_POSITION_FACTOR:
        raise ValueError(
            f"{name} must be at least {MIN_POSITION_FACTOR:g}, got {value!r}: smaller factors stretch "
            "positions towards float32's overflow"
        )


def check_finite(name: str, value: float) -> None:
    # JSON reads 1e309 as inf: a factor like that rescales every position to nothing.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


# A finite decimal number in ASCII: float() also takes 'nan', 'inf', '1_0', ' 2' and other scripts'
# digits ('２'), each of which would name a method under a label of its own.
NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"


def number_argument(part: str, text: str) -> float:
    """A number in a spec part's argument; the error names the part."""
    value = float(text) if re.fullmatch(NUMBER, text, re.ASCII) else math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"{part!r}: {text!r} is not a number; write a finite one in plain digits, "
            "e.g. 'pi:2' or 'yarn:1.5'."
        )
    return value


def check_layers(layers: Sequence[int] | None) -> None:
    """A method's `layers` field: None (every layer) or non-negative layer indices."""
    if layers is not None and any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ValueError(f"layers must be non-negative layer indices (or None for all), got {layers}")


def chosen_layers(owner: str, layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """The layer indices a method's `layers` field picks in a model of `num_layers` layers."""
    if layers is None:
        return list(range(num_layers))
    bad = [i for i in layers if i >= num_layers]
    if bad:
        raise ValueError(f"{owner}.layers has {bad}; the model has {num_layers} layers.")
    return sorted(set(layers))
