"""The LangChain and LlamaIndex adapters over a remote engine: real framework objects against a real
`rag-mspoe serve` app on a port (a tiny random Llama in fp32, the real SmolLM2 tokenizer), whose
answers equal the local adapters' over the same engine; and what a remote endpoint refuses."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from fake_endpoint import FakeBehaviour, fake_endpoint
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from pydantic import BaseModel

from rag_mspoe.connectors.langchain import ChatRagMsPoE, RagMsPoELLM
from rag_mspoe.connectors.llamaindex import RagMsPoE
from rag_mspoe.engine import GenerationTimeout
from rag_mspoe.engine.remote_engine import RemoteEngine
from rag_mspoe.methods import InvariantReorder
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

TOKENIZER = "smollm2-135m-instruct"  # the tiny engine's tokenizer, by its embedded model's name
DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps."),
]
QUESTION = "What is the capital of France?"


def qa_prompt(order=(0, 1, 2)):
    return render_qa_prompt(QUESTION, [DOCUMENTS[i] for i in order])[0]


@pytest.fixture(scope="module")
def served(tiny_engine):
    """`rag-mspoe serve`'s app over the tiny engine (fp32) on a port, and a remote engine of it."""
    from server_helpers import running

    from rag_mspoe.connectors.server import create_app

    with running(create_app(tiny_engine)) as url:
        yield RemoteEngine.connect(url, tiny_engine.name, tokenizer=TOKENIZER)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def joined(chunks):
    return sum(chunks[1:], chunks[0])


@pytest.mark.parametrize("method", ["none", "invariant-reorder"])
def test_the_langchain_chat_model_answers_through_the_endpoint_as_it_does_locally(
    served, tiny_engine, method
):
    local = ChatRagMsPoE(engine=tiny_engine, method=method, max_tokens=12)
    remote = ChatRagMsPoE(engine=served, method=method, max_tokens=12)
    prompt = qa_prompt((2, 0, 1))
    expected = local.invoke(prompt)
    got = remote.invoke(prompt)
    assert got.content == expected.content and got.content
    assert got.usage_metadata == expected.usage_metadata
    assert got.response_metadata == {**expected.response_metadata, "model_name": tiny_engine.name}
    if method == "invariant-reorder":  # the server's scores ranked the documents as the local model did
        assert got.response_metadata["documents_read"] != [0, 1, 2]

    handler = Tokens()
    chunks = list(remote.stream(prompt, config={"callbacks": [handler]}))
    assert len(chunks) > 2 and joined(chunks).content == expected.content
    assert "".join(handler.tokens) == expected.content
    assert joined(chunks).usage_metadata == expected.usage_metadata
    read = got.response_metadata.get("documents_read")
    assert joined(chunks).response_metadata.get("documents_read") == read

    async def both():
        return await remote.ainvoke(prompt), [chunk async for chunk in remote.astream(prompt)]

    invoked, streamed = asyncio.run(both())
    assert invoked.content == joined(streamed).content == expected.content


def test_a_first_margin_keeps_or_reorders_through_the_endpoint_as_locally(served, tiny_engine):
    from itertools import permutations

    method = InvariantReorder(first_margin=0.0)
    kept = 0
    for order in permutations(range(3)):
        prompt = qa_prompt(order)
        (local,) = tiny_engine.rewritten([prompt], method=method)[1]
        assert served.rewritten([prompt], method=method)[1] == [local]
        kept += local == prompt
    assert 0 < kept < 6  # both ways were taken


def test_stop_strings_and_per_call_settings_behave_as_locally(served, tiny_engine):
    local = ChatRagMsPoE(engine=tiny_engine, max_tokens=20)
    remote = ChatRagMsPoE(engine=served, max_tokens=20)
    full = local.invoke(QUESTION).content
    for stops in ([full[5:13]], [full[-4:], full[9:11]]):  # the answer cut where the local one is
        cut = local.invoke(QUESTION, stop=stops)
        assert len(cut.content) < len(full)
        assert remote.invoke(QUESTION, stop=stops).content == cut.content
        assert joined(list(remote.stream(QUESTION, stop=stops))).content == cut.content
    short = remote.invoke(QUESTION, max_tokens=5)
    assert short.content == local.invoke(QUESTION, max_tokens=5).content
    assert short.response_metadata["finish_reason"] == "length" and short.usage_metadata["output_tokens"] == 5
    sampled = dict(temperature=1.0, seed=3)
    assert remote.invoke(QUESTION, **sampled).content == local.invoke(QUESTION, **sampled).content


def test_the_langchain_text_llm_continues_and_batches_as_locally(served, tiny_engine):
    local = RagMsPoELLM(engine=tiny_engine, max_tokens=10)
    remote = RagMsPoELLM(engine=served, max_tokens=10)
    prompts = ["The capital of France is", qa_prompt()]
    assert remote.batch(prompts) == local.batch(prompts)
    assert "".join(remote.stream(prompts[0])) == local.invoke(prompts[0])
    reordered = RagMsPoELLM(engine=served, max_tokens=10, method="invariant-reorder")
    expected = RagMsPoELLM(engine=tiny_engine, max_tokens=10, method="invariant-reorder")
    assert reordered.invoke(prompts[1]) == expected.invoke(prompts[1])
    chat_template = dict(max_tokens=10, use_chat_template=True)
    assert RagMsPoELLM(engine=served, **chat_template).invoke(QUESTION) == RagMsPoELLM(
        engine=tiny_engine, **chat_template
    ).invoke(QUESTION)


def test_the_llamaindex_llm_answers_through_the_endpoint_as_it_does_locally(served, tiny_engine):
    local = RagMsPoE(engine=tiny_engine, method="invariant-reorder", max_tokens=12)
    remote = RagMsPoE(engine=served, method="invariant-reorder", max_tokens=12)
    messages = [ChatMessage(role=MessageRole.USER, content=qa_prompt((1, 2, 0)))]
    expected = local.chat(messages)
    got = remote.chat(messages)
    assert got.message.content == expected.message.content
    assert got.raw == {**expected.raw, "model": tiny_engine.name}
    streamed = list(remote.stream_chat(messages))
    assert streamed[-1].message.content == expected.message.content
    assert "".join(r.delta for r in streamed) == expected.message.content
    completed = local.complete(qa_prompt()).text
    assert remote.complete(qa_prompt()).text == completed

    async def both():
        chat = await remote.achat(messages)
        pieces = [r async for r in await remote.astream_complete(qa_prompt())]
        return chat, pieces

    chat, pieces = asyncio.run(both())
    assert chat.message.content == expected.message.content
    assert pieces[-1].text == completed
    plain = tiny_engine.generate("The capital of France is", raw=True, max_new_tokens=12, method="none")
    for llm in (local, remote):  # a prompt without documents: answered alike, unmodified, and said
        answer = llm.complete("The capital of France is")
        assert answer.text == plain.text and answer.raw["documents_read"] == []
    assert remote.metadata.context_window == 8192  # SmolLM2's config, read with its tokenizer
    assert not remote.metadata.is_function_calling_model
    assert remote.tokenizer("Paris") == tiny_engine.encode("Paris")


def test_every_order_of_the_documents_gets_the_same_remote_answer(served):
    chat = ChatRagMsPoE(engine=served, method="invariant-reorder", max_tokens=8)
    answers = {chat.invoke(qa_prompt(order)).content for order in itertools.permutations(range(3))}
    assert len(answers) == 1


def test_a_call_past_its_timeout_fails_as_a_local_one_does_and_is_retried(served):
    chat = ChatRagMsPoE(engine=served, max_tokens=200, timeout=0.05)
    with pytest.raises(GenerationTimeout, match="raise timeout or retry"):
        chat.invoke(QUESTION)
    with pytest.raises(GenerationTimeout):
        list(chat.stream(QUESTION))
    sent = served.client.sent
    with pytest.raises(GenerationTimeout):
        ChatRagMsPoE(engine=served, max_tokens=200, timeout=0.05, max_retries=2).invoke(QUESTION)
    assert served.client.sent == sent + 3  # the first attempt and two retries, as locally


def test_what_needs_the_model_itself_is_refused_naming_what_runs(served):
    with pytest.raises(ValueError, match="mspoe changes the model itself") as refused:
        ChatRagMsPoE(engine=served, method="mspoe")
    assert "none, longcontextreorder, random, invariant-reorder" in str(refused.value)
    chat = ChatRagMsPoE(engine=served, max_tokens=8)
    with pytest.raises(ValueError, match="mspoe changes the model itself"):
        chat.invoke(QUESTION, method="mspoe")

    class Answer(BaseModel):
        city: str

    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    for call in (
        lambda: chat.bind_tools([lookup]).invoke(QUESTION),
        lambda: chat.with_structured_output(Answer).invoke(QUESTION),
        lambda: RagMsPoE(engine=served).chat_with_tools([_tool(lookup)], user_msg=QUESTION),
    ):
        with pytest.raises(ValueError, match="Tool calls and structured output"):
            call()
    with pytest.raises(ValueError, match="logprobs"):
        chat.invoke(QUESTION, logprobs=True)
    with pytest.raises(ValueError, match="truncate='middle'"):
        chat.invoke(QUESTION, truncate="middle")
    with pytest.raises(ValueError, match="at most 4"):
        chat.invoke(QUESTION, stop=["a", "b", "c", "d", "e"])


def _tool(function):
    from llama_index.core.tools import FunctionTool

    return FunctionTool.from_defaults(fn=function)


@pytest.mark.parametrize(
    "behaviour",
    [FakeBehaviour(prompt_logprobs=False), FakeBehaviour(shifted=True)],
    ids=["prompt-scores-zero", "scores-one-token-off"],
)
def test_a_server_without_prompt_logprobs_refuses_invariant_reorder_at_the_start(served, behaviour):
    with fake_endpoint(behaviour, served.tokenizer) as url:
        engine = RemoteEngine.connect(url, "gguf", tokenizer=TOKENIZER)
        with pytest.raises(ValueError, match=r"can run: none, longcontextreorder, random(?!,)"):
            RagMsPoE(engine=engine, method="invariant-reorder")
        assert len(behaviour.requests) == 1  # the probe alone
        assert ChatRagMsPoE(engine=engine, max_tokens=4).invoke(QUESTION).content == "Paris"


def test_without_a_tokenizer_the_servers_chat_endpoint_answers(served):
    behaviour = FakeBehaviour(answer="Rome")
    with fake_endpoint(behaviour, served.tokenizer) as url:
        engine = RemoteEngine.connect(url, "hosted")
        message = ChatRagMsPoE(engine=engine, max_tokens=4).invoke([HumanMessage(QUESTION)])
        with pytest.raises(ValueError, match=r"can run: none, longcontextreorder, random(?!,)"):
            ChatRagMsPoE(engine=engine, method="invariant-reorder")
    assert message.content == "Rome" and message.response_metadata["model_name"] == "hosted"
    assert behaviour.requests == [
        (
            "/v1/chat/completions",
            {
                "model": "hosted",
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 4,
                "temperature": 0.0,
            },
        )
    ]
