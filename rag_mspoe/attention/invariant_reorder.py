"""Position-invariant reordering: each document is ranked while the model reads it alone, and the
model answers from the documents sorted by that rank, so its answer does not depend on the order
the documents came in.

A document is scored on the prompt that holds it and no other document. By default the score is
how well it predicts what follows it, the question: the log-likelihood of the tokens after the
document (zero-shot reranking by question likelihood, as in UPR, Sachan et al., 2022). Or the
model is asked, after that prompt, whether the document answers the question, and the score is
how much more likely its reply starts with yes than with no ("judge"); or both, each standardised
over the prompt's documents and summed ("question+judge"); or the attention the question rows give
the document, averaged over heads and a band of layers. That prompt is the same whatever the
document's place was (its 'Document [i]' number is rewritten to 1), so the score depends on the
document, the question and the template only, and so does the sorted prompt: under this method
every order of the same documents gives the same prompt, the same answer and the same scores,
exactly. PINE (`rag_mspoe.attention.pine`) gets invariance by
changing attention in every layer, which small models read poorly; here the model reads an
ordinary prompt, in the order its ranking chose.

With `keep`, the model reads only the `keep` best-ranked documents: fewer distractors beside the
one that answers, at the risk of dropping it when the ranking misses (a reranker's trade; the
README gives both on real questions). The choice is still made from scores the order cannot
change, so the prompt stays invariant.

With `first_margin`, the method gives up invariance to keep a retriever's first document where it
is: the documents stay in the order given unless the top-ranked one is another document and its
score leads the first one's by at least the margin. A model that reads its first document best
(the 1.5B at 20 documents) then keeps that position's answers when its retriever was right, and
the documents are reordered when the ranking says the retriever was wrong.

Cost: about one prefill of the whole prompt. The template's rows are computed once and kept
(`rag_mspoe.engine.document_prefix`); every document's question prompt (and judge prompt) is then
read in one pass over the tree of their tokens (`rag_mspoe.attention.token_tree`), where each
document's rows, and the question's first words its two prompts share, are read once. Each score
is kept by its prompt's tokens: scoring the same document with the same template again (a sweep's
other gold positions, another `keep` or `best`) runs nothing. A model with a sliding window reads
each prompt alone, from its document's cached rows; so does the attention score.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from rag_mspoe.attention.reorder import (
    DocumentReordering,
    document_attention,
    document_texts,
    prompt_with_documents,
)
from rag_mspoe.attention.token_tree import TokenTree, tree_logits
from rag_mspoe.methods.method_config import MethodConfig, check_finite, check_layers, chosen_layers
from rag_mspoe.prompts.chat_template import Prompt
from rag_mspoe.rope.hooks import cache_argument, cache_grows_plainly
from rag_mspoe.rope.rescaling import rescaled

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.methods.document_orders import QuestionLikelihoodOrder

Best = Literal["first", "last"]
BEST_PLACES: tuple[Best, ...] = ("first", "last")
Score = Literal["question", "attention", "judge", "question+judge"]
SCORES: tuple[Score, ...] = ("question", "attention", "judge", "question+judge")
# Asked after the prompt that holds one document; the reply's first token is read.
JUDGE_NUMBERED = "Does Document [1] answer the question? Answer yes or no."
JUDGE_UNNUMBERED = "Does the document above answer the question? Answer yes or no."
YES, NO = ("Yes", "yes", " Yes", " yes"), ("No", "no", " No", " no")
# Tokens after the template one pass reads as a tree (counted before the prompts' shared tokens
# merge): a 20-document ranking's question and judge prompts fit, and more documents take more
# passes, which bounds the pass's mask and the logits it keeps.
MAX_TREE_TOKENS = 8192


@dataclass
class InvariantReorder(DocumentReordering):
    """Rank each document read alone, then answer from the documents sorted by rank.

    score: "question" ranks by the log-likelihood of the text after the document (the question)
    given the document; "judge" by the model's answer to whether the document answers the
    question (log p(yes) - log p(no) for its reply); "question+judge" by both, each standardised
    over the prompt's documents, summed; "attention" by the attention the question rows give the
    document in `layers` (None: the third quarter of the layers, the band that ranked best on the
    model measured). See the README for how often each put the gold first on real questions.
    best: "first" puts the top-ranked document first and the others after it by rank; "last" puts
    it last, nearest the question (for a model that reads the end of its context best). keep: read
    only this many of the best-ranked documents (None: all of them). first_margin: keep the
    documents as given (all of them, in their order) unless the top-ranked document is not the
    first one given and its score leads the first one's by at least this much (in the score's
    units: standardised for "question+judge"); None always reorders, and keeps the invariance.
    """

    kind: ClassVar[str] = "invariant-reorder"
    presets: ClassVar[dict[str, dict[str, Any]]] = {"invariant-reorder": {}}
    argument_name: ClassVar[str] = "invariant-reorder"  # invariant-reorder:KEEP
    score: Score = "question"
    layers: list[int] | None = None
    best: Best = "first"
    keep: int | None = None
    first_margin: float | None = None

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(map(repr, SCORES))}, got {self.score!r}")
        check_layers(self.layers)
        if self.layers is not None and self.score != "attention":
            raise ValueError("layers choose the attention that scores; give them with score='attention'.")
        if self.best not in BEST_PLACES:
            raise ValueError(f"best must be 'first' or 'last', got {self.best!r}")
        if self.keep is not None and (
            isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1
        ):
            raise ValueError(
                "keep is how many documents the model reads, a whole number >= 1 (or None for all), "
                f"got {self.keep!r}"
            )
        if self.first_margin is not None:
            check_finite("first_margin", self.first_margin)
            if self.first_margin < 0:
                raise ValueError(
                    "first_margin is how far the top-ranked document must lead the first one given, "
                    f"0 or more (or None to always reorder), got {self.first_margin}"
                )

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        if not argument.strip().isdigit() or int(argument) < 1:
            raise ValueError(
                f"{part!r}: the argument is how many of the best-ranked documents the model reads, "
                "a whole number >= 1; write e.g. 'invariant-reorder:3'."
            )
        return cls(keep=int(argument))

    def ranking_layers(self, num_layers: int) -> list[int]:
        if self.layers is None:
            return list(range(num_layers // 2, (3 * num_layers) // 4))
        return chosen_layers("InvariantReorder", self.layers, num_layers)

    def rewrite(self, engine: EngineLike, prompt: Prompt, *, raw: bool = False) -> Prompt:
        _, spans = engine.document_spans_of(self, prompt, raw=raw)
        if len(spans) < 2:
            return prompt
        return self.reordered(prompt, self.scores(engine, prompt, raw=raw), raw=raw)

    def reordered(self, prompt: Prompt, scores: list[float], *, raw: bool = False) -> Prompt:
        """The prompt this method reads given each document's score (in the order given)."""
        texts = document_texts(prompt)
        if self.keeps_given_order(scores, texts):
            return prompt
        rewritten = prompt_with_documents(prompt, self.order(scores, texts))
        return rewritten[0]["content"] if raw else rewritten

    def scores(self, engine: EngineLike, prompt: Prompt, *, raw: bool = False) -> list[float]:
        """Each document's score in a prompt of its own: the log-likelihood of what follows it, the
        model's yes-or-no judgement of it, both standardised and summed, or the attention the
        question gives it."""
        singles = [prompt_with_documents(prompt, [k]) for k in range(len(document_texts(prompt)))]
        kinds: tuple[Score, ...] = ("question", "judge") if self.score == "question+judge" else (self.score,)
        scored = {kind: [self._scored_prompt(engine, one, raw, kind) for one in singles] for kind in kinds}
        if self.score != "attention" and cache_grows_plainly(engine.model):
            # A document's question and judge prompts side by side: they share its rows.
            read_as_one_tree(engine, [one for pair in zip(*scored.values(), strict=True) for one in pair])
        values = {
            kind: [
                engine.document_prefixes.value(one.key, partial(self._computed_score, engine, one))
                for one in scored[kind]
            ]
            for kind in kinds
        }
        if self.score != "question+judge":
            return values[self.score]
        likelihood, judgement = standardised(values["question"]), standardised(values["judge"])
        return [a + b for a, b in zip(likelihood, judgement, strict=True)]

    def _scored_prompt(
        self, engine: EngineLike, single: list[dict[str, Any]], raw: bool, score: Score
    ) -> ScoredPrompt:
        if score == "judge":
            single = with_judge_question(single, raw)
        ids, spans = engine.document_spans_of(self, single[0]["content"] if raw else single, raw=raw)
        layers = (
            self.ranking_layers(int(engine.model.config.num_hidden_layers)) if score == "attention" else []
        )
        key = ("invariant-reorder", score, tuple(layers), tuple(ids))
        return ScoredPrompt(key, score, ids, spans[-1], layers)

    def _computed_score(self, engine: EngineLike, one: ScoredPrompt) -> float:
        """One prompt's score read alone: the attention score, or any score of a model whose cache
        does not grow plainly (a sliding window), which `read_as_one_tree` leaves."""
        # Every document's prompt starts with the same template (the tokens before `start`): its rows
        # are computed once and each document's run from a copy of them.
        ids, (start, end) = one.ids, one.document
        with rescaled(engine.model, None):
            if one.score == "attention":
                cache = engine.document_prefixes.copy_of(ids[:end], shared=start)
                return float(document_attention(engine.model, cache, ids, [one.document], one.layers).mean())
            # The cache stops one token short: the document's last row predicts the first token after
            # it. The judgement's prompt has the same rows up to there, so it shares this cache.
            cache = engine.document_prefixes.copy_of(ids[: end - 1], shared=start) if end > 1 else None
            if one.score == "judge":
                return yes_over_no(engine, next_token_logprobs(engine.model, cache, ids, end))
            return log_likelihood_after(engine.model, cache, ids, end)

    def shares_document_scores(self, other: MethodConfig) -> bool:
        # The same score and layers score every document alike (the orders may still differ).
        if not isinstance(other, InvariantReorder):
            return False
        return (other.score, other.layers) == (self.score, self.layers)

    def question_likelihood_order(self) -> QuestionLikelihoodOrder | None:
        return self if self.score == "question" else None

    def keeps_given_order(self, scores: list[float], texts: list[str]) -> bool:
        """Whether `first_margin` keeps the documents as given: the first one given is the top-ranked
        one, or the top-ranked one leads it by less than the margin."""
        if self.first_margin is None:
            return False
        top = min(range(len(scores)), key=lambda k: (-scores[k], texts[k]))
        return top == 0 or scores[top] - scores[0] < self.first_margin

    def order(self, scores: list[float], texts: list[str]) -> list[int]:
        """Indices of the documents the model reads, by score, best first (or last): all of them, or
        the `keep` best. Equal scores go by text, so the order depends on the documents and not on
        where they were."""
        ranked = sorted(range(len(scores)), key=lambda k: (-scores[k], texts[k]))[: self.keep]
        return ranked if self.best == "first" else ranked[::-1]


@dataclass(frozen=True)
class ScoredPrompt:
    """One document's prompt and what is read off it: `key` names the value kept for it."""

    key: tuple[Any, ...]
    score: Score
    ids: list[int]
    document: tuple[int, int]  # the document's token span
    layers: list[int]


def read_as_one_tree(engine: EngineLike, prompts: list[ScoredPrompt]) -> None:
    """Score every question or judge prompt not scored yet in one forward of the unmodified model
    over the tree of their tokens (`rag_mspoe.attention.token_tree`), after the template's rows
    (computed once, kept), and keep each value as reading it alone would. Past `MAX_TREE_TOKENS`
    the prompts are read in several trees, each a run of them in the order given (put the
    prompts of one document side by side: they share its rows only within a tree)."""
    todo = [
        one
        for one in prompts
        if not engine.document_prefixes.knows(one.key) and one.document[1] < len(one.ids)
    ]
    if not todo:
        return
    # The likelihood reads the rows from the document's last token to the question's second to
    # last; the judgement the last row only.
    rows = [
        range(one.document[1] - 1, len(one.ids) - 1)
        if one.score == "question"
        else range(len(one.ids) - 1, len(one.ids))
        for one in todo
    ]
    # The rows up to the first document's start are the template every prompt shares.
    shared = min(
        len(os.path.commonprefix([one.ids for one in todo])),
        *(one.document[0] for one in todo),
        *(read.start for read in rows),
    )
    logits: list[torch.Tensor] = []
    with rescaled(engine.model, None):
        for group in _tree_runs([len(one.ids) - shared for one in todo]):
            start_cache = engine.document_prefixes.copy_of(todo[0].ids[:shared]) if shared else None
            tree = TokenTree.of([todo[i].ids for i in group], shared)
            logits += tree_logits(engine.model, tree, start_cache, [rows[i] for i in group])
    for one, read in zip(todo, logits, strict=True):
        logprobs = torch.log_softmax(read, dim=-1)
        if one.score == "judge":
            value = yes_over_no(engine, logprobs[-1])
        else:
            targets = torch.tensor(one.ids[one.document[1] :], device=logprobs.device)
            value = float(logprobs.gather(1, targets[:, None]).sum())
        engine.document_prefixes.remember(one.key, value)


def _tree_runs(lengths: list[int]) -> list[range]:
    """Runs of consecutive prompts whose tokens after the shared start sum to at most
    `MAX_TREE_TOKENS` (a longer prompt alone)."""
    runs, first, total = [], 0, 0
    for index, length in enumerate(lengths):
        if total and total + length > MAX_TREE_TOKENS:
            runs.append(range(first, index))
            first, total = index, 0
        total += length
    return [*runs, range(first, len(lengths))]


def with_judge_question(single: list[dict[str, Any]], raw: bool) -> list[dict[str, Any]]:
    """The one-document prompt with the yes-or-no question after its last user message (a raw
    prompt: after its text, with an answer cue, since no assistant turn follows)."""
    # Prompts this package packs number their documents: ask about it by that name.
    numbered = any("Document [1]" in str(message["content"]) for message in single)
    question = JUDGE_NUMBERED if numbered else JUDGE_UNNUMBERED
    last = max((i for i, message in enumerate(single) if message["role"] == "user"), default=len(single) - 1)
    asked = [dict(message) for message in single]
    asked[last]["content"] += f"\n\n{question}" + ("\nAnswer:" if raw else "")
    return asked


def yes_over_no(engine: EngineLike, logprobs: torch.Tensor) -> float:
    """How much more likely the reply starts with yes than with no: log p(yes) - log p(no), each
    summed over the first tokens of its spellings (a first token both share counts for neither)."""
    firsts = [{engine.encode(word)[0] for word in words} for words in (YES, NO)]
    yes, no = (sorted(own - other) for own, other in (firsts, firsts[::-1]))
    if not yes or not no:
        raise ValueError(
            "This tokenizer starts 'yes' and 'no' with the same tokens, so the model's judgement "
            "cannot be read; rank by score='question' instead."
        )
    return float(
        torch.logsumexp(logprobs[torch.tensor(yes)], 0) - torch.logsumexp(logprobs[torch.tensor(no)], 0)
    )


def next_token_logprobs(model: Any, cache: Any, ids: list[int], end: int) -> torch.Tensor:
    """log p(next token) after all of `ids`; `cache` as `logits_after_document` takes it."""
    return torch.log_softmax(logits_after_document(model, cache, ids, end, last_only=True)[-1], dim=-1)


def standardised(values: list[float]) -> list[float]:
    """The values less their mean, over their standard deviation (all zeros when they are equal),
    so that scores on different scales can be summed."""
    mean = sum(values) / len(values)
    spread = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return [(v - mean) / spread if spread > 0 else 0.0 for v in values]


def log_likelihood_after(model: Any, cache: Any, ids: list[int], end: int) -> float:
    """The sum of log p(token) over `ids[end:]` (0 when nothing follows); `cache` as
    `logits_after_document` takes it."""
    if end >= len(ids):
        return 0.0
    logits = logits_after_document(model, cache, ids, end)[:-1]
    targets = torch.tensor(list(ids[end:]), device=logits.device)
    return float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())


def logits_after_document(
    model: Any, cache: Any, ids: list[int], end: int, last_only: bool = False
) -> torch.Tensor:
    """The model's logits (float) from the document's last token on: row i predicts `ids[end + i]`,
    the last row what follows `ids`; only that last row with `last_only`. `cache` holds the model's
    rows of `ids[: end - 1]` (a copy it may use up), or is None to read `ids` from the start."""
    start = end - 1 if cache is not None else 0
    with torch.inference_mode():
        rows = torch.tensor([list(ids[start:])], device=model.device)
        arguments = cache_argument(cache) if cache is not None else {}
        logits = model(rows, logits_to_keep=1 if last_only else 0, **arguments).logits[0]
    return (logits if last_only else logits[end - 1 - start :]).float()
