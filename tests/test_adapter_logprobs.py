"""Token log-probabilities through the LangChain and LlamaIndex adapters, in the shapes their
OpenAI integrations give: the same numbers as the engine, once each, streamed or not."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from rag_mspoe.connectors.langchain import ChatRagMsPoE, RagMsPoELLM
from rag_mspoe.connectors.llamaindex import RagMsPoE

QUESTION = "Name three colours."
CHAT = [{"role": "user", "content": QUESTION}]


def weather(city: str) -> str:
    """Today's weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def tiny(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def expected(tiny):
    return tiny.generate(CHAT, max_new_tokens=8, logprobs=2).logprobs


def test_langchain_chat_gives_them_in_response_metadata_once_streamed_or_not(tiny, expected):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=8, logprobs=True, top_logprobs=2)
    content = chat.invoke([HumanMessage(QUESTION)]).response_metadata["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(t.token, t.logprob) for t in expected]
    assert [len(c["top_logprobs"]) for c in content] == [2] * len(expected)
    chunks = list(chat.stream([HumanMessage(QUESTION)]))
    for chunk in chunks[:-1]:  # each piece carries the tokens that start in it, as langchain-openai's
        assert "".join(c["token"] for c in chunk.response_metadata["logprobs"]["content"]) == chunk.content
    merged = sum(chunks[1:], chunks[0])
    assert merged.response_metadata["logprobs"]["content"] == content


def test_langchain_per_call_logprobs_and_none_by_default(tiny, expected):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=8)
    assert "logprobs" not in chat.invoke([HumanMessage(QUESTION)]).response_metadata
    bound = chat.bind(logprobs=True).invoke([HumanMessage(QUESTION)])
    assert [c["logprob"] for c in bound.response_metadata["logprobs"]["content"]] == [
        t.logprob for t in expected
    ]
    with pytest.raises(TypeError, match="logprobs is True or False"):
        chat.invoke([HumanMessage(QUESTION)], logprobs=3)


def test_langchain_llm_gives_the_legacy_completion_shape(tiny):
    llm = RagMsPoELLM(engine=tiny, max_tokens=8, logprobs=True, top_logprobs=1)
    info = llm.generate([QUESTION]).generations[0][0].generation_info
    direct = tiny.generate(QUESTION, max_new_tokens=8, logprobs=1, raw=not llm.use_chat_template).logprobs
    assert info["logprobs"]["tokens"] == [t.token for t in direct]
    assert info["logprobs"]["text_offset"] == [t.text_offset for t in direct]
    assert [len(top) for top in info["logprobs"]["top_logprobs"]] == [1] * len(direct)
    chunks = list(llm._stream(QUESTION))
    merged = sum(chunks[1:], chunks[0])
    assert merged.generation_info["logprobs"] == info["logprobs"]


def test_langchain_refuses_logprobs_with_callable_tools(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=8, logprobs=True).bind_tools([weather])
    with pytest.raises(ValueError, match="logprobs cannot be combined with tools"):
        chat.invoke([HumanMessage("Weather in Paris?")])


def test_llamaindex_chat_and_completion_hold_them_chosen_token_first(tiny, expected):
    from llama_index.core.llms import ChatMessage

    llm = RagMsPoE(engine=tiny, max_tokens=8, logprobs=True, top_logprobs=2)
    response = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert [per_token[0].token for per_token in response.logprobs] == [t.token for t in expected]
    assert [per_token[0].logprob for per_token in response.logprobs] == [t.logprob for t in expected]
    assert all(len(per_token) in (2, 3) for per_token in response.logprobs)  # the chosen, then the others
    *middle, last = list(llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))
    assert [len(r.logprobs) for r in middle] == list(range(1, len(middle) + 1))  # the tokens so far
    assert middle[-1].logprobs == last.logprobs == response.logprobs
    assert RagMsPoE(engine=tiny, max_tokens=4).complete(QUESTION).logprobs is None
    completion = llm.complete(QUESTION)
    assert "".join(per_token[0].token for per_token in completion.logprobs) == completion.text
