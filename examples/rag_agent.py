"""A RAG agent on the rescaled model: the FAISS retriever is a tool, the answer cites what it read.

Step 1: the model must call `search_documents` (tool_choice names it); its arguments are
decoded under the tool's schema, so the call always parses. Step 2: the search results go back
as a tool turn, and the model answers as JSON whose `sources` may only name retrieved documents
(an enum built from the results), so every citation points at something it was shown.

The mechanics hold on any model; the quality of the search query and of the answer is the
model's. The embedded 135M model often writes a poor query (and then an answer from the wrong
passages); a 1.5B instruct model does far better.

pip install ".[rag]" && python examples/rag_agent.py ["your question" [model dir or hub id]]
"""

import json
import sys
import tempfile
from pathlib import Path

from rag_mspoe.engine import Engine
from rag_mspoe.pipelines.demo import demo_corpus_dir
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.retrieval import Retriever
from rag_mspoe.tools.json_output import generate_json
from rag_mspoe.tools.tool_calls import generate_with_tools

SEARCH = {
    "type": "function",
    "function": {
        "name": "search_documents",
        "description": "Search the island archive for passages about a topic.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look for", "maxLength": 60}},
            "required": ["query"],
        },
    },
}

question = sys.argv[1] if len(sys.argv) > 1 else "Who first lit the lamp of Gull Point Light?"
with tempfile.TemporaryDirectory() as folder:
    index_documents(demo_corpus_dir(), folder, progress=False)
    retriever = Retriever.load(folder)
    engine = Engine.load(sys.argv[2] if len(sys.argv) > 2 else None)
    messages = [
        {"role": "system", "content": "Answer from the island archive; search it first."},
        {"role": "user", "content": question},
    ]

    step = generate_with_tools(engine, messages, [SEARCH], tool_choice="search_documents", max_new_tokens=100)
    call = step.tool_calls[0]
    hits = retriever.retrieve(call.arguments["query"], k=3)
    print(f"search_documents({call.arguments['query']!r}) -> {[Path(h.chunk.source).name for h in hits]}")
    results = "\n\n".join(f"[{Path(h.chunk.source).name}]\n{h.chunk.text}" for h in hits)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call.openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": results},
    ]

    cited = sorted({Path(h.chunk.source).name for h in hits})
    answer_schema = {
        "type": "object",
        "properties": {
            "answer": {
                "type": "string",
                "description": "a short answer from the search results",
                "maxLength": 200,
            },
            "sources": {"type": "array", "items": {"enum": cited}, "minItems": 1, "maxItems": len(cited)},
        },
        "required": ["answer", "sources"],
        "additionalProperties": False,
    }
    final = generate_json(engine, messages, answer_schema, max_new_tokens=120)
    print(json.dumps(json.loads(final.text), indent=2))
