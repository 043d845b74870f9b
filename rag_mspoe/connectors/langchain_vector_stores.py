"""The texts LangChain vector stores return from a search, kept for the document finder.

LangChain's RAG tutorial searches its vector store itself, in a `dynamic_prompt` middleware
(`vector_store.similarity_search(query)`), and joins the texts into the system message. No
retriever runs, so no callback sees those documents, and a method that reads documents would find
none in the prompt. So the adapters wrap the search methods of every `VectorStore` class, those
defined already and those defined later, to keep the texts each search returns
(`rag_mspoe.connectors.document_finder.RETRIEVED`). The results are returned unchanged.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any

from langchain_core.documents import Document
from langchain_core.vectorstores import VectorStore

from rag_mspoe.connectors.document_finder import RETRIEVED

# VectorStore's public searches, each returning documents or (document, score) pairs.
SEARCHES = tuple(
    prefix + name
    for name in (
        "search",
        "similarity_search",
        "similarity_search_with_score",
        "similarity_search_with_relevance_scores",
        "similarity_search_by_vector",
        "max_marginal_relevance_search",
        "max_marginal_relevance_search_by_vector",
    )
    for prefix in ("", "a")
)
_WRAPPED = "_rag_mspoe_keeps_results"

_guard = threading.Lock()
_listening = False


def listen_to_vector_stores() -> None:
    """Wrap every VectorStore class's searches, now and for classes defined later (once)."""
    global _listening
    with _guard:
        if _listening:
            return
        for cls in (VectorStore, *_subclasses(VectorStore)):
            _wrap_searches(cls)
        own = VectorStore.__dict__.get("__init_subclass__")  # a classmethod; None: inherited

        def wrap_new_class(cls: type[VectorStore], **kwargs: Any) -> None:
            if own is not None:
                own.__func__(cls, **kwargs)
            else:
                super(VectorStore, cls).__init_subclass__(**kwargs)
            _wrap_searches(cls)

        VectorStore.__init_subclass__ = classmethod(wrap_new_class)  # type: ignore[assignment,method-assign]
        _listening = True


def _subclasses(cls: type) -> Iterable[type]:
    subclass: type
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _subclasses(subclass)


def _wrap_searches(cls: type) -> None:
    """Wrap the searches `cls` defines itself as plain methods (inherited ones are wrapped where
    defined)."""
    for name in SEARCHES:
        method = cls.__dict__.get(name)
        if inspect.isfunction(method) and not getattr(method, _WRAPPED, False):
            setattr(cls, name, _keeping_results(method))


def _keeping_results(search: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(search):

        @functools.wraps(search)
        async def async_search(*args: Any, **kwargs: Any) -> Any:
            return _kept(await search(*args, **kwargs))

        wrapper: Callable[..., Any] = async_search
    else:

        @functools.wraps(search)
        def sync_search(*args: Any, **kwargs: Any) -> Any:
            return _kept(search(*args, **kwargs))

        wrapper = sync_search
    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _kept(results: Any) -> Any:
    if isinstance(results, list):
        documents = (item[0] if isinstance(item, tuple) and item else item for item in results)
        RETRIEVED.add(document.page_content for document in documents if isinstance(document, Document))
    return results
