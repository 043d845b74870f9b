"""A LlamaIndex agent on the local model: it decides to search the demo archive, reads what the
retriever returns, and answers.

The agent is LlamaIndex's `FunctionAgent` (a workflow: model, tools, model, ... until the model
answers in text), the LLM is `RagMsPoE` (its calls are held to the tools' schemas by the
grammar), and the tool searches the LlamaIndex retriever of a FAISS index of the shipped demo corpus.
tool_choice stays "auto": whether to search is the model's decision.

    pip install ".[agents]"
    python examples/agent_llamaindex.py                    # Qwen2.5-Coder-1.5B, the Gull Point question
    python examples/agent_llamaindex.py "When was Gull Point Light automated?" \\
        --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from archive_tool import QUESTION, TOOL_DESCRIPTION, TOOL_NAME, tool_result
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool

from rag_mspoe.connectors.llamaindex import RagMsPoE
from rag_mspoe.connectors.retrievers import llamaindex_retriever
from rag_mspoe.engine import Engine
from rag_mspoe.pipelines import index_documents
from rag_mspoe.pipelines.demo import demo_corpus_dir


def build_agent(llm: FunctionCallingLLM, index: str | Path) -> FunctionAgent:
    """LlamaIndex's function-calling agent with one tool: the top 5 chunks of `index` for a query."""
    retriever = llamaindex_retriever(index)

    def search_archive(query: str) -> str:
        return tool_result(found.node.get_content() for found in retriever.retrieve(query))

    search = FunctionTool.from_defaults(fn=search_archive, name=TOOL_NAME, description=TOOL_DESCRIPTION)
    return FunctionAgent(tools=[search], llm=llm)


async def ask(agent: FunctionAgent, question: str) -> AgentOutput:
    """The agent's final output; its `tool_calls` are the calls made on the way, in order."""
    return await agent.run(user_msg=question)


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
        llm = RagMsPoE(engine=Engine.load(args.model, threads=args.threads), max_tokens=200)
        agent = build_agent(llm, index)
        started = time.perf_counter()
        output = asyncio.run(ask(agent, args.question))
        seconds = time.perf_counter() - started

    for call in output.tool_calls:
        print(f"[model] {call.tool_name}({call.tool_kwargs})")
    print(f"[model] {output.response.content}")
    searched = any(call.tool_name == TOOL_NAME for call in output.tool_calls)
    print(f"searched: {'yes' if searched else 'no'}; answered in {seconds:.0f} s")


if __name__ == "__main__":
    main()
