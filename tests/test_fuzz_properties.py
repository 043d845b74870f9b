"""Property-based tests of what users and clients hand the package: method specs, tool-call
arguments, JSON schemas, chat messages and sampling settings. Whatever they hold, the answer is a
result or an error that names the problem (ValueError, PromptError), never another exception, a
crash or an answer built from NaN. Lists of cases find what someone thought of; these draw what no
one did. RAG_MSPOE_FUZZ_EXAMPLES raises the number of draws (benchmarks/fuzz.py runs them long)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fuzz_settings import fuzzed
from hypothesis import given
from hypothesis import strategies as st

from rag_mspoe.methods.method_config import MIN_POSITION_FACTOR
from rag_mspoe.methods.method_spec import known_names, resolve
from rag_mspoe.prompts.chat_template import PromptError, as_messages, render
from rag_mspoe.tools.json_output import check_schema

# Text of any code point, lone surrogates and NUL included: what JSON's \u escapes can carry.
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**6), 10**6).map(str),
    st.sampled_from(
        ["nan", "inf", "-inf", "1e400", "1e-400", "1_0", " 2", "\uff12", "0x10", ".5", "5.", "-0"]
    ),
)
NAMES = st.sampled_from(known_names())
PART = st.one_of(
    NAMES,
    st.builds(lambda name, number: f"{name}:{number}", NAMES, NUMBERS),
    st.builds(lambda low, high: f"mspoe:{low}-{high}", NUMBERS, NUMBERS),
    st.builds(lambda d, f: f"hidden:{d},{f}", NUMBERS, NUMBERS),
    ANY_TEXT,
)
SPECS = st.one_of(
    st.lists(PART, min_size=1, max_size=3).map("+".join),
    st.builds(
        lambda label, body: f"{label}={body}", ANY_TEXT, st.lists(PART, min_size=1, max_size=2).map("+".join)
    ),
    st.text(max_size=300),
    st.integers(200, 20_000).map(lambda n: "x" * n),
)


def _clean_error(error: Exception, limit: int = 4000) -> None:
    """An error a person can act on: a ValueError (or a missing file) with a bounded message."""
    assert isinstance(error, ValueError | FileNotFoundError), repr(error)[:500]
    assert 0 < len(str(error)) < limit, str(error)[:500]


@fuzzed
@given(SPECS)
def test_any_method_spec_resolves_or_is_refused_with_a_message(spec):
    try:
        method = resolve(spec)
    except Exception as error:  # noqa: BLE001 - the property is about which exceptions come out
        _clean_error(error)
        return
    label = spec.partition("=")[0].strip() if "=" in spec else ""
    if label:  # a label names the method in records and reports
        assert method.name == label
        return
    again = resolve(method.name)  # the name a run records without a label is a spec of the method
    assert (again.method, again.rope, again.order) == (method.method, method.rope, method.order)


@fuzzed
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_factor_is_taken_as_written_or_refused(factor):
    try:
        method = resolve(f"pi:{factor!r}")
    except ValueError as error:
        assert not (math.isfinite(factor) and factor >= MIN_POSITION_FACTOR), error
        return
    assert method.method.factor == factor and math.isfinite(factor) and factor >= MIN_POSITION_FACTOR


JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), ANY_TEXT
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=20,
)


def _deeply_nested(depth: int) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


ARGUMENTS = st.one_of(
    JSON_VALUES.map(json.dumps),
    JSON_VALUES.map(lambda value: json.dumps(value, ensure_ascii=False)),
    st.dictionaries(ANY_TEXT, JSON_VALUES, max_size=3),
    ANY_TEXT,
    st.integers(1, 3000).map(_deeply_nested),
)


@pytest.fixture(scope="module")
def tokenizer():
    from eval_run_helpers import embedded_tokenizer

    return embedded_tokenizer()


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@fuzzed
@given(arguments=ARGUMENTS, content=ANY_TEXT, tools=st.booleans())
def test_any_tool_call_in_the_history_renders_or_is_a_prompt_error(tokenizer, arguments, content, tools):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": content},
    ]
    try:
        ids = render(tokenizer, as_messages(messages), tools=[TOOL] if tools else ())
    except PromptError as error:
        _clean_error(error)
        return
    assert ids and all(isinstance(i, int) for i in ids)


SCHEMA_KEYS = st.sampled_from(
    [
        "type",
        "properties",
        "items",
        "required",
        "enum",
        "$ref",
        "anyOf",
        "allOf",
        "oneOf",
        "$defs",
        "additionalProperties",
        "minItems",
        "maxLength",
        "pattern",
        "const",
        "not",
        "format",
        "prefixItems",
    ]
)
REFS = st.sampled_from(
    ["#", "#/$defs/a", "#/$defs/b", "#/properties/x", "#/nowhere", "other.json", "#/$defs/a/items"]
)
SCHEMAS = st.recursive(
    st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(
                    ["string", "integer", "number", "boolean", "null", "object", "array", "nonsense"]
                )
            }
        ),
        st.builds(lambda ref: {"$ref": ref}, REFS),
        st.just({}),
    ),
    lambda inner: st.one_of(
        st.builds(
            lambda props: {"type": "object", "properties": props},
            st.dictionaries(ANY_TEXT, inner, max_size=3),
        ),
        st.builds(lambda item: {"type": "array", "items": item}, inner),
        st.builds(
            lambda parts, key: {key: parts},
            st.lists(inner, min_size=1, max_size=3),
            st.sampled_from(["anyOf", "allOf", "oneOf"]),
        ),
        st.builds(
            lambda defs, root: {**root, "$defs": defs} if isinstance(root, dict) else root,
            st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
            inner,
        ),
        st.dictionaries(SCHEMA_KEYS, inner | JSON_LEAVES, max_size=3),
    ),
    max_leaves=12,
)


def _ref_chain(length: int) -> dict[str, Any]:
    definitions = {
        f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(length)
    }
    return {"$defs": {**definitions, f"a{length}": {"type": "string"}}, "$ref": "#/$defs/a0"}


@fuzzed
@given(st.one_of(SCHEMAS, st.integers(1, 5000).map(_ref_chain)))
def test_any_schema_compiles_or_is_refused_with_a_message(schema):
    try:
        check_schema(schema)
    except (ValueError, TypeError) as error:  # a schema that is not a dict is a TypeError
        assert 0 < len(str(error)) < 4000
