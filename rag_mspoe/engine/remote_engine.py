"""An engine whose model runs on an OpenAI-compatible server: greedy answers, teacher-forced
scores of answers, and the methods that need only text and log-probabilities.

    engine = RemoteEngine(RemoteClient(Endpoint(url, "smollm2")), tokenizer=tokenizer)
    engine.score_prompts([(messages, ["Paris", "Rome"])])    # [[(sum of log-probs, tokens), ...]]

The chat template comes from one of two places, recorded as `template`:
- a local tokenizer of the served model renders every prompt, which goes to /v1/completions as
  text: answers are scored from the server's log-probabilities of the prompt's own tokens (echo),
  exactly the tokens the local engine scores (those after the point where the answer changes the
  prompt's tokenization), and `invariant-reorder` ranks documents the same way;
- without one, the server's /v1/chat/completions applies its own template: greedy answers only.

A method that hooks the model (RoPE rescaling, attention changes) cannot run on someone else's
server; `remote_method_problem` says which ones can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe.attention.invariant_reorder import InvariantReorder
from rag_mspoe.attention.reorder import document_texts, prompt_with_documents
from rag_mspoe.engine.prefix_scoring import Score, shared_length
from rag_mspoe.engine.remote_client import RemoteClient, prompt_logprobs
from rag_mspoe.methods.method_config import method_name
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS, Prompt, as_messages, render_text
from rag_mspoe.prompts.document_prompts import find_document_lines

# What runs on a remote model: these method specs, alone or with a document order.
REMOTE_METHODS = "none, longcontextreorder, random, invariant-reorder (score 'question', any keep/best)"
# Those that need no scores of the prompt's tokens (what a server without echo logprobs allows).
UNSCORED_METHODS = "none, longcontextreorder, random"


def remote_method_problem(method: Any, prompt_scores: bool) -> str | None:
    """Why a rescaling config cannot run against a remote model (None: it can).

    prompt_scores: whether the server gives log-probabilities of a prompt's own tokens and a
    local tokenizer renders the prompts."""
    if method is None:
        return None
    if isinstance(method, InvariantReorder) and method.score == "question":
        if prompt_scores:
            return None
        return (
            f"{method_name(method)} ranks documents by log-probabilities of prompt tokens, which this "
            f"endpoint (or the chat endpoint without --tokenizer) does not give; these can run: "
            f"{UNSCORED_METHODS}"
        )
    return (
        f"{method_name(method)} changes the model itself, which a remote server does not let us do; "
        f"against an endpoint these run: {REMOTE_METHODS if prompt_scores else UNSCORED_METHODS}"
    )


@dataclass(frozen=True)
class RemoteAnswer:
    """A greedy answer, as far as the sweep reads it."""

    text: str


class RemoteEngine:
    """Generation and scoring through a `RemoteClient` (see the module docstring).

    tokenizer: the served model's tokenizer, whose chat template renders the prompts (None: the
    server's chat endpoint renders them, and only generation works). tokenizer_name: how the run
    manifest names it.
    """

    def __init__(self, client: RemoteClient, tokenizer: Any = None, tokenizer_name: str | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.name = client.endpoint.model
        self.template = (
            f"local tokenizer {tokenizer_name or getattr(tokenizer, 'name_or_path', '?')}"
            if tokenizer is not None
            else "the server's chat endpoint"
        )
        self._document_scores: dict[str, float] = {}  # a one-document prompt's text -> its score

    # -- what the sweep calls ------------------------------------------------------------------------
    def count_tokens(self, prompt: Prompt) -> int | None:
        """Tokens of the rendered prompt by the local tokenizer (None without one)."""
        if self.tokenizer is None:
            return None
        return len(self._plain(self.rendered(prompt))["input_ids"])

    def rewritten(self, prompts: Sequence[Prompt], *, method: Any = None) -> tuple[None, list[Prompt]]:
        """The prompts the remote model reads under `method` (the remote model is always unmodified)."""
        problem = remote_method_problem(method, self.tokenizer is not None)
        if problem is not None:
            raise ValueError(problem)
        if method is None:
            return None, list(prompts)
        return None, [self._invariant_order(method, prompt) for prompt in prompts]

    def generate_batch(
        self, prompts: Sequence[Prompt], *, max_new_tokens: int, stop: Sequence[str] = (), method: Any = None
    ) -> list[RemoteAnswer]:
        """Greedy answers, the prompts sent concurrently."""
        self._unmodified(method)
        return self.client.map(lambda prompt: self._generate(prompt, max_new_tokens, list(stop)), prompts)

    def score_prompts(
        self, items: Sequence[tuple[Prompt, Sequence[str]]], *, method: Any = None
    ) -> list[list[Score]]:
        """(sum of log-probabilities, tokens) of each continuation as the reply to its prompt."""
        self._unmodified(method)
        self._need_tokenizer("Scoring answers")
        flat = [(prompt, text) for prompt, texts in items for text in texts]
        scores = iter(self.client.map(lambda pair: self._score(*pair), flat))
        return [[next(scores) for _ in texts] for _, texts in items]

    # -- internals -----------------------------------------------------------------------------------
    def rendered(self, prompt: Prompt) -> str:
        """The chat template's text of a prompt, the assistant turn opened."""
        self._need_tokenizer("Rendering a prompt")
        return render_text(self.tokenizer, prompt)

    def _generate(self, prompt: Prompt, max_new_tokens: int, stop: list[str]) -> RemoteAnswer:
        settings: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": 0}
        if stop:
            settings["stop"] = stop
        if self.tokenizer is None:
            messages = [{k: v for k, v in m.items() if k != DOCUMENT_SPANS} for m in as_messages(prompt)]
            answer = self.client.post("/chat/completions", {"messages": messages, **settings})
            return RemoteAnswer(answer["choices"][0]["message"]["content"] or "")
        answer = self.client.post("/completions", {"prompt": self.rendered(prompt), **settings})
        return RemoteAnswer(answer["choices"][0]["text"])

    def _score(self, prompt: Prompt, continuation: str) -> Score:
        """As `Engine.score_continuations` scores one continuation: the tokens from the first one
        the continuation changes (never the very first)."""
        context = self.rendered(prompt)
        context_ids = self._plain(context)["input_ids"]
        ids = self._plain(context + continuation)["input_ids"]
        return self._sum_of_last(
            context + continuation, len(ids), len(ids) - max(1, shared_length(context_ids, ids))
        )

    def _sum_of_last(self, text: str, tokens: int, count: int) -> Score:
        """(sum, count) of the server's log-probabilities of the last `count` tokens of `text`, which
        the local tokenizer splits into `tokens` tokens. Counted from the end: servers disagree on
        the text offsets of special tokens, not on the tokens."""
        values = prompt_logprobs(self.client, text)
        if len(values) not in (tokens, tokens + 1):  # + 1: a BOS token the server adds
            raise ValueError(
                f"{self.client.endpoint.base} splits the prompt into {len(values)} tokens, the "
                f"{self.template} into {tokens}; name the served model's own tokenizer with --tokenizer."
            )
        scored = values[len(values) - count :]
        if any(value is None for value in scored):
            raise ValueError(
                f"{self.client.endpoint.base} gave no log-probability for some prompt tokens; it does not "
                "score prompts (echo with logprobs), so use --metrics generate."
            )
        return sum(value for value in scored if value is not None), count

    def _invariant_order(self, method: InvariantReorder, prompt: Prompt) -> Prompt:
        """`InvariantReorder.rewrite` with each document's score from the server: the log-likelihood
        of everything after the document in a prompt that holds it alone."""
        texts = document_texts(prompt)
        if len(texts) < 2:
            return prompt
        singles = [prompt_with_documents(prompt, [k]) for k in range(len(texts))]
        scores = self.client.map(self._document_score, singles)
        return prompt_with_documents(prompt, method.order(scores, texts))

    def _document_score(self, single: list[dict[str, Any]]) -> float:
        text = self.rendered(single)
        if text not in self._document_scores:  # the same document alone: the same prompt
            starts = [start for start, _ in self._plain(text, return_offsets_mapping=True)["offset_mapping"]]
            end = document_end(text, single)
            after = sum(1 for start in starts if start >= end)  # the tokens after the document's last one
            self._document_scores[text] = self._sum_of_last(text, len(starts), after)[0]
        return self._document_scores[text]

    def _plain(self, text: str, **options: Any) -> Any:
        # The server tokenizes the rendered text as plain text, template markers included.
        return self.tokenizer(text, add_special_tokens=False, **options)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs the model's chat template here; name the served model's tokenizer "
                "with --tokenizer (a folder, hub id or embedded model name)."
            )

    def _unmodified(self, method: Any) -> None:
        if method is not None:
            raise ValueError(remote_method_problem(method, True) or f"{method_name(method)} rewrote prompts")


def document_end(rendered: str, prompt: Prompt) -> int:
    """Where the prompt's last document ends in its rendered text (a character offset)."""
    for message in reversed(as_messages(prompt)):
        spans = message.get(DOCUMENT_SPANS)
        if spans is None and message["role"] in ("user", "system"):
            spans = find_document_lines(message["content"])
        if spans:
            base = rendered.rfind(message["content"])
            if base < 0:
                raise ValueError(
                    "The chat template changed the text of the message with the documents, so where "
                    "they end cannot be found in the rendered prompt."
                )
            return base + int(spans[-1][1])
    raise ValueError("The prompt has no documents to rank.")
