"""Score one batch of a sweep into records: the unit of work of the local runner and of Ray workers.

A record holds the keys (method, position, example_id), where the gold document ended up in
the prompt (`prompt_position`, which differs from `position` under a prompt-level reordering),
and the metrics: `choice_correct`, `choice` and `choice_share` (forced choice; the share is the
gold's probability among the candidates), `gold_logprob` and `gold_tokens`
(teacher-forced log-likelihood of the gold answer), `match` and `prediction` (greedy answer);
`same_prompt_as` when the scores are those of an earlier record with the same prompt text
(`scored_prompts`); under a method that reorders documents, `documents_read` (the index among the
documents given of each one the model read, in order); under a reordering by a recorded ranking
(calibrated reordering), `ranking_attention` (its ranking pass) or `ranking_from` (the label whose
record held it: `rankings`).

What a label's method needs or does is asked of its config (`MethodConfig`: `reorders_documents`,
`reads_documents_as_a_set`, `recorded_ranking`, `shares_document_scores`), never which method it is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_mspoe.attention.reorder import documents_read, moved_slot
from rag_mspoe.engine.protocol import ScoresWhileGenerating
from rag_mspoe.engine.remote_engine import RemoteEngine
from rag_mspoe.eval.data import prompts
from rag_mspoe.eval.data.records import KVExample, with_gold_at
from rag_mspoe.eval.method_engines import Engines, stable_seed
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.scoring import model_scores
from rag_mspoe.eval.sweep.plan import Batch, Example, SweepConfig
from rag_mspoe.eval.sweep.rankings import (
    other_labels_prompts,
    ranking_of,
    ranks_documents,
    recorded_rankings,
    reordered_prompts,
)
from rag_mspoe.eval.sweep.scored_prompts import metric_fields, prompt_key, scored_prompts, unmodified_label
from rag_mspoe.methods.method_spec import ResolvedMethod
from rag_mspoe.prompts.chat_template import Prompt

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.methods.document_orders import RecordedRanking


def arranged_example(
    method: ResolvedMethod, example: Example, position: int, seed: int
) -> tuple[Example, int]:
    """The example with its gold at `position`, in the method's document order, and where the gold is now."""
    placed = with_gold_at(example, position)
    items: tuple[Any, ...] = placed.pairs if isinstance(placed, KVExample) else placed.documents
    ordered, indices = method.arrange(items, stable_seed(seed, example.id, position))
    if isinstance(placed, KVExample):
        arranged: Example = dataclasses.replace(placed, pairs=tuple(ordered))
    else:
        arranged = dataclasses.replace(placed, documents=tuple(ordered))
    return arranged, indices.index(position)


def prompt_of(example: Example, method: ResolvedMethod | None = None) -> list[dict[str, Any]]:
    """The example's prompt under `method`: one user message that says where its documents are.
    A method that reads the documents as a set (PINE) is told them so that each reads the same
    wherever it stands (`prompts.qa_prompt_with_spans`), or the gold's number would tell it where
    the gold is."""
    order_free = method is not None and method.method is not None and method.method.reads_documents_as_a_set()
    return prompts.prompt_message(example, order_free=order_free)


def reorders_documents(method: ResolvedMethod) -> bool:
    """Whether the label's rewriting reorders (or drops) the prompt's documents."""
    return method.method is not None and method.method.reorders_documents()


def model_engine(engine: EngineLike | RemoteEngine) -> EngineLike:
    """The engine of a label whose rewriting runs the model itself (a ranking pass), which only a
    local engine has: a remote one refuses such labels before the run starts."""
    assert not isinstance(engine, RemoteEngine)
    return engine


def distinct_prompts(
    todo: Sequence[int], records: Sequence[dict[str, Any]], read: Sequence[Prompt]
) -> tuple[list[int], dict[int, int]]:
    """The items of `todo` whose prompt (for their example) no earlier item of `todo` has, and
    each other item's index -> the index of the earlier item with its prompt."""
    first: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
    distinct, copies = [], {}
    for index in todo:
        key = (records[index]["example_id"], prompt_key(read[index]))
        if key in first:
            copies[index] = first[key]
        else:
            first[key] = index
            distinct.append(index)
    return distinct, copies


def candidates_of(example: Example) -> tuple[tuple[str, ...], str]:
    """(answer options in the context, the gold one) for forced choice."""
    if isinstance(example, KVExample):
        return tuple(value for _, value in example.pairs), example.value
    return example.candidates, example.answers[0]


def gold_answer(example: Example) -> str:
    return example.value if isinstance(example, KVExample) else example.answers[0]


class BatchScorer:
    """Holds the engines (one per model variant) and the examples; scores batches.

    results: the run's results file; items of a method that rewrites prompts whose rewritten prompt
    the unmodified model already scored there take those scores (`scored_prompts`).
    """

    def __init__(
        self,
        config: SweepConfig,
        examples: Sequence[Example],
        methods: Sequence[ResolvedMethod],
        engines: Engines,
        results: Path | None = None,
    ) -> None:
        self.config = config
        self.examples = list(examples)
        self.methods = {m.name: m for m in methods}
        self.engines = engines
        self.results = results
        self.unmodified = unmodified_label(methods)
        self.ranking_labels = [name for name, other in self.methods.items() if ranks_documents(other)]

    def score(self, batch: Batch) -> list[dict[str, Any]]:
        method = self.methods[batch.method]
        engine = self.engines.engine_for(method)
        started = time.perf_counter()
        arranged = [
            arranged_example(method, self.examples[index], position, self.config.seed)
            for position, index in batch.items
        ]
        texts = [prompt_of(example, method) for example, _ in arranged]
        records: list[dict[str, Any]] = [
            {
                "method": method.name,
                "position": position,
                "example_id": self.examples[index].id,
                "prompt_position": prompt_position,
                "prompt_tokens": engine.count_tokens(text),
            }
            for (position, index), (_, prompt_position), text in zip(
                batch.items, arranged, texts, strict=True
            )
        ]
        # A method that rewrites prompts does it once here; the unmodified model then reads them.
        rewrites = method.method is not None and method.method.rewrites_prompt()
        done = self._done_records() if rewrites else []  # read once: other workers may have added some
        ranking = ranking_of(method)
        if ranking is not None:
            run_method, read = None, self._reordered(model_engine(engine), ranking, texts, records, done)
        else:
            run_method, read = engine.rewritten(texts, method=method.method)
        todo = list(range(len(records)))
        if rewrites:
            for record, original, rewritten in zip(records, texts, read, strict=True):
                record["prompt_position"] = moved_slot(original, rewritten, record["prompt_position"])
                if reorders_documents(method):
                    record["documents_read"] = list(documents_read(original, rewritten))
            if run_method is None:  # the unmodified model reads the new prompts, as it did before
                todo = self._take_scored(engine, batch, texts, records, read, done)
        # A rewriting that writes one prompt for several of the batch's items (position-invariant
        # ranking writes the same one at every gold position) has the model read it once.
        todo, copies = distinct_prompts(todo, records, read) if rewrites else (todo, {})
        examples = [arranged[i][0] for i in todo]
        self._score(engine, run_method, examples, [read[i] for i in todo], [records[i] for i in todo])
        fields = metric_fields(self.config.metrics)
        for index, source in copies.items():
            records[index].update({name: records[source][name] for name in fields})
            records[index]["same_prompt_as"] = [method.name, records[source]["position"]]
        seconds = (time.perf_counter() - started) / len(records)
        for record in records:
            record["seconds"] = round(seconds, 4)
        return records

    def _done_records(self) -> list[dict[str, Any]]:
        """The run's records so far (none without a results file)."""
        return read_records(self.results) if self.results is not None and self.results.exists() else []

    def _reordered(
        self,
        engine: EngineLike,
        ranking: RecordedRanking,
        texts: Sequence[Prompt],
        records: list[dict[str, Any]],
        done: Sequence[dict[str, Any]],
    ) -> list[Prompt]:
        """A recorded ranking's prompts, ranked from the attention any of the run's labels that rank
        so recorded for the item, or from a ranking pass recorded now (`rankings`)."""
        keys = {(record["position"], record["example_id"]) for record in records}
        recorded = recorded_rankings(done, self.ranking_labels, keys)
        return reordered_prompts(engine, ranking, texts, records, recorded)

    def _take_scored(
        self,
        engine: EngineLike | RemoteEngine,
        batch: Batch,
        texts: Sequence[Prompt],
        records: list[dict[str, Any]],
        read: Sequence[Prompt],
        done: Sequence[dict[str, Any]],
    ) -> list[int]:
        """Fill in the items whose prompt the unmodified model already read in this run, as the
        unmodified label's prompt at any gold position of the example or as another calibrated
        reordering's at the same one; the indices of the others."""
        if not done:
            return list(range(len(records)))
        candidates: dict[tuple[str, int, str], Prompt] = {}
        indices = sorted({index for _, index in batch.items})
        if self.unmodified is not None:
            base = self.methods[self.unmodified]
            for index in indices:
                for position in self.config.positions:
                    example = arranged_example(base, self.examples[index], position, self.config.seed)[0]
                    candidates[self.unmodified, position, self.examples[index].id] = prompt_of(example)
        # The other reorderings take the documents in the order given, as this batch's prompts do
        # when its label does too: those are then the prompts they reordered.
        given = self.methods[batch.method].order == "given"
        others: dict[str, RecordedRanking] = {
            name: ranking
            for name, other in self.methods.items()
            if given and name != batch.method and (ranking := ranking_of(other)) is not None
        }
        if others:
            candidates.update(
                other_labels_prompts(model_engine(engine), others, texts, records, done, self.ranking_labels)
            )
        candidates.update(self._shared_score_prompts(engine, batch, done))
        known = scored_prompts(done, candidates)
        fields = metric_fields(self.config.metrics)
        todo = []
        for number, (record, prompt) in enumerate(zip(records, read, strict=True)):
            earlier = known.get(prompt_key(prompt))
            if earlier is None or any(name not in earlier for name in fields):
                todo.append(number)
                continue
            record.update({name: earlier[name] for name in fields})
            record["same_prompt_as"] = [earlier["method"], earlier["position"]]
        return todo

    def _shared_score_prompts(
        self, engine: EngineLike | RemoteEngine, batch: Batch, done: Sequence[dict[str, Any]]
    ) -> dict[tuple[str, int, str], Prompt]:
        """(label, position, example id) -> the prompt that each of the run's labels that ranks
        documents by the batch's per-document scores (its own label too) read for the batch's
        examples, at every gold position it scored. The batch has just scored these documents, and
        the engine keeps each document's score, so rewriting them runs no model."""
        own = self.methods[batch.method].method
        alike = {
            name: other
            for name, other in self.methods.items()
            if own is not None and other.method is not None and own.shares_document_scores(other.method)
        }
        if not alike:
            return {}
        scored = {(r["method"], r["position"], r["example_id"]): r for r in done if r["method"] in alike}
        prompts: dict[tuple[str, int, str], Prompt] = {}
        for index in sorted({index for _, index in batch.items}):
            example = self.examples[index]
            for position in self.config.positions:
                for name, other in alike.items():
                    record = scored.get((name, position, example.id))
                    if record is None:
                        continue
                    placed = arranged_example(other, example, position, self.config.seed)[0]
                    text = prompt_of(placed)
                    _, (prompt,) = engine.rewritten([text], method=other.method)
                    # A record from another build may have ranked differently (its scores rounded
                    # otherwise): only a prompt whose documents it read in this order is offered.
                    if record.get("documents_read") == list(documents_read(text, prompt)):
                        prompts[name, position, example.id] = prompt
        return prompts

    def _score(
        self,
        engine: EngineLike | RemoteEngine,
        method: Any,
        examples: list[Example],
        texts: list[Prompt],
        records: list[dict[str, Any]],
    ) -> None:
        if not records:
            return
        metrics = self.config.metrics
        # The gold answer's log-likelihood from the prefill generation makes, where the engine can.
        together = {"generate", "loglik"} <= set(metrics) and "choice" not in metrics
        together = together and isinstance(engine, ScoresWhileGenerating)
        if "generate" in metrics:
            scored = model_scores.score_generation(
                engine,
                texts,
                examples,
                method=method,
                max_new_tokens=self.config.max_new_tokens,
                batch_size=self.config.decode_batch,
                gold=[gold_answer(example) for example in examples] if together else None,
            )
            for record, result in zip(records, scored, strict=True):
                record["prediction"] = result["prediction"]
                record["match"] = float(result["correct"])
                if together:
                    record["gold_logprob"] = float(result["gold_logprob"])
                    record["gold_tokens"] = int(result["gold_tokens"])
        if not together and ("choice" in metrics or "loglik" in metrics):
            self._score_answers(engine, method, examples, texts, records)

    def _score_answers(
        self,
        engine: EngineLike | RemoteEngine,
        method: Any,
        examples: list[Example],
        texts: Sequence[Prompt],
        records: list[dict[str, Any]],
    ) -> None:
        """Forced choice (with the gold's log-likelihood), or the gold's log-likelihood alone, of
        every item at once: prompts of one example share their start (`Engine.score_prompts`)."""
        choice = "choice" in self.config.metrics
        options = [
            model_scores.checked_candidates(*candidates_of(example))
            if choice
            else [model_scores.checked_answer(gold_answer(example))]
            for example in examples
        ]
        scored = engine.score_prompts(list(zip(texts, options, strict=True)), method=method)
        for record, example, option_list, scores in zip(records, examples, options, scored, strict=True):
            if choice:
                picked = model_scores.forced_choice(option_list, candidates_of(example)[1], scores)
                record["choice"] = picked["choice"]
                record["choice_correct"] = float(picked["correct"])
                record["choice_share"] = float(picked["gold_share"])
                record["gold_logprob"] = float(picked["gold_sum"])
                record["gold_tokens"] = int(picked["gold_tokens"])
            else:
                ((total, tokens),) = scores
                record["gold_logprob"] = float(total)
                record["gold_tokens"] = int(tokens)
