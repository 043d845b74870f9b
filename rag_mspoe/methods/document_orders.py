"""What a method that reorders documents by scores offers the code that runs it elsewhere than in
its own `rewrite`: a sweep that records its ranking, an engine whose model runs on a server.

A method offers one of these through `MethodConfig` (`recorded_ranking`, `question_likelihood_order`),
so that such code asks the method what it can do and never checks which method it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rag_mspoe.prompts.chat_template import Prompt

# The engine (`rag_mspoe.engine.protocol.EngineLike`) sits above the methods, which its protocol
# names; a method's own signature names it, and this module takes any engine so as not to import
# upwards.
Engine = Any


class RecordedRanking(Protocol):
    """A reordering by one ranking pass over the prompt, whose result a sweep records with each item
    and rebuilds the reordered prompt from without running the pass again
    (`rag_mspoe.eval.sweep.rankings`)."""

    def ranking_attention(self, engine: Engine, prompt: Prompt, *, raw: bool = False) -> torch.Tensor | None:
        """The ranking pass's result, [layers, documents] (None: nothing to reorder)."""

    def reordered(
        self, engine: Engine, prompt: Prompt, attention: torch.Tensor, *, raw: bool = False
    ) -> Prompt:
        """The prompt reordered by the ranking that `attention` (as `ranking_attention` gives it) makes."""


class QuestionLikelihoodOrder(Protocol):
    """A reordering by one score per document: the log-likelihood of what follows the document (the
    question) in a prompt that holds it alone. An engine that offers only the log-probabilities of
    a prompt's tokens computes those scores itself and orders by them (`RemoteEngine`)."""

    def reordered(self, prompt: Prompt, scores: list[float], *, raw: bool = False) -> Prompt:
        """The prompt the method reads given each document's score (in the order given)."""
