"""LongContextReorder's arrangement of documents: the best at both ends, the weakest in the middle.

Used by the packer of the RAG pipelines and by the methods that put documents in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def long_context_reorder(items: Sequence[T]) -> list[T]:
    """Given items best first, put the best ones at both ends and the weakest in the middle.

    The same arrangement as LangChain's and LlamaIndex's LongContextReorder: walking from the
    weakest item, items go alternately to the front and to the back (5 items: 1 3 5 4 2).
    """
    weakest_first = list(items)[::-1]
    return weakest_first[0::2][::-1] + weakest_first[1::2]
