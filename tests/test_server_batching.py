"""Cross-request batching in the server, on a tiny fp32 model (where a padded batch is exact)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from eval_run_helpers import tiny_chat_model  # noqa: E402
from server_helpers import running, sse_events  # noqa: E402

from rag_mspoe.connectors.server import create_app  # noqa: E402
from rag_mspoe.engine import Engine, GenerationCancelled  # noqa: E402
from rag_mspoe.engine.text_stream import End, StreamOutlet  # noqa: E402
from rag_mspoe.tools.tool_calls import generate_with_tools  # noqa: E402

QUESTIONS = ["What is 2 plus 3?", "Name a red fruit.", "Hello there, who are you?", "Count to three."]
OPERATE = {  # closed choices: a random model's numbers run on past any token budget
    "type": "function",
    "function": {
        "name": "operate",
        "parameters": {
            "type": "object",
            "properties": {"op": {"enum": ["plus", "minus", "times"]}, "unit": {"enum": ["m", "kg", "s"]}},
            "required": ["op", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def engine():
    return Engine(*tiny_chat_model(max_position_embeddings=256), method="none")


def ask_together(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies)))

    return asyncio.run(send())


def body(engine: Engine, question: str, **extra) -> dict:
    return {
        "model": engine.name,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,  # the API samples by default
        **extra,
    }


def alone(engine: Engine, question: str, max_tokens: int = 8) -> str:
    return engine.generate(question, max_new_tokens=max_tokens).text


def batching(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["batching"]


def test_requests_waiting_together_run_as_one_batch_with_the_answers_of_each_alone(engine):
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        replies = ask_together(url, [body(engine, q) for q in QUESTIONS])
        assert [r.status_code for r in replies] == [200] * 4
        answers = [r.json()["choices"][0]["message"]["content"] for r in replies]
        assert answers == [alone(engine, q) for q in QUESTIONS]
        usage = [r.json()["usage"]["prompt_tokens"] for r in replies]
        assert usage == [engine.count_tokens(q) for q in QUESTIONS]  # padding is not billed
        assert batching(url) == {"max_batch_size": 4, "batches": 1, "batched_requests": 4}


def test_batches_split_by_settings_and_size_and_skip_sampling(engine):
    with running(create_app(engine, max_batch_size=2, batch_wait_ms=300)) as url:
        bodies = [body(engine, q) for q in QUESTIONS[:3]]  # three alike: a batch of 2, then 1 alone
        bodies.append(body(engine, QUESTIONS[3], max_tokens=5))  # other settings: alone
        bodies.append(body(engine, QUESTIONS[0], temperature=0.8, seed=1))  # sampled: never batched
        replies = ask_together(url, bodies)
        assert [r.status_code for r in replies] == [200] * 5
        answers = [r.json()["choices"][0]["message"]["content"] for r in replies[:4]]
        assert answers == [*(alone(engine, q) for q in QUESTIONS[:3]), alone(engine, QUESTIONS[3], 5)]
        assert batching(url) == {"max_batch_size": 2, "batches": 1, "batched_requests": 2}


def test_a_failing_request_does_not_fail_the_others_in_its_batch(engine):
    too_long = "word " * 400  # over the tiny model's 256 positions
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        replies = ask_together(
            url, [body(engine, QUESTIONS[0]), body(engine, too_long), body(engine, QUESTIONS[1])]
        )
        assert [r.status_code for r in replies] == [200, 400, 200]
        assert replies[1].json()["error"]["code"] == "context_length_exceeded"
        assert replies[0].json()["choices"][0]["message"]["content"] == alone(engine, QUESTIONS[0])
        assert replies[2].json()["choices"][0]["message"]["content"] == alone(engine, QUESTIONS[1])


def test_batching_is_off_by_default(engine):
    with running(create_app(engine)) as url:
        replies = ask_together(url, [body(engine, q) for q in QUESTIONS[:2]])
        assert [r.status_code for r in replies] == [200, 200]
        assert batching(url)["batches"] == 0


def stream_together(url: str, bodies: list[dict]) -> list[tuple[int, list[dict]]]:
    """Status and events of streamed requests sent at once."""

    async def one(client: httpx.AsyncClient, request: dict) -> tuple[int, list[dict]]:
        response = await client.post("/v1/chat/completions", json={**request, "stream": True})
        return response.status_code, sse_events(response.text)

    async def send() -> list[tuple[int, list[dict]]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(one(client, b) for b in bodies)))

    return asyncio.run(send())


def streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def test_streamed_requests_waiting_together_run_as_one_batch_with_the_answers_of_each_alone(engine):
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        bodies = [body(engine, q, stream_options={"include_usage": True}) for q in QUESTIONS]
        replies = stream_together(url, bodies)
        assert [status for status, _ in replies] == [200] * 4
        assert [streamed_text(events) for _, events in replies] == [alone(engine, q) for q in QUESTIONS]
        for (_, events), question in zip(replies, QUESTIONS, strict=True):
            closing = [
                e["choices"][0] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]
            ]
            assert len(closing) == 1 and closing[0]["finish_reason"] == "length"
            assert events[-1]["usage"]["prompt_tokens"] == engine.count_tokens(question)
        assert batching(url) == {"max_batch_size": 4, "batches": 1, "batched_requests": 4}


def test_a_streamed_prompt_too_long_fails_alone_before_its_stream_starts(engine):
    too_long = "word " * 400
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        replies = stream_together(
            url, [body(engine, QUESTIONS[0]), body(engine, too_long), body(engine, QUESTIONS[1])]
        )
        assert [status for status, _ in replies] == [200, 400, 200]
        assert streamed_text(replies[0][1]) == alone(engine, QUESTIONS[0])
        assert streamed_text(replies[2][1]) == alone(engine, QUESTIONS[1])
        assert batching(url)["batches"] == 1


class Recorder:
    """An outlet's `put` that logs what arrives, in arrival order across outlets."""

    def __init__(self, log: list, row: int) -> None:
        self.log, self.row = log, row

    def __call__(self, item: object) -> None:
        self.log.append((self.row, item))


def run_streams(engine: Engine, prompts: list[str], cancels: list[threading.Event], **settings) -> list:
    log: list = []
    requests = [engine.prepare_stream(p, **settings) for p in prompts]
    outlets = [StreamOutlet(Recorder(log, row), cancel) for row, cancel in enumerate(cancels)]
    engine.run_streams(requests, outlets)
    return log


def stop_only_in(early: str, other: str) -> str:
    """A stop string that cuts `early` after its first characters and never occurs in `other`."""
    for start in range(1, 6):
        for size in (1, 2, 3):
            candidate = early[start : start + size]
            if candidate.strip() and candidate not in other and candidate not in early[:start]:
                return candidate
    pytest.skip("no stop string tells these two answers apart")


def test_a_stream_whose_answer_ends_closes_before_the_batch_ends(engine):
    early, late = QUESTIONS[0], QUESTIONS[2]
    stop = stop_only_in(alone(engine, early, 24), alone(engine, late, 24))
    log = run_streams(
        engine, [early, late], [threading.Event(), threading.Event()], max_new_tokens=24, stop=[stop]
    )
    ends = [index for index, (_, item) in enumerate(log) if isinstance(item, End)]
    assert [log[i][0] for i in ends] == [0, 1]  # the early row's End comes first ...
    assert any(row == 1 and isinstance(item, str) for row, item in log[ends[0] :])  # ... mid-stream
    for row, prompt in enumerate((early, late)):
        text = "".join(item for r, item in log if r == row and isinstance(item, str))
        result = next(item.result for r, item in log if r == row and isinstance(item, End))
        assert text == result.text == engine.generate(prompt, max_new_tokens=24, stop=[stop]).text
    assert log[ends[0]][1].result.finish_reason == "stop" and log[ends[1]][1].result.finish_reason == "length"


def test_a_reader_who_leaves_drops_out_of_the_batch_and_the_others_go_on(engine):
    gone = threading.Event()
    gone.set()
    log = run_streams(engine, QUESTIONS[:2], [threading.Event(), gone], max_new_tokens=8)
    assert "".join(item for row, item in log if row == 0 and isinstance(item, str)) == alone(
        engine, QUESTIONS[0]
    )
    assert [type(item) for row, item in log if row == 1] == [GenerationCancelled]
    everyone_gone = run_streams(engine, QUESTIONS[:2], [gone, gone], max_new_tokens=8)
    assert [type(item) for _, item in everyone_gone] == [GenerationCancelled] * 2


def test_run_streams_batches_equal_settings_only(engine):
    requests = [
        engine.prepare_stream(QUESTIONS[0], max_new_tokens=4),
        engine.prepare_stream(QUESTIONS[1], max_new_tokens=5),
    ]
    outlets = [StreamOutlet(lambda item: None, threading.Event()) for _ in requests]
    with pytest.raises(ValueError, match="equal settings"):
        engine.run_streams(requests, outlets)


@pytest.mark.parametrize("method", ["invariant-reorder", "pine", "attention-calibration"])
def test_streamed_batches_of_methods_that_read_documents_answer_each_prompt_as_alone(engine, method):
    from rag_mspoe.prompts.qa_prompt import render_qa_prompt

    documents = [
        ("France", "Paris is the capital of France."),
        ("Alps", "Mont Blanc is the highest mountain in the Alps."),
        ("Rivers", "The Loire is the longest river in France."),
    ]
    prompts = [
        render_qa_prompt("What is the capital of France?", documents)[0],
        render_qa_prompt("What is the longest river in France?", documents[::-1])[0],
    ]
    bodies = [
        {**body(engine, prompt), "model": f"{engine.name}+{method}", "max_tokens": 6} for prompt in prompts
    ]
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        replies = stream_together(url, bodies)
        assert batching(url)["batches"] == 1
    for (status, events), prompt in zip(replies, prompts, strict=True):
        messages = [{"role": "user", "content": prompt}]
        expected = engine.generate(messages, max_new_tokens=6, method=method)
        closing = [e["choices"][0] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert status == 200 and streamed_text(events) == expected.text
        # Every method that reads documents says which it read, in its order (PINE's: as given).
        read = [0, 1, 2] if expected.documents_read is None else list(expected.documents_read)
        assert closing[0].get("documents_read") == read
        assert (expected.documents_read is not None) == (method == "invariant-reorder")


def test_a_streamed_batch_refused_before_it_starts_fails_its_streams_and_the_queue_goes_on(
    engine, monkeypatch
):
    from rag_mspoe.connectors.batching import RequestBatcher

    real = engine.run_streams
    calls = []

    def refuse_first(requests, outlets):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("refused")
        real(requests, outlets)

    monkeypatch.setattr(engine, "run_streams", refuse_first)
    options = {"max_new_tokens": 4, "temperature": 0.0}

    async def read(batcher, question):
        try:
            return "".join([piece async for piece in batcher.stream(question, options)])
        except RuntimeError as exc:
            return exc

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=4, max_wait_s=0.2)
        # A queue that died with the refused batch would leave these waiting: fail, do not hang.
        first = await asyncio.wait_for(asyncio.gather(*(read(batcher, q) for q in QUESTIONS[:2])), 60)
        later = await asyncio.wait_for(read(batcher, QUESTIONS[2]), 60)
        return first, later

    first, later = asyncio.run(scenario())
    assert [str(e) for e in first] == ["refused", "refused"] and calls[0] == 2
    assert later == alone(engine, QUESTIONS[2], 4)


def test_streamed_batches_on_the_qwen_tokenizer_answer_each_prompt_as_alone(qwen_tokenizer):
    from tiny_models import tiny_model

    model = tiny_model("qwen2", seed=3, vocab_size=len(qwen_tokenizer), max_position_embeddings=512)
    model._rag_mspoe_name = "tiny-qwen2"
    qwen = Engine(model, qwen_tokenizer, method="none")
    # Text that spells the tokenizer's special tokens, and prompts of other lengths (left padding).
    prompts = [
        "Say <|im_start|>system hello",
        "What does <tool_call>{}</tool_call> mean in a long question about tools and calls?",
        "Hi",
    ]
    log = run_streams(qwen, prompts, [threading.Event() for _ in prompts], max_new_tokens=12)
    for row, prompt in enumerate(prompts):
        text = "".join(item for r, item in log if r == row and isinstance(item, str))
        result = next(item.result for r, item in log if r == row and isinstance(item, End))
        alone_answer = qwen.generate(prompt, max_new_tokens=12)
        assert text == result.text == alone_answer.text and result.completion_tokens == 12
        assert result.prompt_tokens == alone_answer.prompt_tokens


def tool_body(engine: Engine, question: str, **extra) -> dict:
    return body(engine, question, tools=[OPERATE], tool_choice="required", max_tokens=48, **extra)


def calls_alone(engine: Engine, question: str) -> list[tuple[str, str]]:
    answer = generate_with_tools(
        engine, [{"role": "user", "content": question}], [OPERATE], tool_choice="required", max_new_tokens=48
    )
    return [(c.openai()["function"]["name"], c.openai()["function"]["arguments"]) for c in answer.tool_calls]


def test_tool_requests_offering_the_same_tools_batch_with_the_calls_of_each_alone(engine):
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        replies = ask_together(
            url, [*(tool_body(engine, q) for q in QUESTIONS[:3]), body(engine, QUESTIONS[3])]
        )
        assert [r.status_code for r in replies] == [200] * 4
        calls = [
            [
                (c["function"]["name"], c["function"]["arguments"])
                for c in r.json()["choices"][0]["message"]["tool_calls"]
            ]
            for r in replies[:3]
        ]
        assert calls == [calls_alone(engine, q) for q in QUESTIONS[:3]]
        assert all(calls) and {r.json()["choices"][0]["finish_reason"] for r in replies[:3]} == {"tool_calls"}
        assert batching(url) == {"max_batch_size": 4, "batches": 1, "batched_requests": 3}


def test_streamed_tool_requests_batch_and_assemble_to_the_calls_of_each_alone(engine):
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        replies = stream_together(url, [tool_body(engine, q) for q in QUESTIONS[:2]])
        assert [status for status, _ in replies] == [200] * 2
        for (_, events), question in zip(replies, QUESTIONS[:2], strict=True):
            streamed: dict[int, list[str]] = {}
            for event in events:
                for call in (event.get("choices") or [{}])[0].get("delta", {}).get("tool_calls") or []:
                    name, arguments = streamed.setdefault(call["index"], ["", ""])
                    streamed[call["index"]] = [
                        call["function"].get("name") or name,
                        arguments + call["function"]["arguments"],
                    ]
            assert [tuple(streamed[i]) for i in sorted(streamed)] == calls_alone(engine, question)
        assert batching(url) == {"max_batch_size": 4, "batches": 1, "batched_requests": 2}


def test_the_prompts_of_one_completions_request_run_as_one_batch(engine):
    with running(create_app(engine, max_batch_size=4, batch_wait_ms=300)) as url:
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": engine.name, "prompt": QUESTIONS[:3], "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200
        texts = [choice["text"] for choice in reply.json()["choices"]]
        assert texts == [engine.generate(q, raw=True, max_new_tokens=8).text for q in QUESTIONS[:3]]
        assert batching(url) == {"max_batch_size": 4, "batches": 1, "batched_requests": 3}
