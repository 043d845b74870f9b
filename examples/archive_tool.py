"""What the two agent examples share: the question, the search tool's name and description, and
the text the tool returns (one place, so both agents see the same tool)."""

from __future__ import annotations

from collections.abc import Iterable

QUESTION = "Who first lit the lamp of Gull Point Light?"
TOOL_NAME = "search_archive"
TOOL_DESCRIPTION = "Search the Skerrow Isles archive; returns the passages that best match the query."


def tool_result(passages: Iterable[str]) -> str:
    """The passages as the tool returns them, closed by a line that tells the model the search is
    done: without it Qwen2.5-Coder-1.5B answers a tool response by calling the tool again."""
    found = "\n\n".join(passages)
    return (
        f"Passages found for the query:\n\n{found}\n\n"
        "The search is done: answer the user's question from these passages, in one sentence."
    )
