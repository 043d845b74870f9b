"""Structured output and tool calling on the embedded model: speed, validity, tool selection.

    python benchmarks/bench_structured.py                        # all three parts
    python benchmarks/bench_structured.py --parts speed --repeats 1
    python benchmarks/bench_structured.py --model qwen2.5-coder-1.5b-instruct --parts tools --threads 1

speed: a 6-field object (one array) by grammar-constrained decoding (one generation) against
the per-field approach this project used before, loaded from git history (`BASELINE_COMMIT`;
it ran one generate per value and could not write arrays, so its object has the list as a string),
with the request alone and after a RAG-sized context (the per-field approach re-reads the
prompt for every value; the grammar decodes the keys and braces token by token instead).
validity: the share of answers that parse and validate, over 50 JSON schemas (hand-written ones
in the shapes of the LangChain standard suite's and more, plus generated ones).
tools: 30 tool-use prompts of our own over 6 tools, tool_choice "required": right tool chosen,
arguments valid for its schema, arguments equal to the expected ones.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import jsonschema

BASELINE_COMMIT = "1bf3b0a"  # the last commit with per-field schema-guided JSON
REPO = Path(__file__).resolve().parents[1]

PROFILE_TEXT = (
    "Maria Lopes is 42 and lives in Lisbon, where she works as a ferry engineer. She keeps two cats, "
    "Tom and Kit, and a parrot called Rui. She drinks tea daily."
)
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "job": {"type": "string"},
        "pets": {"type": "array", "items": {"type": "string"}},
        "drinks_tea": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "job", "pets", "drinks_tea"],
}


def baseline_module() -> types.ModuleType:
    """rag_mspoe/tools/json_output.py as it was at BASELINE_COMMIT, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{BASELINE_COMMIT}:rag_mspoe/tools/json_output.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("json_output_per_field")
    exec(compile(source, f"{BASELINE_COMMIT}:json_output.py", "exec"), module.__dict__)
    return module


def rag_context(engine: Any, tokens: int) -> str:
    """About `tokens` tokens of retrieved-looking passages (the demo corpus), to put before the request."""
    from rag_mspoe.pipelines.demo import demo_corpus_dir

    text = "\n\n".join(path.read_text() for path in sorted(demo_corpus_dir().iterdir()))
    ids = engine.encode(text)[:tokens]
    return engine.tokenizer.decode(ids) if ids else ""


def bench_speed(engine: Any, repeats: int, context_tokens: int) -> dict[str, Any]:
    from rag_mspoe.tools.json_output import generate_json

    old = baseline_module()
    old_schema = json.loads(json.dumps(PROFILE))
    old_schema["properties"]["pets"] = {"type": "string", "description": "comma-separated"}
    context = rag_context(engine, context_tokens)
    prompt = f"{context}\n\n{PROFILE_TEXT}" if context else PROFILE_TEXT
    generate_json(engine, "Warm up.", {"type": "boolean"})  # builds the grammar tokenizer once
    timings: dict[str, list[float]] = {"grammar": [], "per_field": []}
    outputs = {}
    for _ in range(repeats):
        started = time.perf_counter()
        outputs["grammar"] = generate_json(engine, prompt, PROFILE, max_new_tokens=128).text
        timings["grammar"].append(time.perf_counter() - started)
        started = time.perf_counter()
        outputs["per_field"] = old.generate_json(engine, prompt, old_schema, max_new_tokens=24).text
        timings["per_field"].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    return {
        "prompt_tokens": engine.count_tokens(prompt),
        "grammar_s": round(medians["grammar"], 2),
        "per_field_s": round(medians["per_field"], 2),
        "speedup": round(medians["per_field"] / medians["grammar"], 2),
        "grammar_output": outputs["grammar"],
        "per_field_output": outputs["per_field"],
    }


# -- validity -----------------------------------------------------------------------------------------
HAND_WRITTEN: list[dict[str, Any]] = [
    # The shapes of the LangChain standard suite's structured-output tests.
    {
        "title": "Joke",
        "type": "object",
        "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
        "required": ["setup", "punchline"],
    },
    {
        "title": "Joke",
        "type": "object",
        "properties": {
            "setup": {"type": "string"},
            "punchline": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["setup"],
    },
    {
        "title": "Person",
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "likes_cats": {"type": "boolean"},
        },
        "required": ["name", "age", "likes_cats"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["mood", "score"],
    },
    {
        "$defs": {
            "Point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/Point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}},
        },
        "required": ["start", "path"],
    },
    {
        "type": "object",
        "properties": {"quote": {"type": "string"}, "speaker": {"type": "string"}},
        "required": ["quote", "speaker"],
        "description": "A quotation; quotes inside it are escaped.",
    },
    {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {"item": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
                "required": ["item", "count"],
            }
        },
        "required": ["order"],
    },
    {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
                },
                "required": ["label", "children"],
            }
        },
        "$ref": "#/$defs/Node",
    },
]
FIELD_KINDS: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"enum": ["low", "medium", "high"]},
    {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    {"type": "array", "items": {"type": "integer"}},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
    },
]
FIELD_NAMES = [
    "title",
    "count",
    "price",
    "active",
    "priority",
    "tags",
    "sizes",
    "note",
    "detail",
    "owner",
    "year",
]


def generated_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    schemas = []
    for _ in range(count):
        names = rng.sample(FIELD_NAMES, rng.randint(2, 6))
        properties = {name: rng.choice(FIELD_KINDS) for name in names}
        schemas.append({"type": "object", "properties": properties, "required": names})
    return schemas


def bench_validity(engine: Any, count: int, max_tokens: int) -> dict[str, Any]:
    from rag_mspoe.tools.json_output import generate_json

    schemas = (HAND_WRITTEN + generated_schemas(max(0, count - len(HAND_WRITTEN))))[:count]
    valid = cut = 0
    started = time.perf_counter()
    for schema in schemas:
        result = generate_json(engine, "Make up a realistic example.", schema, max_new_tokens=max_tokens)
        if result.finish_reason == "length":
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(result.text), schema)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            print(f"INVALID: {exc}\n{result.text}", file=sys.stderr)
    return {
        "schemas": len(schemas),
        "valid": valid,
        "valid_rate": round(valid / len(schemas), 3),
        "valid_rate_of_finished": round(valid / max(1, len(schemas) - cut), 3),
        "cut_by_max_tokens": cut,
        "seconds": round(time.perf_counter() - started, 1),
    }


# -- tools --------------------------------------------------------------------------------------------
def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    _tool("get_weather", "Current weather in a city.", {"city": {"type": "string"}}),
    _tool("add_numbers", "Add two numbers.", {"a": {"type": "number"}, "b": {"type": "number"}}),
    _tool(
        "convert_currency",
        "Convert an amount between currencies.",
        {"amount": {"type": "number"}, "to": {"enum": ["USD", "EUR", "GBP", "JPY"]}},
    ),
    _tool("search_documents", "Search the document archive.", {"query": {"type": "string"}}),
    _tool("set_timer", "Set a timer.", {"minutes": {"type": "integer", "minimum": 1}}),
    _tool(
        "translate",
        "Translate text.",
        {"text": {"type": "string"}, "language": {"enum": ["French", "German", "Spanish"]}},
    ),
]
# (prompt, tool, expected arguments: strings compare case-insensitively, numbers exactly)
TOOL_PROMPTS: list[tuple[str, str, dict[str, Any]]] = [
    ("What's the weather like in Paris right now?", "get_weather", {"city": "Paris"}),
    ("Is it raining in London?", "get_weather", {"city": "London"}),
    ("How hot is it in Cairo today?", "get_weather", {"city": "Cairo"}),
    ("Weather forecast for Tokyo please.", "get_weather", {"city": "Tokyo"}),
    ("Tell me the current weather in Berlin.", "get_weather", {"city": "Berlin"}),
    ("What is 12 plus 30?", "add_numbers", {"a": 12, "b": 30}),
    ("Add 7 and 5.", "add_numbers", {"a": 7, "b": 5}),
    ("Compute the sum of 100 and 250.", "add_numbers", {"a": 100, "b": 250}),
    ("What do 3.5 and 1.5 add up to?", "add_numbers", {"a": 3.5, "b": 1.5}),
    ("Please add 41 to 1.", "add_numbers", {"a": 41, "b": 1}),
    ("Convert 100 dollars to euros.", "convert_currency", {"amount": 100, "to": "EUR"}),
    ("How many yen is 50 dollars?", "convert_currency", {"amount": 50, "to": "JPY"}),
    ("Change 20 euros into pounds.", "convert_currency", {"amount": 20, "to": "GBP"}),
    ("What is 75 pounds in US dollars?", "convert_currency", {"amount": 75, "to": "USD"}),
    ("Convert 10 euros to dollars.", "convert_currency", {"amount": 10, "to": "USD"}),
    ("Find documents about the lighthouse keepers.", "search_documents", {"query": "lighthouse keepers"}),
    ("Search the archive for ferry schedules.", "search_documents", {"query": "ferry schedules"}),
    ("Look up the history of the wool fair.", "search_documents", {"query": "wool fair"}),
    ("Search for notes on island food.", "search_documents", {"query": "island food"}),
    ("Find anything about the festival.", "search_documents", {"query": "festival"}),
    ("Set a timer for 10 minutes.", "set_timer", {"minutes": 10}),
    ("Remind me in 5 minutes.", "set_timer", {"minutes": 5}),
    ("Start a 25 minute timer.", "set_timer", {"minutes": 25}),
    ("Timer for 3 minutes please.", "set_timer", {"minutes": 3}),
    ("Set an alarm to go off in 60 minutes.", "set_timer", {"minutes": 60}),
    ("Translate 'good morning' into French.", "translate", {"text": "good morning", "language": "French"}),
    ("How do you say 'thank you' in German?", "translate", {"text": "thank you", "language": "German"}),
    (
        "Translate 'where is the station' to Spanish.",
        "translate",
        {"text": "where is the station", "language": "Spanish"},
    ),
    ("Say 'I love cats' in French.", "translate", {"text": "I love cats", "language": "French"}),
    ("Put 'see you tomorrow' into German.", "translate", {"text": "see you tomorrow", "language": "German"}),
]


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, str):
        return isinstance(got, str) and got.strip().strip(".").lower() == expected.lower()
    return not isinstance(got, bool) and isinstance(got, (int, float)) and float(got) == float(expected)


def _round_robin(keys: list[str]) -> list[int]:
    """Indices of `keys` taking one of each key in turn (first-seen key order)."""
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    rounds = max(len(g) for g in groups.values())
    return [g[r] for r in range(rounds) for g in groups.values() if r < len(g)]


def bench_tools(engine: Any, max_tokens: int) -> dict[str, Any]:
    from rag_mspoe.tools.tool_calls import generate_with_tools

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    right_tool = valid = correct = no_call = 0
    started = time.perf_counter()
    # Round-robin over the tools, so that the lines printed so far cover every tool.
    order = [TOOL_PROMPTS[i] for i in _round_robin([p[1] for p in TOOL_PROMPTS])]
    for number, (prompt, tool, expected) in enumerate(order, 1):
        answer = generate_with_tools(
            engine,
            prompt,
            TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_new_tokens=max_tokens,
        )
        # One line per prompt as it is answered: progress on a slow CPU, and what each answer was.
        line = f"{number}/{len(TOOL_PROMPTS)} {prompt!r} -> {answer.result.text!r}"
        print(line, file=sys.stderr, flush=True)
        if not answer.tool_calls:  # max_tokens ran out inside the call
            no_call += 1
            continue
        call = answer.tool_calls[0]
        try:
            jsonschema.validate(call.arguments, schemas[call.name])
            valid += 1
        except jsonschema.ValidationError:
            pass
        if call.name == tool:
            right_tool += 1
            correct += all(_same(value, call.arguments.get(key)) for key, value in expected.items())
    total = len(TOOL_PROMPTS)
    return {
        "prompts": total,
        "right_tool": right_tool,
        "args_valid": valid,
        "args_correct": correct,
        "no_call_within_max_tokens": no_call,
        "right_tool_rate": round(right_tool / total, 3),
        "args_valid_rate": round(valid / total, 3),
        "args_correct_rate": round(correct / total, 3),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model dir, hub id or GGUF (default: the embedded model)"
    )
    parser.add_argument(
        "--parts", nargs="+", default=["speed", "validity", "tools"], choices=["speed", "validity", "tools"]
    )
    parser.add_argument("--repeats", type=int, default=3, help="speed: runs of each approach (median)")
    parser.add_argument(
        "--context-tokens",
        type=int,
        nargs="+",
        default=[0, 1500],
        help="speed: sizes of retrieved context put before the request (0: the request alone)",
    )
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=160, help="validity and tools: budget per answer")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the CPUs free of other load)"
    )
    args = parser.parse_args()

    from rag_mspoe.engine import Engine
    from rag_mspoe.models.quantization import quantization_of

    engine = Engine.load(args.model, threads=args.threads)  # answering's default scheme ("auto")
    report: dict[str, Any] = {"model": engine.name, "quantization": quantization_of(engine.model) or "none"}
    if "speed" in args.parts:
        report["speed"] = [bench_speed(engine, args.repeats, size) for size in args.context_tokens]
        print(json.dumps({"speed": report["speed"]}, indent=2), flush=True)
    if "validity" in args.parts:
        report["validity"] = bench_validity(engine, args.schemas, args.max_tokens)
        print(json.dumps({"validity": report["validity"]}, indent=2), flush=True)
    if "tools" in args.parts:
        report["tools"] = bench_tools(engine, args.max_tokens)
        print(json.dumps({"tools": report["tools"]}, indent=2), flush=True)


if __name__ == "__main__":
    main()
