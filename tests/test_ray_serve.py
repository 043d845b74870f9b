"""The server on Ray Serve: two replicas of the embedded model on a small local Ray cluster, reached
through the `openai` client, answering as the single-process server does; a killed replica."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the [serve-ray] extra")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
SETTINGS = {"method": "mspoe", "engine": {"dtype": "float32", "threads": 1}}
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What do bees make?",
    "How many legs has a spider?",
    "What is 2 + 2?",
    "Which ocean is the largest?",
]


@pytest.fixture(scope="module")
def ray_server():
    """Two replicas on a local Ray with two CPUs, Serve's proxy on a free loopback port."""
    import ray
    from ray import serve
    from server_helpers import free_port

    from rag_mspoe.connectors.ray_serve import APP_NAME, NAMESPACE, ReplicaSettings, deployment, shutdown

    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # At most two requests in progress per replica, so a burst of six must reach both: the router
    # otherwise may keep a loaded machine's burst on one replica with room to spare.
    application = deployment(ReplicaSettings(**SETTINGS), replicas=2, max_ongoing_requests=2)
    serve.run(application, name=APP_NAME, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single_process_answers():
    """The single-process server's greedy answers to QUESTIONS, in fp32."""
    from server_helpers import running

    from rag_mspoe.connectors.server import create_app
    from rag_mspoe.engine import Engine

    engine = Engine.load(method=SETTINGS["method"], **SETTINGS["engine"])
    with running(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        return [ask(client, question).choices[0].message.content for question in QUESTIONS]


def ask(client, question, **options):
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, **options
    )


async def asked(client, question, stream):
    """(answer, replica that gave it), streamed or not, through the openai client."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=24,
        temperature=0,
        stream=stream,
    )
    replica = raw.headers["x-rag-mspoe-replica"]
    answer = raw.parse()
    if not stream:
        return answer.choices[0].message.content, replica
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in answer if chunk.choices])
    return text, replica


@pytest.mark.slow
def test_two_replicas_answer_concurrent_requests_as_the_single_process_server(
    ray_server, single_process_answers
):
    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{ray_server}/v1", api_key="unused") as client:
            return await asyncio.gather(
                *(asked(client, question, stream=i % 2 == 0) for i, question in enumerate(QUESTIONS))
            )

    started = time.perf_counter()
    answers = asyncio.run(burst())
    print(f"burst of {len(QUESTIONS)} over two replicas: {time.perf_counter() - started:.1f} s")
    assert [text for text, _ in answers] == single_process_answers
    assert len({replica for _, replica in answers}) == 2  # Ray Serve's router used both
    health = httpx.get(f"{ray_server}/health").json()
    assert health["model"] == MODEL and health["method"] == "mspoe"
    assert {r["replica"] for r in health["replicas"]} == {replica for _, replica in answers}
    assert {r["status"] for r in health["replicas"]} == {"ok"}


@pytest.mark.slow
def test_the_servers_limits_hold_behind_the_ingress(ray_server):
    refused = httpx.post(f"{ray_server}/v1/completions", headers={"Host": "evil.example"}, json={})
    assert refused.status_code == 403 and "Host" in refused.json()["error"]["message"]
    too_big = httpx.post(f"{ray_server}/v1/completions", content=b"x" * ((1 << 20) + 1))
    assert too_big.status_code == 413 and too_big.json()["error"]["type"]
    body = {"model": "other", "messages": [{"role": "user", "content": "Hi"}]}
    wrong = httpx.post(f"{ray_server}/v1/chat/completions", json=body)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


@pytest.mark.slow
def test_an_abandoned_stream_stops_its_replicas_generation(ray_server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
        "max_tokens": 1000,  # a minute or more of writing on this machine
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{ray_server}/v1/chat/completions", json=body, timeout=60) as response:
        left = response.headers["x-rag-mspoe-replica"]
        for n, _ in enumerate(response.iter_lines()):
            if n == 4:
                break  # leaves mid-stream: the connection closes
    # The replica it left is free at once: it answers short requests as quickly as the other one.
    answered, started = [], time.perf_counter()
    client = openai.OpenAI(base_url=f"{ray_server}/v1", api_key="unused", max_retries=0, timeout=60)
    while left not in answered:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        answered.append(raw.headers["x-rag-mspoe-replica"])
        assert len(answered) < 16, "the router never chose the replica the stream left"
    # Had the generation gone on, the request that reached that replica would have waited for
    # the rest of the 1000 tokens behind the engine's lock.
    assert time.perf_counter() - started < 10 + 2 * len(answered)


@pytest.mark.slow
def test_a_killed_replicas_request_fails_cleanly_and_the_others_are_served(ray_server):
    client = openai.OpenAI(base_url=f"{ray_server}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    doomed = raw.headers["x-rag-mspoe-replica"]
    replicas = httpx.get(f"{ray_server}/health").json()["replicas"]
    pid = next(r["pid"] for r in replicas if r["replica"] == doomed)
    stream = iter(raw.parse())
    next(stream)  # the answer has started on that replica
    os.kill(pid, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    served = {ask(client, question).choices[0].message.content for question in QUESTIONS[:3]}
    assert all(served)
