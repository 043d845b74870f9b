"""Grammar-constrained decoding: the model may only write tokens that keep its answer valid.

    engine.generate("Describe Alice.", grammar=Grammar.json_schema(Person.model_json_schema()))
    engine.generate("Pick one.", grammar=Grammar.choice(["yes", "no"]))

A `Grammar` (JSON schema, any JSON object, regex, a fixed choice, or a Lark grammar) is compiled
by llguidance against the model's tokenizer; `GrammarProcessor` is a transformers logits
processor that masks every token the grammar forbids at each step, so the answer comes from one
prefill and one decoding loop, inside the engine's own `generate` (rescaling hooks, stop strings,
streaming, timeouts and the model lock stay as they are).

JSON is written compactly (", " and ": " separators, no free whitespace): a small model left
free to add whitespace can fill its whole token budget with newlines.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import numpy as np
import torch
from transformers import LogitsProcessor

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]

# Compact JSON; a schema's own "x-guidance" options still override these.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = (
    weakref.WeakKeyDictionary()
)
_tokenizers_guard = threading.Lock()


class GrammarError(ValueError):
    """A grammar (or JSON schema) that cannot be compiled; the message says what is wrong."""


@dataclass(frozen=True)
class Grammar:
    """What an answer must match. Build one with the class methods; `source` is canonical text."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Grammar:
        """A JSON value valid against `schema` (objects, arrays, nesting, enums, $ref, anyOf, ...)."""
        if not isinstance(schema, Mapping):
            raise TypeError(f"A JSON schema is a dict, got {type(schema).__name__}.")
        return cls._checked("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls._checked("json_object", json.dumps({"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the whole regex (Rust `regex` syntax, close to Python's `re`)."""
        if not isinstance(pattern, str) or not pattern:
            raise TypeError("A regex grammar takes a non-empty pattern string.")
        return cls._checked("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Exactly one of the given strings."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise TypeError(f"A choice grammar takes a non-empty list of non-empty strings, got {options!r}.")
        return cls._checked("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (`start:` rule, `%json {...}` for inline schemas)."""
        return cls._checked("lark", text)

    @classmethod
    def _checked(cls, kind: GrammarKind, source: str) -> Grammar:
        grammar = cls(kind, source)
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar.compiled())
        except BaseException as exc:
            # A panic in llguidance's Rust code (a "format" that is no string, in a schema with
            # multi-byte text, cut its error message inside a character) is a BaseException.
            if type(exc).__name__ != "PanicException":
                raise
            raise GrammarError(
                f"The {kind.replace('_', ' ')} grammar cannot be compiled: {str(exc)[:300]}"
            ) from None
        if is_error:
            raise GrammarError(f"The {kind.replace('_', ' ')} grammar cannot be compiled: {messages[0]}")
        return grammar

    def compiled(self) -> str:
        """The grammar in llguidance's own format."""
        if self.kind in ("json_schema", "json_object"):
            return str(llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
        if self.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.source))
        if self.kind == "choice":
            options = json.loads(self.source)
            return str(
                llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options)))
            )
        return str(llguidance.LLMatcher.grammar_from_lark(self.source))


# llguidance follows a chain of references on the native stack: 1,000 chained definitions
# crashed a server thread (a segmentation fault, not an error), 800 did not.
MAX_SCHEMA_REFS = 256
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_LOCAL_DEFINITIONS = ("#/$defs/", "#/definitions/")


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema whose objects take only the keys they name (in `properties` or
    `required`), unless a schema says otherwise (`additionalProperties`), as OpenAI's strict mode
    requires.

    JSON Schema lets objects have any extra key by default; a model decoding under that grammar
    may invent keys after the real ones, which helps no one reading structured output. The parts
    of an `allOf` describe one object together: it is closed once, over the keys all of them name
    (closing each part alone would let each forbid the others' keys, so no object would fit).
    """
    _check_references(schema)
    return _closed(schema, schema, close=True, inlined=frozenset())


def _check_references(root: Any) -> None:
    """Refuse what llguidance cannot compile safely: more different `$ref`s than MAX_SCHEMA_REFS,
    and a `$ref` that leads back to itself through `$ref`s and `allOf` parts alone. Walked with
    stacks: a schema may nest deep and chain many references."""
    refs: set[str] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"])
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    if len(refs) > MAX_SCHEMA_REFS:
        raise GrammarError(
            f"The schema holds {len(refs)} different $refs, more than the {MAX_SCHEMA_REFS} a grammar "
            "takes here; merge definitions."
        )
    cycle = _ref_cycle(root, refs)
    if cycle is not None:
        raise GrammarError(
            f"The schema's $ref {cycle!r} leads back to itself through nothing but references, so no "
            "JSON value fits it; give the reference something to match (a type, properties) or drop it."
        )


def _ref_cycle(root: Any, refs: set[str]) -> str | None:
    """A `$ref` among `refs` that leads back to itself through `$ref`s and `allOf` parts alone
    (`{"$ref": "#"}`): llguidance compiles it to a grammar that matches nothing, and the answer
    came back empty."""
    leads_to = {ref: _required_refs(_pointed(root, ref)) for ref in refs}
    done: set[str] = set()
    for start in leads_to:
        path, on_path = [(start, iter(leads_to[start]))], {start}
        while path:
            ref, following = path[-1]
            after = next(following, None)
            if after is None:
                done.add(ref)
                on_path.discard(ref)
                path.pop()
            elif after in on_path:
                return after
            elif after not in done and after in leads_to:
                path.append((after, iter(leads_to[after])))
                on_path.add(after)
    return None


def _required_refs(schema: Any) -> list[str]:
    """The references a value must also fit to fit `schema`, before any of it is read: its own
    `$ref` and those of its `allOf` parts."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            if isinstance(node.get("$ref"), str):
                found.append(node["$ref"])
            if isinstance(node.get("allOf"), list):
                stack += node["allOf"]
    return found


def _pointed(root: Any, ref: str) -> Any:
    """The part of `root` a local reference ('#', '#/$defs/a') points to; None if none."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping):
            node = node.get(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _closed(schema: Any, root: Any, close: bool, inlined: frozenset[str]) -> Any:
    """`schema` closed (`close`: its own object too, not only the objects inside it)."""
    if not isinstance(schema, Mapping):
        return schema
    copy: dict[str, Any] = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(copy.get(key), Mapping):
            copy[key] = {name: _closed(sub, root, True, inlined) for name, sub in copy[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(copy.get(key), list):
            copy[key] = [_closed(sub, root, True, inlined) for sub in copy[key]]
    if isinstance(copy.get("allOf"), list):
        copy["allOf"] = [
            _closed(_inline(sub, root, inlined), root, False, inlined | {_ref(sub)}) for sub in copy["allOf"]
        ]
    for key in _SCHEMA_VALUES:
        if isinstance(copy.get(key), Mapping):
            copy[key] = _closed(copy[key], root, True, inlined)
    names = _named_keys(copy)
    if close and names is not None and "additionalProperties" not in copy:
        listed = copy.get("properties")
        own: Mapping[str, Any] = listed if isinstance(listed, Mapping) else {}
        copy["properties"] = {**{name: {} for name in names if name not in own}, **own}
        copy["additionalProperties"] = False
    return copy


def _ref(schema: Any) -> str:
    return str(schema.get("$ref", "")) if isinstance(schema, Mapping) else ""


def _inline(schema: Any, root: Any, inlined: frozenset[str]) -> Any:
    """An `allOf` part that is a local `$ref` (with or without other keys), as the definition it
    names merged with those keys: so the definition's object is closed with the others, not alone."""
    ref = _ref(schema)
    if ref in inlined or not ref.startswith(_LOCAL_DEFINITIONS) or not isinstance(root, Mapping):
        return schema
    section, _, name = ref[2:].partition("/")
    definition = (root.get(section) or {}).get(name)
    if not isinstance(definition, Mapping):
        return schema  # llguidance names the missing definition
    rest = {key: value for key, value in schema.items() if key != "$ref"}
    return {**definition, **rest}


def _named_keys(schema: Mapping[str, Any]) -> list[str] | None:
    """The keys an object schema names, its `allOf` parts' included; None when it names none."""
    names: list[str] = []
    named = False
    for part in [schema, *(p for p in schema.get("allOf") or [] if isinstance(p, Mapping))]:
        properties, required = part.get("properties"), part.get("required")
        if isinstance(properties, Mapping):
            named = True
            names += [name for name in properties if name not in names]
        if isinstance(required, list) and required:
            named = True
            names += [name for name in required if isinstance(name, str) and name not in names]
    return names if named else None


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> Any:
    """llguidance's view of a Hugging Face tokenizer, built once (about a second) and cached."""
    key = (vocab_size, tuple(sorted(eos_ids)))
    with _tokenizers_guard:
        per_tokenizer = _tokenizers.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            from llguidance.hf import from_tokenizer

            if not getattr(tokenizer, "is_fast", False):
                raise GrammarError(
                    "Constrained decoding needs a fast (Rust) tokenizer; load the model's tokenizer.json."
                )
            per_tokenizer[key] = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(key[1]))
        return per_tokenizer[key]


class GrammarProcessor(LogitsProcessor):
    """Masks, for every row of a batch, the tokens its grammar forbids next.

    Each call first feeds the row's last sampled token to its matcher (from the second call on),
    then sets the logits of forbidden tokens to -inf. A row that `generate` has finished (end of
    turn, a stop string) keeps receiving padding; its matcher is then left alone. A token its
    mask allowed is never dropped that way: the matcher refusing it is an error, not a row
    silently left free of its grammar.
    """

    def __init__(self, grammar: Grammar, tokenizer: Any, rows: int) -> None:
        compiled = grammar.compiled()
        self._matchers = [llguidance.LLMatcher(tokenizer, compiled, log_level=0) for _ in range(rows)]
        for matcher in self._matchers:
            if matcher.is_error():
                raise GrammarError(f"The {grammar.kind} grammar cannot be used: {matcher.get_error()}")
        self._active = [True] * rows
        self._allowed: list[np.ndarray | None] = [None] * rows  # each row's last mask
        self._started = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._started:
            for row, token in enumerate(input_ids[:, -1].tolist()):
                if self._active[row] and not self._matchers[row].is_stopped():
                    self._active[row] = self._consumed(row, token)
        self._started = True
        width = scores.shape[-1]
        for row, matcher in enumerate(self._matchers):
            if not self._active[row] or matcher.is_stopped() and not matcher.is_accepting():
                continue
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:width].astype(bool)
            if not allowed.any():
                raise GrammarError(f"The grammar allows no next token: {matcher.get_error() or 'dead end'}.")
            self._allowed[row] = allowed
            forbidden = torch.from_numpy(~allowed).to(scores.device)
            scores[row, : forbidden.shape[0]].masked_fill_(forbidden, float("-inf"))
            scores[row, forbidden.shape[0] :] = float("-inf")
        return scores

    def _consumed(self, row: int, token: int) -> bool:
        """Feed a row its token: False for padding after the row finished. A token the mask
        allowed and the matcher refuses would leave the row unconstrained; that is an error."""
        if self._matchers[row].consume_token(token):
            return True
        allowed = self._allowed[row]
        if allowed is not None and token < allowed.shape[0] and allowed[token]:
            raise GrammarError(
                f"The grammar allowed token {token} and then refused it "
                f"({self._matchers[row].get_error()}); write markers that are single tokens as "
                "<[token id]> in the grammar."
            )
        return False
