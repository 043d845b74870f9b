"""What a gold-position sweep is: its settings, its examples and its units of work.

A sweep scores every (method, gold position, example). The examples are the same for every
method and position, so methods can be compared pairwise on them. Work comes in batches of
one method and every position of a few examples, ordered example chunk first, so a run that
stops early has every method and position scored on the same first examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from rag_mspoe.eval.data.records import KVExample, QAExample, gold_index

Task = Literal["qa", "kv"]
METRICS = ("choice", "loglik", "generate")
GENERATORS = ("invented-qa", "kv", "kv-short")
Example: TypeAlias = QAExample | KVExample


@dataclass(frozen=True)
class SweepConfig:
    """Everything that decides which records a sweep writes (the run folder must keep them equal).

    data: a QA or KV examples file; None draws examples from `generator` with `seed`.
    num_documents: documents (QA) or key-value pairs (KV) per prompt.
    metrics: "choice" (forced choice among the answer candidates in the context, with the gold
    answer's log-likelihood), "loglik" (the gold answer's log-likelihood only), "generate"
    (greedy answer scored by best_subspan_em, or by KV match).
    decode_batch: answers of a batch decoded together by "generate" (on the CPU each prompt is
    prefilled alone, then the rows decode as one batch: `rag_mspoe.engine.joined_decode`); it
    changes speed, not records, so a run may resume with another.
    """

    task: Task = "qa"
    num_documents: int = 10
    positions: tuple[int, ...] = (0, 4, 9)
    methods: tuple[str, ...] = ("none",)
    samples: int = 100
    data: str | None = None
    generator: str | None = "invented-qa"
    distractor_similarity: float = 0.5
    seed: int = 0
    metrics: tuple[str, ...] = ("choice",)
    max_new_tokens: int = 100
    batch_size: int = 8
    decode_batch: int = 8
    model: str | None = None  # None: the embedded model; with `endpoint`, the served model's name
    endpoint: str | None = None  # an OpenAI-compatible server's base URL (None: the model runs here)
    template: str | None = None  # against an endpoint: which chat template renders the prompts
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes kept in the manifest

    def __post_init__(self) -> None:
        for name in ("positions", "methods", "metrics"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.task not in ("qa", "kv"):
            raise ValueError(f"task must be 'qa' or 'kv', got {self.task!r}.")
        if self.num_documents < 2:
            raise ValueError(f"num_documents must be at least 2, got {self.num_documents}.")
        bad = [p for p in self.positions if not 0 <= p < self.num_documents]
        if bad or not self.positions:
            raise ValueError(
                f"Gold positions {bad or 'none'} are not in 0..{self.num_documents - 1}; "
                "give positions counted from 0 within the document count."
            )
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown or not self.metrics:
            raise ValueError(f"Unknown metrics {unknown}; choose from {', '.join(METRICS)}.")
        if self.data is None and self.generator not in GENERATORS:
            raise ValueError(
                f"Give a data file or a generator ({', '.join(GENERATORS)}), got {self.generator!r}."
            )
        if self.data is None and (self.generator == "invented-qa") != (self.task == "qa"):
            raise ValueError(f"Generator {self.generator!r} does not make {self.task!r} examples.")
        if self.samples < 1 or self.batch_size < 1 or self.decode_batch < 1:
            raise ValueError("samples, batch_size and decode_batch must be at least 1.")

    # What must match for a run folder to be resumed; methods and positions may grow.
    IDENTITY = (
        "task",
        "num_documents",
        "samples",
        "data",
        "generator",
        "distractor_similarity",
        "seed",
        "metrics",
        "max_new_tokens",
        "model",
        "endpoint",
        "template",
    )


def load_examples(config: SweepConfig) -> list[Example]:
    """The sweep's examples: the first `samples` of the data file, or drawn from the generator."""
    from rag_mspoe.eval.data import loaders, synthetic

    examples: Sequence[Example]
    if config.data is not None:
        examples = (loaders.load_qa if config.task == "qa" else loaders.load_kv)(config.data)
        if len(examples) < config.samples:
            raise ValueError(
                f"{config.data} holds {len(examples)} examples, fewer than samples={config.samples}; "
                "lower --samples."
            )
        examples = [_fit(ex, config.num_documents, config.data) for ex in examples[: config.samples]]
    elif config.generator == "invented-qa":
        examples = synthetic.generate_invented_qa(
            config.num_documents, config.samples, config.seed, config.distractor_similarity
        )
    else:
        examples = synthetic.generate_kv(
            config.num_documents, config.samples, config.seed, short_keys=config.generator == "kv-short"
        )
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("Example ids repeat; records are keyed by id, so give every example its own.")
    if "choice" in config.metrics and isinstance(examples[0], QAExample):
        missing = [ex.id for ex in examples if isinstance(ex, QAExample) and not ex.candidates]
        if missing:
            raise ValueError(
                f"Forced choice needs answer candidates, and {len(missing)} examples (e.g. {missing[0]!r}) "
                "have none; use --metrics generate or loglik, or data with 'candidates'."
            )
    return list(examples)


def _fit(example: Example, count: int, source: str) -> Example:
    """Keep the gold item and the first count - 1 others, in their order."""
    items: tuple[Any, ...] = example.pairs if isinstance(example, KVExample) else example.documents
    gold = gold_index(example)
    if gold is None:
        raise ValueError(f"{source}: example {example.id!r} has no gold document; mark one with isgold.")
    if len(items) < count:
        raise ValueError(
            f"{source}: example {example.id!r} has {len(items)} documents, fewer than --documents {count}."
        )
    others = [i for i in range(len(items)) if i != gold][: count - 1]
    kept = tuple(items[i] for i in sorted([gold, *others]))
    if isinstance(example, KVExample):
        return dataclasses.replace(example, pairs=kept)
    return dataclasses.replace(example, documents=kept)


@dataclass(frozen=True)
class Batch:
    """Items of one method scored together: (gold position, example index) pairs."""

    method: str
    items: tuple[tuple[int, int], ...]

    @property
    def examples(self) -> frozenset[int]:
        """The indices of the examples it scores."""
        return frozenset(index for _, index in self.items)


def plan_batches(
    num_examples: int, methods: Sequence[str], positions: Sequence[int], batch_size: int
) -> Iterator[Batch]:
    """Every (method, position, example) once, example chunks outermost (see the module docstring).

    A batch holds every position of its examples (batch_size // positions of them, at least one),
    so their prompts, identical up to the earliest gold position, are scored together and share
    that start.
    """
    per_batch = max(1, batch_size // len(positions))
    for start in range(0, num_examples, batch_size):
        chunk = range(start, min(start + batch_size, num_examples))
        for method in methods:
            for first in range(chunk.start, chunk.stop, per_batch):
                examples = range(first, min(first + per_batch, chunk.stop))
                yield Batch(method, tuple((position, index) for index in examples for position in positions))
