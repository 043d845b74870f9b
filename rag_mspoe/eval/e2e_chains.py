"""End-to-end answers through the chains users write: LangChain's tutorial RAG chain (the LCEL chain,
and the agent of its current tutorial) and a LlamaIndex query engine, each over the run's FAISS
index, with the LLM line the only thing of ours.

The unmodified model and the methods that read documents answer the same chain; a document order
(`longcontextreorder`) is the step users add for it: a `format_docs` that reorders in LangChain
(LangChain's LongContextReorder algorithm), LlamaIndex's own `LongContextReorder` postprocessor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rag_mspoe.methods.method_spec import ResolvedMethod
    from rag_mspoe.pipelines.retrieval import Retriever

CHAINS = ("langchain", "langchain-agent", "llamaindex")
# The system prompt of LangChain's current RAG tutorial, its "RAG chain": an agent without tools
# whose dynamic_prompt middleware searches the vector store; the question is the user's message.
AGENT_SYSTEM_PROMPT = "You are a helpful assistant. Use the following context in your response:\n\n{context}"
# The prompt of LangChain's earlier RAG tutorial (its hub prompt "rlm/rag-prompt").
TUTORIAL_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\n"
    "Question: {question} \nContext: {context} \nAnswer:"
)


@dataclass(frozen=True)
class ChainAnswer:
    text: str
    packed: list[tuple[str, str]]  # (source, text) of each document, in the order the prompt holds them
    documents_read: list[int] | None  # the method's order of reading them, as its response says


def answer_through_chain(
    chain: str, engine: Any, method: ResolvedMethod, question: str, index: Retriever, k: int, max_tokens: int
) -> ChainAnswer:
    """The answer `chain` ("langchain" or "llamaindex") gives with the model of `engine` under `method`."""
    if chain == "langchain":
        return _through_langchain(engine, method, question, index, k, max_tokens)
    if chain == "langchain-agent":
        return _through_langchain_agent(engine, method, question, index, k, max_tokens)
    if chain == "llamaindex":
        return _through_llamaindex(engine, method, question, index, k, max_tokens)
    raise ValueError(f"--through takes pipeline, {', '.join(CHAINS)}; got {chain!r}.")


def _llm_method(method: ResolvedMethod) -> Any:
    if method.order not in ("given", "reorder"):
        raise ValueError(
            f"{method.name}: through a chain, documents keep the retriever's order or take "
            "LongContextReorder's ('longcontextreorder'); other orders run with --through pipeline."
        )
    return method.method if method.method is not None else "none"


def _through_langchain(
    engine: Any, method: ResolvedMethod, question: str, index: Retriever, k: int, max_tokens: int
) -> ChainAnswer:
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.connectors.langchain_retriever import LangChainRetriever

    packed: list[tuple[str, str]] = []

    def format_docs(docs: Sequence[Any]) -> str:
        return _stuffed(docs, method, packed)

    llm = ChatRagMsPoE(engine=engine, method=_llm_method(method), max_tokens=max_tokens)
    retriever = LangChainRetriever(retriever=index, k=k)
    chain = (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | ChatPromptTemplate.from_template(TUTORIAL_PROMPT)
        | llm
    )
    reply = chain.invoke(question)
    return ChainAnswer(str(reply.content), packed, reply.response_metadata.get("documents_read"))


def _through_langchain_agent(
    engine: Any, method: ResolvedMethod, question: str, index: Retriever, k: int, max_tokens: int
) -> ChainAnswer:
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    from rag_mspoe.connectors.langchain import ChatRagMsPoE
    from rag_mspoe.eval.e2e_vector_store import IndexVectorStore

    vector_store = IndexVectorStore(index)
    packed: list[tuple[str, str]] = []

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        docs = vector_store.similarity_search(request.state["messages"][-1].text, k=k)
        return AGENT_SYSTEM_PROMPT.format(context=_stuffed(docs, method, packed))

    llm = ChatRagMsPoE(engine=engine, method=_llm_method(method), max_tokens=max_tokens)
    agent = create_agent(llm, tools=[], middleware=[prompt_with_context])
    reply = agent.invoke({"messages": [{"role": "user", "content": question}]})["messages"][-1]
    return ChainAnswer(str(reply.content), packed, reply.response_metadata.get("documents_read"))


def _stuffed(docs: Sequence[Any], method: ResolvedMethod, packed: list[tuple[str, str]]) -> str:
    """LangChain documents joined by blank lines, as the tutorials' `format_docs` does, in
    LongContextReorder's order under that label; each one's (source, text) appended to `packed`."""
    from rag_mspoe.prompts.document_order import long_context_reorder

    ordered = long_context_reorder(list(docs)) if method.order == "reorder" else list(docs)
    packed.extend((doc.metadata.get("source", ""), doc.page_content) for doc in ordered)
    return "\n\n".join(doc.page_content for doc in ordered)


def _through_llamaindex(
    engine: Any, method: ResolvedMethod, question: str, index: Retriever, k: int, max_tokens: int
) -> ChainAnswer:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
    from llama_index.core.postprocessor import LongContextReorder
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.query_engine import RetrieverQueryEngine

    from rag_mspoe.connectors.llamaindex import RagMsPoE
    from rag_mspoe.connectors.llamaindex_retriever import LlamaIndexRetriever

    llm = RagMsPoE(engine=engine, method=_llm_method(method), max_tokens=max_tokens)
    postprocessors: list[BaseNodePostprocessor] = [LongContextReorder()] if method.order == "reorder" else []
    query_engine = RetrieverQueryEngine.from_args(
        LlamaIndexRetriever(index, k=k), llm=llm, node_postprocessors=postprocessors
    )

    class LLMResponses(BaseEventHandler):
        """The `raw` of every LLM response LlamaIndex reports while the query runs."""

        raw: list[dict[str, Any]] = []

        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
                self.raw.append(dict(event.response.raw or {}))

    recorder = LLMResponses()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(recorder)
    try:
        response = query_engine.query(question)
    finally:
        dispatcher.event_handlers.remove(recorder)
    packed = [(str(n.node.metadata.get("source", "")), n.node.get_content()) for n in response.source_nodes]
    read = recorder.raw[-1].get("documents_read") if recorder.raw else None
    return ChainAnswer(str(response), packed, read)
