"""A sweep whose model runs on an OpenAI-compatible server (`rag-mspoe sweep --endpoint URL`).

The batches, records, resumption and report are the local sweep's: only the engine differs
(`rag_mspoe.engine.remote_engine.RemoteEngine` in place of the local one, through the same calls).
At the start one probe asks whether the server scores a prompt's own tokens; the methods and
metrics that cannot run against it are refused then, with what can.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe.engine.remote_client import Endpoint, RemoteClient, RequestBudgetSpent
from rag_mspoe.engine.remote_engine import (
    UNSCORED_METHODS,
    RemoteEngine,
    load_tokenizer,
    remote_method_problem,
)
from rag_mspoe.eval.runs.loop import RunStopped
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.methods.method_spec import ResolvedMethod

CHAT_ENDPOINT = "server-chat"


@dataclass(frozen=True)
class RemoteTarget:
    """The endpoint a sweep runs against, and the tokenizer (a folder, hub id or embedded model's
    name) that renders its prompts; None: the server's chat endpoint renders them."""

    endpoint: Endpoint
    tokenizer: str | None = None

    @property
    def template(self) -> str:
        """Which chat template the records were made with, as the run's settings keep it."""
        return f"tokenizer:{self.tokenizer}" if self.tokenizer else CHAT_ENDPOINT


class RemoteEngines:
    """The one remote engine, for every method (the server's model is never modified)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine

    def engine_for(self, method: ResolvedMethod) -> RemoteEngine:
        return self.engine


@dataclass
class RemoteRun:
    """A connected remote engine, what the probe found, and what the manifest says of it."""

    engine: RemoteEngine
    prompt_scores: bool  # the server scores prompt tokens and a local tokenizer renders prompts

    def facts(self) -> dict[str, Any]:
        endpoint = self.engine.client.endpoint
        return {
            "name": endpoint.model,
            "endpoint": endpoint.base,
            "chat_template": self.engine.template,
            "prompt_logprobs": self.prompt_scores,
            "concurrency": endpoint.concurrency,
            "max_requests": endpoint.max_requests,
        }

    def scorer(self, score: Scorer) -> Scorer:
        """`score`, with a spent request budget stopping the run (resumable) instead of failing it."""

        def scored(unit: Any) -> list[dict[str, Any]]:
            try:
                return score(unit)
            except RequestBudgetSpent as exc:
                raise RunStopped(str(exc)) from exc

        return scored


def connect(target: RemoteTarget, methods: Sequence[ResolvedMethod], metrics: Sequence[str]) -> RemoteRun:
    """Load the tokenizer, probe the server once, and refuse what cannot run against it."""
    client = RemoteClient(target.endpoint)
    tokenizer = None if target.tokenizer is None else load_tokenizer(target.tokenizer)
    engine = RemoteEngine(client, tokenizer, target.tokenizer)
    refused = [m.name for m in methods if m.rope]
    if refused:
        raise ValueError(
            f"{refused} need a model variant (another RoPE type), which a remote server does not let us "
            "build; run them locally."
        )
    scores = engine.scores_prompts  # the probe, once: the engine keeps what it found
    if not scores:
        why = (
            "no --tokenizer renders the prompts (the chat endpoint cannot score them)"
            if tokenizer is None
            else f"{target.endpoint.base} gives no log-probabilities of prompt tokens (echo with logprobs)"
        )
        print(
            f"Only --metrics generate and the methods {UNSCORED_METHODS} can run here: {why}.",
            file=sys.stderr,
        )
        scored_metrics = [m for m in metrics if m != "generate"]
        if scored_metrics:
            raise ValueError(
                f"--metrics {' '.join(scored_metrics)} need prompt log-probabilities, and {why}; "
                "use --metrics generate."
            )
    problems = [f"{m.name}: {p}" for m in methods if (p := remote_method_problem(m.method, scores))]
    if problems:
        raise ValueError("; ".join(problems) + ".")
    return RemoteRun(engine, scores)
