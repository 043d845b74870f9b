"""Grammar-constrained decoding in the engine: a tiny random model (which writes noise) must still
produce answers that parse and validate, through generate, batches and streams, from one prefill."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Annotated, Literal

import jsonschema
import llguidance
import pytest
from pydantic import BaseModel, ConfigDict, Field
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.tools.grammar import Grammar, GrammarError, closed_objects, grammar_tokenizer
from rag_mspoe.tools.json_output import UnsupportedSchemaError, check_schema, describe, generate_json


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no free-form extra keys, whose names are unbounded

    city: str = Field(max_length=12)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=16)
    mood: Literal["happy", "sad", 'says "hi"']
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)
    home: Address  # nested, through $ref
    previous: list[Address] = Field(max_length=2)
    score: float | None


SCHEMA = Person.model_json_schema()


@pytest.fixture(scope="module")
def tiny(embedded):
    tokenizer = embedded[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.3)
    return Engine(model, tokenizer, name="tiny-llama")


@contextlib.contextmanager
def prefills_recorded(engine: Engine) -> Iterator[list[int]]:
    """Forward calls that read more than one new token (a prefill): their lengths, as they happen."""
    prefills: list[int] = []

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1:
            prefills.append(ids.shape[-1])

    handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield prefills
    finally:
        handle.remove()


@pytest.mark.parametrize("seed", range(4))
def test_noise_model_answers_valid_json_for_the_schema(tiny, seed):
    result = tiny.generate(
        "Describe someone.",
        grammar=Grammar.json_schema(SCHEMA),
        max_new_tokens=400,
        temperature=1.0,
        seed=seed,
    )
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), SCHEMA)
    Person.model_validate_json(result.text)


def test_quotes_and_backslashes_inside_strings_are_escaped(tiny):
    value = 'she said "hi" \\ bye'
    schema = {
        "type": "object",
        "properties": {"q": {"const": value}},
        "required": ["q"],
        "additionalProperties": False,
    }
    result = tiny.generate("Quote her.", grammar=Grammar.json_schema(schema), max_new_tokens=40)
    assert json.loads(result.text) == {"q": value}


def test_generate_json_is_one_prefill_with_arrays_and_nesting(tiny):
    with prefills_recorded(tiny) as prefills:
        result = generate_json(tiny, "Describe someone.", SCHEMA, max_new_tokens=300, temperature=1.0, seed=7)
    assert len(prefills) == 1  # one forward over the prompt, then one token at a time
    Person.model_validate_json(result.text)
    assert result.prompt_tokens == prefills[0]


def test_batch_and_stream_keep_the_grammar(tiny):
    grammar = Grammar.json_schema(Address.model_json_schema())
    results = tiny.generate_batch(
        ["a", "a much longer prompt than the other"], grammar=grammar, max_new_tokens=60
    )
    for result in results:
        Address.model_validate_json(result.text)
    stream = tiny.stream("a", grammar=grammar, max_new_tokens=60)
    assert "".join(stream) == results[0].text == stream.result.text


def test_regex_choice_and_json_object(tiny):
    code = tiny.generate("Code?", grammar=Grammar.regex(r"[A-Z]{2}-[0-9]{3}"), max_new_tokens=20)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", code.text) and code.finish_reason == "stop"
    for seed in range(3):
        pick = tiny.generate("?", grammar=Grammar.choice(["yes", "no", "maybe"]), temperature=1.0, seed=seed)
        assert pick.text in ("yes", "no", "maybe")
    anything = tiny.generate("?", grammar=Grammar.json_object(), max_new_tokens=200, temperature=1.0, seed=3)
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.text), dict)
    else:  # cut by max_new_tokens: still a valid start of an object
        assert anything.text.startswith("{")


def test_bad_grammars_and_combinations_are_named(tiny):
    with pytest.raises(GrammarError, match="unclosed group"):
        Grammar.regex("([a-z]")
    with pytest.raises(UnsupportedSchemaError, match="Invalid type: frobnicate"):
        check_schema({"type": "object", "properties": {"a": {"type": "frobnicate"}}})
    with pytest.raises(TypeError, match="non-empty list of non-empty strings"):
        Grammar.choice("yes")
    with pytest.raises(ValueError, match="prefix cannot be combined with grammar"):
        tiny.generate("?", grammar=Grammar.json_object(), prefix="{")
    with pytest.raises(TypeError, match="generate_json sets \\['stop'\\]"):
        generate_json(tiny, "?", SCHEMA, stop=["}"])


def test_instruction_lists_keys_with_types():
    text = describe(SCHEMA)
    assert '- "tags" (list of string)' in text
    assert '- "mood" (one of ["happy", "sad", "says \\"hi\\""])' in text
    assert '- "home" (object)' in text
    assert describe({"type": "array", "items": {"type": "integer"}}).startswith("Reply with only JSON valid")


@pytest.mark.slow
def test_embedded_model_fills_a_six_field_object(embedded):
    class Profile(BaseModel):
        name: str
        age: int
        city: str
        pets: list[str]
        likes_tea: bool
        mood: Literal["happy", "sad"]

    engine = Engine(*embedded)
    text = "Maria is 42, lives in Lisbon, has two cats named Tom and Kit, drinks tea daily and is cheerful."
    result = generate_json(engine, text, Profile.model_json_schema(), max_new_tokens=80)
    profile = Profile.model_validate_json(result.text)
    assert (profile.name, profile.age, profile.city) == ("Maria", 42, "Lisbon")


def test_structured_output_objects_take_only_their_listed_keys(tiny):
    schema = {
        "$defs": {
            "Inner": {"type": "object", "properties": {"properties": {"type": "integer", "maximum": 9}}}
        },
        "type": "object",
        "properties": {
            "inner": {"$ref": "#/$defs/Inner"},
            "free": {"type": "object", "additionalProperties": True},
        },
        "required": ["inner"],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Inner"]["additionalProperties"] is False
    assert closed["$defs"]["Inner"]["properties"] == {"properties": {"type": "integer", "maximum": 9}}
    assert closed["properties"]["free"]["additionalProperties"] is True  # stated by the schema: kept
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
    for seed in range(3):
        result = generate_json(
            tiny, "?", {**schema, "required": ["inner"]}, max_new_tokens=60, temperature=1.0, seed=seed
        )
        assert set(json.loads(result.text)) <= {"inner", "free"}


def accepts(engine: Engine, schema: dict, text: str) -> bool:
    """Whether the structured-output grammar of `schema` takes `text` as a whole answer."""
    vocabulary = grammar_tokenizer(engine.tokenizer, len(engine.tokenizer), [engine.tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(vocabulary, check_schema(schema).compiled(), log_level=0)
    tokens = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()


def test_an_object_that_only_requires_keys_takes_exactly_those(tiny):
    schema = {"type": "object", "required": ["city", "year"]}
    closed = closed_objects(schema)
    assert closed["properties"] == {"city": {}, "year": {}} and closed["additionalProperties"] is False
    assert accepts(tiny, schema, '{"city": "Rome", "year": [1]}')
    for text in ('{"city": "Rome"}', "{}", '{"city": "Rome", "year": 1, "mayor": "x"}'):
        assert not accepts(tiny, schema, text), text  # the extra key was allowed before


NAMED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
AGED = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}
ALL_OF = [
    {"allOf": [NAMED, AGED]},
    {"$defs": {"Named": NAMED}, "allOf": [{"$ref": "#/$defs/Named"}, AGED]},  # how pydantic extends
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "allOf": [{"required": ["name"]}],
    },
    {"type": "integer", "allOf": [{"minimum": 1}, {"maximum": 5}]},
]


@pytest.mark.parametrize("schema", ALL_OF)
def test_a_satisfiable_all_of_is_one_closed_object(tiny, schema):
    check_schema(schema)  # was "Unsatisfiable schema": each part closed alone forbade the others' keys
    keys = {"name", "age"}
    for seed in range(3):
        answer = json.loads(
            generate_json(tiny, "?", schema, max_new_tokens=60, temperature=1.0, seed=seed).text
        )
        jsonschema.validate(answer, schema)
        assert not isinstance(answer, dict) or set(answer) <= keys, answer


def test_unsatisfiable_all_of_is_still_refused_by_name():
    with pytest.raises(UnsupportedSchemaError, match="Unsatisfiable"):
        check_schema({"allOf": [{"type": "string"}, {"type": "integer"}]})


def test_tool_parameters_with_all_of_and_bare_required_give_valid_calls(tiny):
    from rag_mspoe.tools.tool_calls import generate_with_tools

    tools = [
        {"type": "function", "function": {"name": "person", "parameters": ALL_OF[1]}},
        {
            "type": "function",
            "function": {"name": "where", "parameters": {"type": "object", "required": ["city"]}},
        },
    ]
    for seed in range(3):
        answer = generate_with_tools(tiny, "?", tools, tool_choice="required", max_new_tokens=120, seed=seed)
        for call in answer.tool_calls:
            parameters = next(
                t["function"]["parameters"] for t in tools if t["function"]["name"] == call.name
            )
            jsonschema.validate(call.arguments, parameters)
            assert set(call.arguments) == ({"name", "age"} if call.name == "person" else {"city"})


def test_a_panic_inside_llguidance_is_a_grammar_error():
    # Found by tests/test_fuzz_properties.py: llguidance cut its message about a "format" that is
    # no string at byte 100, inside a four-byte character, and panicked (a BaseException).
    schema = {"format": {"type": "object", "properties": {"a" * 66 + "\U00034ce3": {"type": "null"}}}}
    with pytest.raises(GrammarError, match="cannot be compiled"):
        Grammar.json_schema(schema)
