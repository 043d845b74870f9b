"""PINE, position-invariant inference (Wang et al., ICLR 2025): the method's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rag_mspoe.attention.document_hooks import DocumentAttentionMethod
from rag_mspoe.attention.pine_hooks import PineHooks
from rag_mspoe.methods.method_config import MethodConfig, check_finite, check_layers, number_argument


@dataclass
class Pine(DocumentAttentionMethod):
    """Make the model's output independent of the order of the documents.

    In every layer and head: (1) documents attend to each other in both directions (causally
    inside a document); the text before the documents is unchanged, the text after them reads
    everything; (2) for each query, the documents take new positions by a position-free
    importance score (softmax of q.k without RoPE, averaged over the document's tokens): the
    more important, the closer to the query; a query inside a document treats its own document
    as the last one. The documents' region keeps its place and length.
    Tokens between two documents (separators) count as part of the document before them.
    Needs full attention in every layer it runs in (no sliding windows).

    Settings for calibration to search (the defaults are the paper's method): layers, the layers
    it runs in (None: all; the order-invariance holds only with all); bidirectional=False leaves
    the documents' own rows as the model computes them (causal, natural positions) and only
    re-places the documents for the rows after them (question and answer). important_first=True
    places the most important document farthest from the query (where a model that reads the
    start of its context best looks), the least important nearest. softness > 0 sorts smoothly
    (spec `pine:SOFTNESS`): document e stands before d with weight sigmoid((importance of d -
    importance of e) / softness), so places move continuously with the scores; a tie splits
    evenly. The order-invariance holds in the dtype the model runs in, bf16 included, bit for bit
    on CPU: PINE reads q and k as the layer computes them before RoPE, rotates them only by
    offsets inside a document and placed positions, and sums over the documents in an order of
    their tokens, so every order computes the same numbers and a near-tie in the hard sort falls
    the same way in all of them (the embedded SmolLM2, 4 documents in 6 orders: 0.0 nats apart in
    bf16, fp32 and fp64; 0.31 nats in bf16 before). Where the model's own kernels compute a
    token's row differently depending on where it stands (some GPU kernels), the rounding of
    those rows can differ between orders, and a near-tie can then still flip. isolated=True: each
    document reads only itself and the text before the documents, as if it stood first right
    after that text (parallel encoding), instead of reading the others both ways; each
    document's rows then read as a model reads a lone document, and the rows after the
    documents place them as PINE does.
    """

    kind: ClassVar[str] = "pine"
    alone_because: ClassVar[str] = (
        "it computes the attention over the documents itself, with the positions it assigns them, "
        "and a rescaled RoPE inside that computation is not implemented"
    )
    hooks: ClassVar[type[PineHooks]] = PineHooks
    presets: ClassVar[dict[str, dict[str, Any]]] = {"pine": {}}
    argument_name: ClassVar[str] = "pine"  # pine:SOFTNESS
    layers: list[int] | None = None
    bidirectional: bool = True
    important_first: bool = False
    softness: float = 0.0
    isolated: bool = False

    def __post_init__(self) -> None:
        check_layers(self.layers)
        for name in ("bidirectional", "important_first", "isolated"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_finite("softness", self.softness)
        if self.isolated and not self.bidirectional:
            raise ValueError(
                "isolated=True recomputes the documents' own rows (each reads only itself), and "
                "bidirectional=False keeps them as the model computes them: choose one"
            )
        if self.softness < 0:
            raise ValueError(f"softness must be 0 (the paper's hard sort) or more, got {self.softness}")

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        return cls(softness=number_argument(part, argument))

    def keeps_rows_through_documents(self) -> bool:
        return not self.bidirectional  # then only the rows after the documents change

    def reads_documents_as_a_set(self) -> bool:
        return True
