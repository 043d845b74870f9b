"""Calibrated reordering in a sweep: each item's ranking pass is recorded with it and read back.

The method's ranking pass (`RecordedRanking.ranking_attention`, which a method such as
`CalibratedReorder` offers through `MethodConfig.recorded_ranking`) keeps the attention of every
layer, and what its settings decide (layer band, bias strength, margin, placement) is computed from
that record alone. A sweep stores it with the item (`ranking_attention`, [layers][documents],
rounded to float32's precision), and a second calibrated-reordering label of the same run reads
it instead of running the pass again (`ranking_from`: the label it read it from); the prompts the
labels wrote are rebuilt from it, so a variant's item whose prompt another label already scored
takes those scores (`scored_prompts`): a variant costs only the answers to its new prompts. Both
the label that records the attention and the ones that read it rank from the rounded numbers, so
a rerun orders alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rag_mspoe.methods.method_spec import ResolvedMethod
from rag_mspoe.prompts.chat_template import Prompt

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.methods.document_orders import RecordedRanking

FIELD = "ranking_attention"
SIGNIFICANT_DIGITS = 7  # float32 holds about 7 significant decimal digits


def ranking_of(method: ResolvedMethod) -> RecordedRanking | None:
    """What ranks the label's documents, when it reorders the documents as given by a ranking pass
    that a record can hold (None for every other label)."""
    if method.method is None or method.order != "given":
        return None
    return method.method.recorded_ranking()


def ranks_documents(method: ResolvedMethod) -> bool:
    """Whether the label reorders by a recorded ranking of the documents as given."""
    return ranking_of(method) is not None


def recorded_rankings(
    records: Iterable[dict[str, Any]], labels: Iterable[str], keys: set[tuple[int, str]]
) -> dict[tuple[int, str], tuple[str, list[list[float]]]]:
    """(position, example id) -> (label, ranking attention) for the `records` of `labels` that carry
    one (the run's records read afresh: other workers may have added some)."""
    wanted = set(labels)
    found = {}
    for record in records:
        key = (record["position"], record["example_id"])
        if record["method"] in wanted and key in keys and FIELD in record:
            found[key] = (record["method"], record[FIELD])
    return found


def reordered_prompts(
    engine: EngineLike,
    method: RecordedRanking,
    texts: Sequence[Prompt],
    records: Sequence[dict[str, Any]],
    recorded: dict[tuple[int, str], tuple[str, list[list[float]]]],
) -> list[Prompt]:
    """The prompts the unmodified model reads under `method`: each ranked from its recorded
    attention when another label recorded it, else from a ranking pass recorded into its record."""
    read = []
    for text, record in zip(texts, records, strict=True):
        earlier = recorded.get((record["position"], record["example_id"]))
        if earlier is not None:
            record["ranking_from"] = earlier[0]
            attention = earlier[1]
        else:
            computed = method.ranking_attention(engine, text)
            if computed is None:  # fewer than two documents: nothing to reorder
                read.append(text)
                continue
            attention = [
                [float(f"{value:.{SIGNIFICANT_DIGITS}g}") for value in row] for row in computed.tolist()
            ]
            record[FIELD] = attention
        read.append(method.reordered(engine, text, torch.tensor(attention)))
    return read


def other_labels_prompts(
    engine: EngineLike,
    others: Mapping[str, RecordedRanking],
    texts: Sequence[Prompt],
    records: Sequence[dict[str, Any]],
    done: Sequence[dict[str, Any]],
    ranking_labels: Iterable[str],
) -> dict[tuple[str, int, str], Prompt]:
    """(label, position, example id) -> the prompt each of the run's `others` calibrated reorderings
    read for the batch's items, rebuilt from the recorded ranking attention (no model run). The
    labels' documents come in the order given, so each item's prompt before reordering is the
    batch's own (`texts`)."""
    if not others:
        return {}
    keys = {(record["position"], record["example_id"]) for record in records}
    # This batch's own ranking passes count too: an item the run ranked only now.
    attention = recorded_rankings([*done, *records], ranking_labels, keys)
    scored = {(r["method"], r["position"], r["example_id"]) for r in done if r["method"] in others}
    prompts = {}
    for text, record in zip(texts, records, strict=True):
        key = (record["position"], record["example_id"])
        for name, method in others.items():
            if (name, *key) in scored and key in attention:
                ranking = torch.tensor(attention[key][1])
                prompts[(name, *key)] = method.reordered(engine, text, ranking)
    return prompts
