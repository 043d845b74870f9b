"""Schema-guided JSON: the schema writes the structure, the model writes only the values.

A small model seldom writes valid JSON for a schema on its own. Here the braces, keys, quotes
and commas come from the schema, and the model fills one value at a time, seeing the request and
all the JSON written so far (as the start of its own answer), so the result always parses and
always has every key.

Supported: objects (nested too), strings, numbers, integers, booleans, string enums, and the
nullable forms of these (which get a value). Arrays and objects without listed properties are
refused by `check_schema` with the path of the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rag_mspoe.chat_template import Prompt, as_messages
from rag_mspoe.engine import Engine, GenerationResult

_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")
_INTEGER = re.compile(r"\s*(-?\d+)")
_SCALAR_END = [",", "}", "\n"]  # where the model would end a number or a boolean


class UnsupportedSchemaError(ValueError):
    """The schema uses a construct schema-guided JSON cannot fill."""


def check_schema(schema: Mapping[str, Any]) -> None:
    """Raise UnsupportedSchemaError naming the first field this module cannot fill."""
    _kind(_resolve(schema, schema), schema, "$")


def describe(schema: Mapping[str, Any]) -> str:
    """The instruction appended to the request: the keys, their types and descriptions."""
    root = _resolve(schema, schema)
    lines = ["Reply with only a JSON object with these keys:"]
    for key, field in root["properties"].items():
        field = _resolve(field, schema)
        kind = _kind(field, schema, key)
        detail = f" one of {field['enum']}" if kind == "enum" else ""
        about = f": {field['description']}" if field.get("description") else ""
        lines.append(f'- "{key}" ({kind}{detail}){about}')
    return "\n".join(lines)


def generate_json(
    engine: Engine, prompt: Prompt, schema: Mapping[str, Any], **settings: Any
) -> GenerationResult:
    """Answer a prompt with a JSON object for `schema` (the JSON is the result's text).

    settings are the engine's; max_new_tokens caps each value, and stop/prefix/raw are taken
    over by the schema. completion_tokens counts the tokens the model wrote (the values).
    """
    check_schema(schema)
    taken = sorted({"stop", "prefix", "raw"} & set(settings))
    if taken:
        raise TypeError(f"generate_json sets {taken} itself from the schema; leave them out.")
    messages = _with_instruction(as_messages(prompt), describe(schema))
    writer = _Writer(engine, messages, schema, settings)
    writer.value(schema, "$")
    return GenerationResult(
        text=writer.text,
        prompt_tokens=engine.count_tokens(messages),
        completion_tokens=writer.generated,
        finish_reason="length" if writer.hit_length else "stop",
        method=writer.method,
    )


def _with_instruction(messages: list[dict[str, str]], instruction: str) -> list[dict[str, str]]:
    if messages[-1]["role"] == "user":
        last = messages[-1]
        return [*messages[:-1], {"role": "user", "content": f"{last['content']}\n\n{instruction}"}]
    return [*messages, {"role": "user", "content": instruction}]


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """Follow a local $ref ("#/$defs/Name") and pick the non-null branch of a nullable anyOf."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        return _resolve(target, root)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        concrete = [o for o in options if o.get("type") != "null"]
        if len(concrete) == 1:
            return _resolve({**concrete[0], **{k: v for k, v in schema.items() if k == "description"}}, root)
    return schema


def _kind(schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> str:
    if "enum" in schema:
        if not all(isinstance(v, str) for v in schema["enum"]):
            raise UnsupportedSchemaError(
                f"{path}: only enums of strings are supported, got {schema['enum']}."
            )
        return "enum"
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"]
        concrete = [k for k in kind if k != "null"]
        kind = concrete[0] if len(concrete) == 1 else kind
    if kind == "object":
        properties = schema.get("properties")
        if not properties:
            raise UnsupportedSchemaError(f"{path}: objects need listed properties for schema-guided JSON.")
        for key, field in properties.items():
            _kind(_resolve(field, root), root, f"{path}.{key}")
        return "object"
    if kind in ("string", "number", "integer", "boolean"):
        return str(kind)
    raise UnsupportedSchemaError(
        f"{path}: type {kind or schema!r} is not supported by schema-guided JSON "
        "(objects, strings, numbers, integers, booleans and string enums are)."
    )


class _Writer:
    """Builds the JSON text, asking the model for each value in turn."""

    def __init__(
        self,
        engine: Engine,
        messages: list[dict[str, str]],
        root: Mapping[str, Any],
        settings: dict[str, Any],
    ) -> None:
        self.engine = engine
        self.messages = messages
        self.root = root
        self.settings = settings
        self.text = ""
        self.generated = 0
        self.hit_length = False
        self.method = "none"

    def value(self, schema: Mapping[str, Any], path: str) -> None:
        schema = _resolve(schema, self.root)
        kind = _kind(schema, self.root, path)
        if kind == "object":
            self.text += "{"
            for i, (key, field) in enumerate(schema["properties"].items()):
                self.text += (", " if i else "") + json.dumps(key) + ": "
                self.value(field, f"{path}.{key}")
            self.text += "}"
        elif kind == "string":
            self.text += '"'
            self.text += json.dumps(self._ask(['"']))[1:]  # escaped, with the closing quote
        elif kind in ("enum", "boolean"):
            # Fixed options: take the one the model finds most likely, so the answer is always valid.
            options = [json.dumps(o) for o in schema["enum"]] if kind == "enum" else ["true", "false"]
            self.text += self._pick(options)
        else:
            written = self._ask(_SCALAR_END)
            match = (_INTEGER if kind == "integer" else _NUMBER).match(written)
            if match is None:
                raise ValueError(f"The model wrote {written!r} where {path} needs a number ({kind}).")
            self.text += match.group(1)

    def _ask(self, stop: list[str]) -> str:
        result = self.engine.generate(self.messages, prefix=self.text, stop=stop, **self.settings)
        self.generated += result.completion_tokens
        self.hit_length = self.hit_length or result.finish_reason == "length"
        self.method = result.method
        return result.text

    def _pick(self, options: list[str]) -> str:
        method = self.settings.get("method")
        scores = self.engine.loglikelihood(self.messages, options, prefix=self.text, method=method)
        return options[scores.index(max(scores))]
