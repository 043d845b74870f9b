"""Each model family's own call format: the grammar accepts, token for token, the calls its chat
template writes, and the calls read back. On the real Qwen2.5 tokenizer (whose <tool_call> tags
are added tokens 151657/151658) and on templates in the Llama 3.1, Mistral, Qwen3 and Gemma 3
shapes built here on the SmolLM2 tokenizer."""

from __future__ import annotations

import copy
import json

import jsonschema
import llguidance
import pytest
from test_tool_calls import TOOLS, schema_of
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.models import embedded_models
from rag_mspoe.models.loading import ModelLoadError
from rag_mspoe.tools.grammar import grammar_tokenizer
from rag_mspoe.tools.tool_calls import generate_with_tools, stream_with_tools
from rag_mspoe.tools.tool_format import format_for, parse_calls
from rag_mspoe.tools.tool_grammar import call_grammar
from rag_mspoe.tools.tool_stream import CallSplitter, ToolCallDelta

NAMES = [tool["function"]["name"] for tool in TOOLS]
CALLS = [("add", {"a": 7, "b": 5}), ("lookup", {"query": "ferry", "k": 3})]
LOGITS_MARGIN = 271  # Qwen2.5's logits are this much wider than its vocabulary


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    try:
        folder = embedded_models.prepare("qwen2.5-coder-0.5b-instruct")
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(folder)


# Templates in the shapes of the families' own (their tool sections reduced to what matters here).
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'user' and tools %}Given the following functions, respond with a JSON for a "
    'function call with its proper arguments. Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}. Do not use variables.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}"
    "{% endfor %}{% elif m.role == 'tool' %}<|python_tag|>{{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
)
QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools>\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA3_TEMPLATE = (  # no tool section: the tools are folded into the conversation as text
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def with_template(tokenizer, template: str, added: tuple[str, ...] = (), special: tuple[str, ...] = ()):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    if added:
        tokenizer.add_tokens(list(added))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def assistant_text(tokenizer, calls: list, end: str) -> str:
    """What the chat template writes for an assistant turn with `calls`, up to its end marker."""
    asked = [{"role": "user", "content": "Help."}]
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls
        ],
    }
    prefix = tokenizer.apply_chat_template(asked, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template([*asked, turn], tools=TOOLS, tokenize=False)
    assert whole.startswith(prefix), "the template's generation prompt opens the assistant turn"
    return whole[len(prefix) : whole.index(end, len(prefix))]


def accepts(tokenizer, text: str, mode: str = "required", parallel: bool = True) -> list[int]:
    """The token ids of `text`, checked to be a complete answer under the tool-call grammar."""
    grammar = call_grammar(tokenizer, format_for(tokenizer), TOOLS, mode, parallel)  # type: ignore[arg-type]
    vocab = len(tokenizer) + LOGITS_MARGIN
    matcher = llguidance.LLMatcher(
        grammar_tokenizer(tokenizer, vocab, [tokenizer.eos_token_id]), grammar.compiled()
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for token in ids:
        assert matcher.consume_token(token), f"refused {tokenizer.decode([token])!r}: {matcher.get_error()}"
    assert matcher.is_accepting(), f"{text!r} is not a complete answer"
    return ids


def decoded(tokenizer, ids: list[int]) -> str:
    """The answer as the engine decodes it (special tokens dropped)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_qwen_calls_are_its_tool_call_tokens_held_to_the_schema(qwen_tokenizer):
    assert format_for(qwen_tokenizer).name == "hermes"
    text = assistant_text(qwen_tokenizer, CALLS, "<|im_end|>")
    ids = accepts(qwen_tokenizer, text)
    assert ids.count(151657) == 2 and ids.count(151658) == 2  # the tags as the model's own tokens
    assert parse_calls(decoded(qwen_tokenizer, ids), NAMES) == ("", CALLS)
    accepts(qwen_tokenizer, text + "\n")  # a line break after the last call, then the end of turn
    # One call only, when calls may not be parallel; and never a call of a schema-breaking shape.
    with pytest.raises(AssertionError):
        accepts(qwen_tokenizer, text, parallel=False)
    with pytest.raises(AssertionError, match="refused"):
        accepts(qwen_tokenizer, text.replace('"k": 3', '"k": 4'))
    with pytest.raises(AssertionError, match="refused"):
        accepts(qwen_tokenizer, "<tool_call>\nI'm sorry, but I can't assist with that.")


@pytest.mark.parametrize(
    "answer",
    [
        '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 5}}',  # stopped before the closing tag
        '{"name": "add", "arguments": {"a": 7, "b": 5}}',  # bare, as the 0.5B writes it under "auto"
        '```json\n{"name": "add", "arguments": {"a": 7, "b": 5}}\n```',  # fenced
    ],
)
def test_the_calls_qwen_writes_when_left_free_are_read(qwen_tokenizer, answer):
    assert parse_calls(answer, NAMES) == ("", [CALLS[0]])
    if not answer.startswith("<tool_call>"):
        accepts(qwen_tokenizer, answer, mode="auto")  # and the "auto" grammar holds them to the schema
    assert parse_calls('{"name": "Bob", "age": 3}', NAMES) == ('{"name": "Bob", "age": 3}', [])


def test_auto_lets_qwen_answer_in_text_but_not_half_a_call(qwen_tokenizer):
    accepts(qwen_tokenizer, "Paris is sunny today.", mode="auto")
    with pytest.raises(AssertionError, match="refused"):
        accepts(qwen_tokenizer, '{"name": "weather", "arguments": {}}', mode="auto")


@pytest.mark.parametrize(
    "answer",
    [
        'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": "seven"}}\n</tool_call>',
        ' [TOOL_CALLS] [{"name": "add", "arguments": {"a": "seven"}}]',
        '<|python_tag|>{"name": "add", "arguments": {"a": "seven"}}',
    ],
)
def test_auto_text_never_spells_out_what_parse_calls_reads_as_a_call(embedded, answer):
    tokenizer = embedded[1]  # no added marker tokens: each marker is spelled out in text
    assert parse_calls(answer, NAMES)[1]  # read as a call...
    with pytest.raises(AssertionError, match="refused"):
        accepts(tokenizer, answer, mode="auto")  # ...so the text answer may not write it
    accepts(tokenizer, "Tags such as <tool> and [TOOL] are fine in text.", mode="auto")


def test_a_model_on_the_qwen_tokenizer_always_calls_under_required(qwen_tokenizer):
    model = tiny_model("qwen2", vocab_size=len(qwen_tokenizer) + LOGITS_MARGIN, max_position_embeddings=2048)
    engine = Engine(model, qwen_tokenizer, name="tiny-qwen")
    settings = dict(tool_choice="required", max_new_tokens=120, temperature=1.0, seed=0)
    answer = generate_with_tools(engine, "Add 7 and 5.", TOOLS, **settings)
    assert answer.result.text.startswith("<tool_call>\n{") and answer.tool_calls
    for call in answer.tool_calls:
        jsonschema.validate(call.arguments, schema_of(call.name))
    stream = stream_with_tools(engine, "Add 7 and 5.", TOOLS, **settings)
    list(stream)
    assert stream.answer is not None
    assert [(c.name, c.arguments) for c in stream.answer.tool_calls] == [
        (c.name, c.arguments) for c in answer.tool_calls
    ]


def test_llama3_calls_are_bare_json_with_parameters(embedded):
    tokenizer = with_template(embedded[1], LLAMA3_TEMPLATE)
    fmt = format_for(tokenizer)
    assert (fmt.name, fmt.arguments_key) == ("llama3", "parameters")
    text = assistant_text(tokenizer, CALLS[:1], "<|im_end|>")
    assert text == '{"name": "add", "parameters": {"a": 7, "b": 5}}'
    assert parse_calls(decoded(tokenizer, accepts(tokenizer, text)), NAMES) == ("", CALLS[:1])
    accepts(tokenizer, f"```json\n{text}\n```", mode="auto")


def test_mistral_calls_are_a_list_after_its_special_token(embedded):
    tokenizer = with_template(embedded[1], MISTRAL_TEMPLATE, special=("[TOOL_CALLS]",))
    assert format_for(tokenizer).name == "mistral"
    text = assistant_text(tokenizer, CALLS, "<|im_end|>")
    ids = accepts(tokenizer, text)
    assert ids[0] == tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    answer = decoded(tokenizer, ids)  # the marker is a special token: decoding drops it
    assert answer.startswith(" [{") and parse_calls(answer, NAMES) == ("", CALLS)
    with pytest.raises(AssertionError):
        accepts(tokenizer, text, parallel=False)


def test_qwen3_may_think_before_it_calls(qwen_tokenizer):
    tokenizer = with_template(qwen_tokenizer, QWEN3_TEMPLATE, added=("<think>", "</think>"))
    assert format_for(tokenizer).thinks
    text = assistant_text(tokenizer, CALLS[:1], "<|im_end|>")
    assert text.startswith("<think>\n\n</think>\n\n<tool_call>")
    thought = text.replace("<think>\n", "<think>\nThe user wants a sum.", 1)
    for answer in (text, thought, text[text.index("<tool_call>") :]):
        ids = accepts(tokenizer, answer)
        content, calls = parse_calls(decoded(tokenizer, ids), NAMES)
        assert calls == CALLS[:1] and content == answer[: answer.index("<tool_call>")].strip()
    bare = thought.replace("<tool_call>\n", "").replace("\n</tool_call>", "")
    assert parse_calls(bare, NAMES) == ("<think>\nThe user wants a sum.\n</think>", CALLS[:1])


def test_gemma3_without_a_tool_section_gets_the_calls_as_text(embedded):
    tokenizer = with_template(embedded[1], GEMMA3_TEMPLATE)
    assert format_for(tokenizer).name == "hermes"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Help."}], add_generation_prompt=True, tokenize=False
    )
    assert "<tool_call>" not in prompt  # the template itself shows no tools...
    from rag_mspoe.prompts.chat_template import render_text

    assert '"name": "lookup"' in render_text(tokenizer, "Help.", tools=TOOLS)  # ...so they are folded in
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 5}}\n</tool_call>'
    assert parse_calls(decoded(tokenizer, accepts(tokenizer, text)), NAMES) == ("", CALLS[:1])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "arguments": {"a": 7, "b": 5}}',
        '```json\n[{"name": "add", "arguments": {"a": 7, "b": 5}}]\n```',
        '<think>\nsum\n</think>\n\n{"name": "add", "parameters": {"a": 7, "b": 5}}',
        '{"name": "Bob", "age": 3}',
        "```python\nprint(1)\n```",
        "{ not json",
        "<think>\nhm\n</think>\n\nJust text.",
    ],
)
def test_bare_calls_stream_as_they_parse(text):
    expected = parse_calls(text, NAMES)
    for size in (1, 4, len(text)):
        splitter = CallSplitter(NAMES)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        events = [e for piece in pieces for e in splitter.feed(piece)] + splitter.finish()
        calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)]
        streamed = "".join(e for e in events if isinstance(e, str))
        assert (streamed, [(n, json.loads(a)) for n, a in calls]) == expected
