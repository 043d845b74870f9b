"""Records a sweep already holds, looked up by the text of their prompt.

A method that rewrites its prompt before the unmodified model reads it (calibrated reordering)
often writes, character for character, a prompt the unmodified model has read at another gold
position of the same example: the gold document moved to the front of the example with its gold
at position 4 is that example's prompt with its gold at position 0; and a variant of it (another
margin, band or strength) mostly writes what the run's first calibrated reordering wrote for the
same item. The item then takes that record's scores instead of running the model again on the
same text, and says so (`same_prompt_as`: the label and gold position it took them from). The
run's settings are one for all its records, so the scores are the ones the model would give again
(up to the rounding of a different batch, as between any two batches of a run).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rag_mspoe.methods.method_spec import ResolvedMethod
from rag_mspoe.prompts.chat_template import Prompt, as_messages

# The fields each metric writes into a record (see batch_scorer).
METRIC_FIELDS = {
    "generate": ("prediction", "match"),
    "loglik": ("gold_logprob", "gold_tokens"),
    "choice": ("choice", "choice_correct", "choice_share", "gold_logprob", "gold_tokens"),
}


def unmodified_label(methods: Iterable[ResolvedMethod]) -> str | None:
    """The label of a method that is the unmodified model on the documents as given, if any."""
    for method in methods:
        if method.method is None and not method.rope and method.order == "given":
            return method.name
    return None


def prompt_key(prompt: Prompt) -> tuple[tuple[str, str], ...]:
    """What the model reads of a prompt: each message's role and text."""
    return tuple((str(message["role"]), str(message["content"])) for message in as_messages(prompt))


def metric_fields(metrics: Sequence[str]) -> list[str]:
    fields: list[str] = []
    for metric in metrics:
        fields += [name for name in METRIC_FIELDS[metric] if name not in fields]
    return fields


def scored_prompts(
    records: Iterable[dict[str, Any]], prompts: Mapping[tuple[str, int, str], Prompt]
) -> dict[tuple[tuple[str, str], ...], dict[str, Any]]:
    """The records whose (label, position, example id) is in `prompts`, keyed by the text of their
    prompt there; the first such record of a text when several labels read it."""
    found: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for record in records:
        key = (record["method"], record["position"], record["example_id"])
        if key in prompts:
            found.setdefault(prompt_key(prompts[key]), record)
    return found
