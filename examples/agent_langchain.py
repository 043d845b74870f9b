"""A LangChain agent on the local model: it decides to search the demo archive, reads what the
retriever returns, and answers.

The agent is LangChain's own (`langchain.agents.create_agent`: model, tools, model, ... until the
model answers in text), the chat model is `ChatRagMsPoE` (its calls are held to the tools'
schemas by the grammar), and the tool searches the LangChain retriever of a FAISS index of the
shipped demo corpus. tool_choice stays "auto": whether to search is the model's decision.

    pip install ".[agents]"
    python examples/agent_langchain.py                     # Qwen2.5-Coder-1.5B, the Gull Point question
    python examples/agent_langchain.py "When was Gull Point Light automated?" \\
        --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from archive_tool import QUESTION, TOOL_DESCRIPTION, TOOL_NAME, tool_result
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool

from rag_mspoe.connectors.langchain import ChatRagMsPoE
from rag_mspoe.connectors.retrievers import langchain_retriever
from rag_mspoe.engine import Engine
from rag_mspoe.pipelines import index_documents
from rag_mspoe.pipelines.demo import demo_corpus_dir


def build_agent(chat: BaseChatModel, index: str | Path) -> Any:
    """LangChain's agent with one tool: the top 5 chunks of `index` for a query."""
    retriever = langchain_retriever(index)

    def search_archive(query: str) -> str:
        return tool_result(document.page_content for document in retriever.invoke(query))

    search = StructuredTool.from_function(search_archive, name=TOOL_NAME, description=TOOL_DESCRIPTION)
    return create_agent(chat, [search])


def searches(messages: list[Any]) -> list[dict[str, Any]]:
    """The agent's calls of the search tool, in order (name, arguments, id)."""
    return [
        call
        for message in messages
        if isinstance(message, AIMessage)
        for call in message.tool_calls
        if call["name"] == TOOL_NAME
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct", help="embedded model name, folder or hub id"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the free CPUs)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as index:
        index_documents(demo_corpus_dir(), index, progress=False)
        chat = ChatRagMsPoE(engine=Engine.load(args.model, threads=args.threads), max_tokens=200)
        agent = build_agent(chat, index)
        started = time.perf_counter()
        messages = agent.invoke({"messages": [("user", args.question)]})["messages"]
        seconds = time.perf_counter() - started

    for message in messages[1:]:
        if isinstance(message, ToolMessage):
            print(f"[{message.name}] {len(message.text)} characters of passages")
        elif isinstance(message, AIMessage):
            calls = ", ".join(f"{call['name']}({call['args']})" for call in message.tool_calls)
            print(f"[model] {calls or message.text}")
    print(f"searched: {'yes' if searches(messages) else 'no'}; answered in {seconds:.0f} s")


if __name__ == "__main__":
    main()
