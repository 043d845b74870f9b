"""The server fuzzed: request bodies drawn from its own OpenAPI schema (schemathesis) against a real
`rag-mspoe serve` process on loopback, and chat messages with sampling settings drawn by hypothesis
against the app. No request gets a 5xx or a stream that ends in a server error, every refusal has
the OpenAI error shape, and the server answers as before afterwards. RAG_MSPOE_FUZZ_EXAMPLES raises
the number of draws per operation (benchmarks/fuzz.py runs them for as long as it is given)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from eval_run_helpers import save_tiny_chat_model, tiny_chat_model  # noqa: E402
from fuzz_settings import fuzzed  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_helpers import serve_process  # noqa: E402

MAX_TOKENS = 8  # the server's limit: answers stay short, so draws go to the requests


def check_answer(status: int, content_type: str, text: str) -> None:
    """No 5xx; a refusal in the OpenAI error shape; a stream without a server error in it."""
    assert status < 500, text[:2000]
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert "Traceback" not in error["message"]
    elif content_type.startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        errors = [event["error"] for event in events if "error" in event]
        assert all(error["type"] != "server_error" for error in errors), errors


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzzed-server")
    model = save_tiny_chat_model(folder / "model", max_position_embeddings=4096)
    # Ms-PoE as the default route: requests naming only the model run a rescaled model.
    options = [
        "--model",
        str(model),
        "--method",
        "mspoe",
        "--threads",
        "1",
        "--max-tokens-limit",
        str(MAX_TOKENS),
    ]
    with serve_process(folder / "server.log", *options) as url:
        yield url, folder / "server.log"


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server[0]}/openapi.json")


# Valid bodies (positive) and bodies that break the schema in one place (negative). Drawn with
# hypothesis from the operation's strategy: schemathesis's own pytest plugin does not run on
# pytest 9.
@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [
        ("GET", "/health", "positive"),
        ("GET", "/v1/models", "positive"),
        *(
            (method, path, mode)
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"))
            for mode in ("positive", "negative")
        ),
    ],
)
def test_no_request_the_schema_allows_or_breaks_gets_a_server_error(server, api_schema, method, path, mode):
    strategy = api_schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    served = httpx.get(f"{server[0]}/v1/models").json()["data"][0]["id"]

    @fuzzed
    @given(strategy, st.booleans())
    def answered(case: Any, known_model: bool) -> None:
        if known_model and isinstance(case.body, dict):  # past the 404 for a model it does not serve
            case.body["model"] = served
        response = case.call(timeout=120)
        check_answer(response.status_code, response.headers.get("content-type", [""])[0], response.text)

    answered()


def test_the_server_answers_after_the_fuzzing_and_logged_no_crash(server):
    url, log = server
    assert httpx.get(f"{url}/health").status_code == 200
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert "Unexpected error" not in log.read_text()  # what a 500 logs


# Chat messages and sampling settings, in-process: text of any code point (special tokens' texts
# included), every role, tool calls with any arguments, tiny and extreme sampling settings.
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
    st.sampled_from(["<|im_start|>system", "<tool_call>", "</tool_call>", "<|endoftext|>", "Document [1]"]),
)
CALLS = st.lists(
    st.fixed_dictionaries(
        {
            "id": TEXT,
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": TEXT, "arguments": TEXT}),
        }
    ),
    max_size=2,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
        "content": TEXT | st.none(),
    },
    optional={"name": TEXT, "tool_calls": CALLS, "tool_call_id": TEXT},
)
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2) | st.sampled_from([5e-324, 1e-45, 1e-38, 1e-6]),
        "top_p": st.floats(0, 1, exclude_min=True) | st.sampled_from([5e-324, 1e-45]),
        "seed": st.integers(0, (1 << 63) - 1),
        "max_tokens": st.integers(1, MAX_TOKENS),
        "stop": st.lists(TEXT.filter(bool), min_size=1, max_size=4),
        "logprobs": st.booleans(),
        "stream": st.booleans(),
    },
)


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from rag_mspoe.connectors.server import create_app
    from rag_mspoe.engine import Engine

    engine = Engine(*tiny_chat_model(max_position_embeddings=4096), method="none")
    app = create_app(engine, max_tokens_limit=MAX_TOKENS)
    return TestClient(app, base_url="http://localhost", raise_server_exceptions=False)


@fuzzed
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), sampling=SAMPLING)
def test_any_chat_with_any_sampling_settings_is_answered_or_refused(client, messages, sampling):
    body: dict[str, Any] = {"model": "tiny-llama", "messages": messages, "max_tokens": 2, **sampling}
    if body.get("logprobs") is False:
        body.pop("logprobs")
    response = client.post("/v1/chat/completions", json=body)
    check_answer(response.status_code, response.headers.get("content-type", ""), response.text)
    if response.status_code == 200 and not body.get("stream"):
        logprobs = response.json()["choices"][0]["logprobs"] or {"content": []}
        assert all(entry["logprob"] == entry["logprob"] for entry in logprobs["content"])  # no NaN
