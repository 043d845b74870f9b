"""Cross-request batching in the server, on a tiny fp32 model (where a padded batch is exact)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from eval_run_helpers import tiny_chat_model  # noqa: E402
from server_helpers import running  # noqa: E402

from rag_mspoe.connectors.server import create_app  # noqa: E402
from rag_mspoe.engine import Engine  # noqa: E402

QUESTIONS = ["What is 2 plus 3?", "Name a red fruit.", "Hello there, who are you?", "Count to three."]


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
