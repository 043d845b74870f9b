"""The `index`, `search` and `ask` commands.

    rag-mspoe index docs/ --index my-index
    rag-mspoe search "When was the light first lit?" --index my-index
    rag-mspoe ask "When was the light first lit?" --index my-index --method mspoe

Heavy libraries (FAISS, sentence-transformers, torch) are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_mspoe.models.command_options import add_engine_options, engine_options
from rag_mspoe.pipelines.chunking import DEFAULT_CHUNK_OVERLAP, DEFAULT_CHUNK_SIZE
from rag_mspoe.pipelines.index import INDEX_KINDS
from rag_mspoe.pipelines.retrieval import FIRST_STAGES

if TYPE_CHECKING:
    from rag_mspoe.pipelines.answer import Answer, Citation
    from rag_mspoe.pipelines.chunking import Chunk
    from rag_mspoe.pipelines.retrieval import RetrievedChunk

DEFAULT_INDEX_DIR = "rag-index"


def register(subparsers: Any) -> None:
    _register_index(subparsers)
    _register_search(subparsers)
    _register_ask(subparsers)


def _register_index(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "index",
        help="index documents (txt, md, html, pdf, jsonl) into a FAISS index on disk, or add to one",
        description="Read, chunk and embed documents into a FAISS index. Running it again on an existing "
        "index adds the documents it does not hold yet.",
    )
    parser.add_argument("paths", nargs="+", help="files or folders (searched recursively)")
    _index_option(parser)
    parser.add_argument(
        "--embedding-model",
        default=None,
        help="sentence-transformers name or folder (default: all-MiniLM-L6-v2, offline; "
        "an existing index keeps its own)",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=None, help=f"tokens per chunk (default {DEFAULT_CHUNK_SIZE})"
    )
    parser.add_argument(
        "--chunk-overlap",
        type=int,
        default=None,
        help=f"tokens shared by neighbouring chunks (default {DEFAULT_CHUNK_OVERLAP})",
    )
    parser.add_argument(
        "--kind",
        choices=INDEX_KINDS,
        default=None,
        help="flat: exact search (default); hnsw or ivf: approximate, for large corpora",
    )
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--batch-size", type=int, default=64, help="chunks embedded per batch")
    parser.add_argument(
        "--follow-links",
        action="store_true",
        help="also index files that links inside a folder point to outside it (skipped by default)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="hide the progress bars (shown on a terminal by default)"
    )
    parser.set_defaults(func=_index)


def _register_search(subparsers: Any) -> None:
    parser = subparsers.add_parser("search", help="show the chunks an index returns for a question")
    parser.add_argument("question")
    _index_option(parser)
    _retrieval_options(parser, default_k=5)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=_search)


def _register_ask(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ask", help="answer a question from an index with the model and its method, citing its documents"
    )
    parser.add_argument("question")
    _index_option(parser)
    _retrieval_options(parser, default_k=5)
    add_engine_options(parser)
    parser.add_argument(
        "--method",
        default=None,
        help="none, pi, pi:2, mspoe, layerwise, layerwise+pi, calibrated (the config shipped for the "
        "model) or a config path (default: calibrated where one ships for the model and was validated "
        "at -k documents, else none; none under --reorder)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--reorder",
        action="store_true",
        help="LongContextReorder: best chunks at both ends of the context (default: retrieval order)",
    )
    parser.add_argument(
        "--no-cite",
        action="store_true",
        help="do not ask the model to cite [Document i] (exact benchmark prompt)",
    )
    parser.add_argument("--show-prompt", action="store_true", help="print the packed prompt first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=_ask)


def _index_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--index", default=DEFAULT_INDEX_DIR, help=f"index folder (default: ./{DEFAULT_INDEX_DIR})"
    )


def _retrieval_options(parser: argparse.ArgumentParser, default_k: int) -> None:
    parser.add_argument("-k", type=int, default=default_k, help=f"chunks to retrieve (default {default_k})")
    parser.add_argument(
        "--embedding-model",
        default=None,
        help="check that the index was built with this embedding model (default: the index's own)",
    )
    parser.add_argument(
        "--first-stage",
        choices=FIRST_STAGES,
        default="dense",
        help="how chunks are found: dense (embeddings, the default), lexical (BM25) or hybrid "
        "(both, fused by reciprocal rank)",
    )


# -- commands ----------------------------------------------------------------------------------------


def _index(args: argparse.Namespace) -> int:
    from rag_mspoe.pipelines.indexing import index_documents

    report = index_documents(
        args.paths,
        args.index,
        embedding_model=args.embedding_model,
        chunk_size=args.chunk_size,
        chunk_overlap=args.chunk_overlap,
        kind=args.kind,
        text_field=args.text_field,
        batch_size=args.batch_size,
        follow_outside_links=args.follow_links,
        progress=False if args.no_progress else None,
    )
    print(report.summary())
    for skipped in report.skipped:
        print(f"  skipped {_show_path(skipped.source)}: {skipped.reason}")
    return 0


def _search(args: argparse.Namespace) -> int:
    from rag_mspoe.pipelines.retrieval import Retriever

    retriever = Retriever.load(args.index, embedding_model=args.embedding_model, first_stage=args.first_stage)
    started = time.perf_counter()
    hits = retriever.retrieve(args.question, args.k)
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps([_hit_record(hit) for hit in hits], indent=1, ensure_ascii=False))
        return 0
    for hit in hits:
        print(f"{hit.rank}. {hit.score:.3f}  {_cite_place(hit.chunk)}  {hit.chunk.title}")
        print(f"   {_shorten(hit.chunk.text, 200)}")
    print(f"({len(hits)} chunks in {seconds * 1000:.0f} ms)")
    return 0


def _ask(args: argparse.Namespace) -> int:
    from rag_mspoe import parse_method
    from rag_mspoe.engine import Engine
    from rag_mspoe.models.loading import source_name
    from rag_mspoe.pipelines.answer import answer_question
    from rag_mspoe.pipelines.retrieval import Retriever

    method = args.method or _default_ask_method(args)
    # Fail on a bad method name (or no calibrated config for the model) or a device this machine
    # lacks before loading anything heavy.
    parse_method(method, source_name(args.model))
    load_options = engine_options(args)
    retriever = Retriever.load(args.index, embedding_model=args.embedding_model, first_stage=args.first_stage)
    engine = Engine.load(args.model, **load_options)
    answer = answer_question(
        args.question,
        retriever,
        engine,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        reorder=args.reorder,
        cite=not args.no_cite,
        method=method,
    )
    if args.json:
        print(json.dumps(_answer_record(answer), indent=1, ensure_ascii=False))
        return 0
    if args.show_prompt:
        print(answer.packed.prompt, end="\n\n")
    print(answer.text)
    print()
    if answer.citations:
        print("Cited:")
        for citation in answer.citations:
            print(f"  [Document {citation.number}] {_cite_place(citation)}  {citation.title}")
    else:
        print("The answer cites no document.")
    if answer.unknown_citations:
        print(f"  cited but not in the context: {', '.join(map(str, answer.unknown_citations))}")
    order = "LongContextReorder" if answer.packed.reordered else "retrieval order"
    print(f"Context ({order}, {answer.packed.prompt_tokens} of {answer.packed.budget} prompt tokens):")
    for number, item in enumerate(answer.packed.documents, start=1):
        print(f"  [Document {number}] rank {item.rank}, score {item.score:.3f}  {_cite_place(item.chunk)}")
    for item in answer.packed.dropped:
        print(f"  dropped (over the token budget): rank {item.rank}  {_cite_place(item.chunk)}")
    timings = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in answer.timings.items())
    print(f"{engine.name} with method {answer.method}: {timings}")
    return 0


# -- printing ----------------------------------------------------------------------------------------


def _hit_record(hit: RetrievedChunk) -> dict[str, Any]:
    return {"rank": hit.rank, "score": hit.score, "chunk_id": hit.chunk_id, **asdict(hit.chunk)}


def _default_ask_method(args: argparse.Namespace) -> str:
    """`ask`'s method when given none: "auto" (the model's shipped method on a prompt of a document
    count it was validated at) where it was validated at -k documents, and none under --reorder
    (LongContextReorder is the remedy asked for); says on stderr when a shipped method is left out."""
    from rag_mspoe.calibrated import default_method
    from rag_mspoe.methods import AUTO
    from rag_mspoe.models.loading import source_name

    model = source_name(args.model)
    if default_method(model) == "none":
        return "none"
    if args.reorder:
        reason = "--reorder asks for LongContextReorder instead"
    elif default_method(model, documents=args.k) == "none":
        reason = f"it was not validated at {args.k} documents (-k sets the count)"
    else:
        return AUTO  # not "calibrated": packing may leave fewer than -k documents
    print(
        f"Answering without the method shipped for this model: {reason}; --method calibrated applies it.",
        file=sys.stderr,
    )
    return "none"


def _answer_record(answer: Answer) -> dict[str, Any]:
    return {
        "question": answer.question,
        "answer": answer.text,
        "method": answer.method,
        "finish_reason": answer.finish_reason,
        "citations": [asdict(c) for c in answer.citations],
        "unknown_citations": answer.unknown_citations,
        "documents": [_hit_record(item) for item in answer.packed.documents],
        "dropped": [_hit_record(item) for item in answer.packed.dropped],
        "reordered": answer.packed.reordered,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "timings": answer.timings,
    }


def _cite_place(chunk: Chunk | Citation) -> str:
    """file[#location]:start-end (character offsets of the chunk in the document's text)."""
    where = f"#{chunk.location}" if chunk.location else ""
    return f"{_show_path(chunk.source)}{where}:{chunk.start}-{chunk.end}"


def _show_path(path: str) -> str:
    """A path relative to the working folder when it lies below it, else as stored."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _shorten(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."
