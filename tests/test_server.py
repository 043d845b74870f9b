"""The OpenAI-compatible server, started for real on a loopback port, used through real clients."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_helpers import running, sse_events  # noqa: E402

from rag_mspoe.connectors.server import create_app  # noqa: E402
from rag_mspoe.engine import Engine  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HI = b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def engine(embedded):
    model, tokenizer = embedded
    return Engine(model, tokenizer, method="none")


@pytest.fixture(scope="module")
def base_url(engine):
    with running(create_app(engine, max_tokens_limit=64, max_request_bytes=4096)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_chat_completion_answers_with_usage(client, engine):
    reply = client.chat.completions.create(model=engine.name, messages=QUESTION, max_tokens=16, temperature=0)
    assert "paris" in reply.choices[0].message.content.lower()
    assert reply.usage.prompt_tokens == engine.count_tokens(QUESTION)
    assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length")


def test_model_name_selects_the_method_per_request(client, engine):
    for method in ("mspoe", "layerwise", "none"):
        reply = client.chat.completions.create(
            model=f"{engine.name}+{method}", messages=QUESTION, max_tokens=12, temperature=0
        )
        expected = engine.generate(QUESTION, max_new_tokens=12, method=method)
        assert reply.model == f"{engine.name}+{method}"
        assert reply.choices[0].message.content == expected.text
    assert engine.method is None  # requests never change the default


DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps."),
]


@pytest.mark.parametrize("name", ["pine", "attention-calibration"])
def test_methods_that_read_documents_find_them_in_requests(base_url, client, engine, name):
    from rag_mspoe.prompts.qa_prompt import render_qa_prompt

    text, spans = render_qa_prompt("What is the capital of France?", DOCUMENTS)
    model = f"{engine.name}+{name}"
    assert model in [m.id for m in client.models.list()]
    by_lines = [{"role": "user", "content": text}]
    reply = client.chat.completions.create(model=model, messages=by_lines, max_tokens=12, temperature=0)
    expected = engine.generate(by_lines, max_new_tokens=12, method=name).text
    assert reply.choices[0].message.content == expected
    # Spans sent with the message (an extension of the message object) say the same.
    explicit = [{"role": "user", "content": text, "document_spans": spans}]
    body = {"model": model, "messages": explicit, "max_tokens": 12, "temperature": 0}
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["message"]["content"] == expected
    # A chat without documents is answered, as the unmodified model answers it, and says so.
    plain = [{"role": "user", "content": "Paris is in France. Where is Paris?"}]
    body["messages"] = plain
    answered = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert answered["choices"][0]["message"]["content"] == engine.generate(plain, max_new_tokens=12).text
    assert answered["choices"][0]["documents_read"] == []


def test_a_reordering_method_says_which_given_document_each_one_read_was(base_url, engine):
    from rag_mspoe.prompts.qa_prompt import render_qa_prompt

    messages = [{"role": "user", "content": render_qa_prompt("What is the capital of France?", DOCUMENTS)[0]}]
    expected = engine.generate(messages, max_new_tokens=4, method="invariant-reorder").documents_read
    assert sorted(expected) == [0, 1, 2]
    text = messages[0]["content"]
    read_raw = engine.generate(text, raw=True, max_new_tokens=4, method="invariant-reorder").documents_read
    for suffix, read, read_text in (
        ("+invariant-reorder", list(expected), list(read_raw)),
        ("+mspoe", None, None),
    ):
        body = {"model": engine.name + suffix, "messages": messages, "max_tokens": 4, "temperature": 0}
        choice = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert choice.get("documents_read") == read
        # Streamed, the chunk that closes the answer carries it, for chat and for text completions.
        text_body = {"model": body["model"], "prompt": text, "max_tokens": 4, "temperature": 0}
        for path, request, wanted in (
            ("chat/completions", body, read),
            ("completions", text_body, read_text),
        ):
            events = _stream_events(f"{base_url}/v1/{path}", {**request, "stream": True})
            closing = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"] is not None]
            assert len(closing) == 1 and closing[0].get("documents_read") == wanted
            assert sum("documents_read" in e["choices"][0] for e in events) == (wanted is not None)


def _stream_events(url, body):
    response = httpx.post(url, json=body, timeout=60)
    response.raise_for_status()
    return sse_events(response.text)


def test_streaming_equals_non_streaming(client, engine):
    kwargs = dict(model=f"{engine.name}+mspoe", messages=QUESTION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0


def test_text_completion_honours_stop_strings(client, engine):
    prompt = "Count: one, two, three, four, five,"
    free = client.completions.create(model=engine.name, prompt=prompt, max_tokens=12, temperature=0)
    first_word = free.choices[0].text.strip().split(",")[0]
    assert first_word, free.choices[0].text
    stopped = client.completions.create(
        model=engine.name, prompt=prompt, max_tokens=12, temperature=0, stop=[","]
    )
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=engine.name, prompt=prompt, max_tokens=12, temperature=0, stop=[","], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text


def test_concurrent_async_requests_equal_sequential_ones(base_url, engine):
    questions = [f"What is {a} plus {b}?" for a, b in [(2, 3), (10, 5), (7, 1), (4, 4)]]
    kwargs = dict(model=f"{engine.name}+mspoe", max_tokens=10, temperature=0)
    sync_client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    sequential = [
        sync_client.chat.completions.create(messages=[{"role": "user", "content": q}], **kwargs)
        .choices[0]
        .message.content
        for q in questions
    ]

    async def together():
        async_client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        replies = await asyncio.gather(
            *(
                async_client.chat.completions.create(messages=[{"role": "user", "content": q}], **kwargs)
                for q in questions
            )
        )
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(together()) == sequential


def test_models_and_health(client, base_url, engine):
    names = [m.id for m in client.models.list()]
    assert names[0] == engine.name and f"{engine.name}+mspoe" in names and f"{engine.name}+none" in names
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b"{not json", 400, None),
        (b'{"model": "m"}', 400, None),  # no messages
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found"),
        (
            HI + b', "max_tokens": 65}',
            400,
            None,
        ),
        (
            HI + b', "n": 2}',
            400,
            None,
        ),
        (b'{"model": "smollm2-135m-instruct", "messages": [{"role": "wizard", "content": "hi"}]}', 400, None),
        (
            b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "'
            + b"x" * 5000
            + b'"}]}',
            413,
            "request_too_large",
        ),
    ],
)
def test_malformed_requests_get_4xx_in_openai_shape(base_url, body, status, code):
    response = httpx.post(
        f"{base_url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code


def test_prompt_over_the_context_window_is_a_400(engine):
    app = create_app(engine, max_tokens_limit=64, max_request_bytes=1 << 20)
    with running(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="context window"):
            client.chat.completions.create(
                model=engine.name, messages=[{"role": "user", "content": "word " * 9000}], max_tokens=8
            )


def test_api_key_is_checked_when_set(engine):
    with running(create_app(engine, api_key="secret")) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
        assert good.models.list().data


def test_langchain_chat_openai_against_the_server(base_url, engine):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        base_url=f"{base_url}/v1",
        api_key="x",
        model=f"{engine.name}+mspoe",
        temperature=0,
        max_tokens=16,
        max_retries=0,
    )
    assert "paris" in chat.invoke("What is the capital of France?").content.lower()


# Token log-probabilities, in the OpenAI shapes.


def test_chat_logprobs_match_the_engine_and_spell_the_content(client, engine):
    response = client.chat.completions.create(
        model=engine.name, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    # Every generated token, the end of turn included (as its text, as other servers give it).
    assert len(content) == response.usage.completion_tokens
    assert "".join(t.token for t in content) in (
        choice.message.content,
        choice.message.content + "<|im_end|>",
    )
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    assert bytes(b for t in content for b in t.bytes).decode().startswith(choice.message.content)
    direct = engine.generate(QUESTION, max_new_tokens=12, logprobs=2).logprobs
    assert [t.logprob for t in content] == pytest.approx([t.logprob for t in direct], abs=1e-4)


def test_streamed_chat_logprobs_add_up_to_the_whole_answers(client, engine):
    kwargs = dict(model=engine.name, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [
        (t.token, round(t.logprob, 4)) for t in whole
    ]
    assert all(not t.top_logprobs for t in streamed)  # none asked for


def test_chat_without_logprobs_gets_none(client, engine):
    choice = client.chat.completions.create(model=engine.name, messages=QUESTION, max_tokens=4).choices[0]
    assert choice.logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client, engine):
    prompt = "Count: one, two, three,"
    choice = client.completions.create(
        model=engine.name, prompt=prompt, max_tokens=10, temperature=0, logprobs=3, stop=["five"]
    ).choices[0]
    logprobs = choice.logprobs
    # The token that began the stop string wrote part of the text: it is there, the text cut in it.
    assert "".join(logprobs.tokens).startswith(choice.text) and "five" not in choice.text
    assert logprobs.text_offset[-1] < len(choice.text)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert all(len(top) <= 3 and max(top.values()) <= 0 for top in logprobs.top_logprobs)
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=engine.name,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            logprobs=3,
            stop=["five"],
            stream=True,
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert [t for part in streamed for t in part.tokens] == logprobs.tokens
    assert [o for part in streamed for o in part.text_offset] == logprobs.text_offset


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "tools": [WEATHER_TOOL]}, "logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ],
)
def test_requests_that_cannot_have_logprobs_get_a_400_naming_why(base_url, engine, path, extra, param):
    body = {"model": engine.name, "max_tokens": 4, **extra}
    body.update({"messages": QUESTION} if "chat" in path else {"prompt": "Hello"})
    response = httpx.post(f"{base_url}{path}", json=body)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"] + str(response.json()["error"]["param"])


def test_echo_with_logprobs_scores_the_prompt_as_a_harness_asks(client, engine):
    """lm-evaluation-harness's local-completions scores a continuation this way: echo, logprobs
    and one new token, then the token log-probabilities after the context's tokens."""
    context, continuation = "The capital of France is", " Paris"
    choice = client.completions.create(
        model=engine.name, prompt=context + continuation, echo=True, logprobs=1, max_tokens=1, temperature=0
    ).choices[0]
    logprobs = choice.logprobs
    prompt_ids = engine.tokenizer.encode(context + continuation)
    context_length = len(engine.tokenizer.encode(context))
    assert len(logprobs.tokens) == len(prompt_ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    scored = sum(logprobs.token_logprobs[context_length:-1])
    expected = engine.loglikelihood(context, [continuation], raw=True)[0]
    assert scored == pytest.approx(expected, abs=1e-3)
    assert choice.text.startswith(context + continuation)
    assert logprobs.text_offset[len(prompt_ids)] == len(context + continuation)  # the new token's
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=engine.name,
            prompt=context + continuation,
            echo=True,
            logprobs=1,
            max_tokens=1,
            temperature=0,
            stream=True,
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert [t for part in streamed for t in part.tokens] == logprobs.tokens
    assert [o for part in streamed for o in part.text_offset] == logprobs.text_offset


def test_a_completions_request_with_several_prompts_answers_each_as_alone(client, engine):
    prompts = ["Count: one, two, three,", "The capital of France is", "Colours: red, green,"]
    alone = [
        client.completions.create(model=engine.name, prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in prompts
    ]
    together = client.completions.create(model=engine.name, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == alone
    assert together.usage.prompt_tokens == sum(engine.count_tokens(p, raw=True) for p in prompts)
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = []
    for chunk in client.completions.create(
        model=engine.name, prompt=prompts, max_tokens=6, temperature=0, stream=True, echo=True, logprobs=0
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
    assert [streamed[i] for i in range(3)] == [p + a for p, a in zip(prompts, alone, strict=True)]
    assert sorted(finished) == [0, 1, 2]


def test_a_streamed_request_with_one_prompt_too_long_is_a_400_and_the_server_goes_on(engine):
    app = create_app(engine, max_tokens_limit=64, max_request_bytes=1 << 20)
    with running(app) as url:
        body = {
            "model": engine.name,
            "prompt": ["Count: one,", "word " * 9000],
            "max_tokens": 4,
            "stream": True,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400 and "context window" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_too_many_prompts_in_one_request_is_a_400(base_url, engine):
    response = httpx.post(f"{base_url}/v1/completions", json={"model": engine.name, "prompt": ["hi"] * 33})
    assert response.status_code == 400 and "1 to 32 prompts" in response.json()["error"]["message"]
