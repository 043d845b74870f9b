"""Schema-constrained JSON: one generation whose answer is always valid JSON for a schema.

The request gets an instruction naming the keys, their types and descriptions (small models
follow that better than a raw schema), and the engine decodes under the schema's grammar
(`rag_mspoe.tools.grammar`): every token that would break the JSON or the schema is masked, so the
answer parses and validates (arrays, nested objects, enums, `$ref`, quotes inside strings),
unless max_new_tokens cuts it short (finish_reason "length"). One prefill per answer.
Objects take only their listed keys unless the schema allows more (`additionalProperties`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rag_mspoe.engine import Engine, GenerationResult
from rag_mspoe.prompts.chat_template import Prompt, as_messages
from rag_mspoe.tools.grammar import Grammar, GrammarError, closed_objects


class UnsupportedSchemaError(GrammarError):
    """The schema uses a construct the grammar compiler cannot turn into a grammar."""


def check_schema(schema: Mapping[str, Any]) -> Grammar:
    """The grammar for `schema`; UnsupportedSchemaError naming the problem if there is none."""
    try:
        return Grammar.json_schema(closed_objects(schema))
    except GrammarError as exc:
        raise UnsupportedSchemaError(f"{exc} Simplify the schema or drop the construct named.") from exc


def describe(schema: Mapping[str, Any]) -> str:
    """The instruction appended to the request: the keys, their types and descriptions."""
    root = _resolve(schema, schema)
    properties = root.get("properties") if root.get("type", "object") == "object" else None
    if not properties:
        return f"Reply with only JSON valid for this JSON schema: {json.dumps(schema)}"
    lines = ["Reply with only a JSON object with these keys:"]
    for key, field in properties.items():
        field = _resolve(field, schema)
        about = f": {field['description']}" if field.get("description") else ""
        lines.append(f'- "{key}" ({_kind(field, schema)}){about}')
    return "\n".join(lines)


def generate_json(
    engine: Engine, prompt: Prompt, schema: Mapping[str, Any], **settings: Any
) -> GenerationResult:
    """Answer a prompt with JSON valid for `schema` (the JSON is the result's text).

    settings are the engine's; max_new_tokens caps the whole answer, and stop/prefix/raw are
    taken over by the schema.
    """
    grammar = check_schema(schema)
    taken = sorted({"stop", "prefix", "raw", "grammar"} & set(settings))
    if taken:
        raise TypeError(f"generate_json sets {taken} itself from the schema; leave them out.")
    messages = _with_instruction(as_messages(prompt), describe(schema))
    return engine.generate(messages, grammar=grammar, **settings)


def _with_instruction(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    if messages[-1]["role"] == "user":
        last = messages[-1]
        return [*messages[:-1], {**last, "content": f"{last['content']}\n\n{instruction}"}]
    return [*messages, {"role": "user", "content": instruction}]


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """Follow a local $ref ("#/$defs/Name") and pick the non-null branch of a nullable anyOf."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        return _resolve({**target, **{k: v for k, v in schema.items() if k == "description"}}, root)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        concrete = [o for o in options if o.get("type") != "null"]
        if len(concrete) == 1:
            return _resolve({**concrete[0], **{k: v for k, v in schema.items() if k == "description"}}, root)
    return schema


def _kind(schema: Mapping[str, Any], root: Mapping[str, Any]) -> str:
    """A short human description of a field's type, for the instruction."""
    if "enum" in schema:
        return f"one of {json.dumps(schema['enum'])}"
    if "const" in schema:
        return f"exactly {json.dumps(schema['const'])}"
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return f"list of {_kind(_resolve(items, root), root)}" if isinstance(items, Mapping) else "list"
    if isinstance(kind, list):
        return " or ".join(map(str, kind))
    return str(kind or "any JSON value")
