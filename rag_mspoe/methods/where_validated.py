"""The method shipped for a model, on the prompts it was validated for: `method="auto"`.

A shipped config records the document counts where held-out questions showed it to help
(`validated_documents`). At other counts it may help less or hurt, and a reordering always costs
its ranking pass (about one more read of the prompt: the 1.5B's doubles an answer's time). Under
`WhereValidated` each prompt's documents are counted, and only a prompt of a validated count is
rewritten by the shipped config; the unmodified model reads the others as they came, as it reads
a prompt whose documents no question follows (every validation asked after the documents, and the
shipped reorderings rank them by the text after them). A server or chain whose prompts vary pays
for the method only where it was shown to help, prompt by prompt, in a batch too (a rewriting
runs per prompt).

Only a config that rewrites prompts can be wrapped: a rescaling config changes the model for a
whole batch, so "auto" applies a shipped rescaling config to every prompt (the engine warns once
per unvalidated count), as "calibrated" does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from rag_mspoe.attention.reorder import DocumentReordering
from rag_mspoe.methods.method_config import VALIDATED_DOCUMENTS, MethodConfig, method_name
from rag_mspoe.methods.method_spec import AUTO
from rag_mspoe.methods.validated_documents import note_left_out, note_no_question_after
from rag_mspoe.prompts.document_prompts import question_follows_documents, text_after_documents

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.prompts.chat_template import Prompt


@dataclass
class WhereValidated(DocumentReordering):
    """`shipped` (a config that rewrites prompts and records `validated_documents`) on the prompts
    whose document count it was validated at; every other prompt is read as given."""

    kind: ClassVar[str] = "where-validated"
    shipped_as: ClassVar[str | None] = AUTO  # every screen names it as users asked for it
    shipped: MethodConfig

    def __post_init__(self) -> None:
        if not isinstance(self.shipped, MethodConfig) or not self.shipped.rewrites_prompt():
            raise TypeError(
                f"{type(self).__name__} wraps a method that rewrites prompts (a reordering), got "
                f"{self.shipped!r}; apply a rescaling method directly."
            )
        if self.shipped.validated_documents is None:
            raise ValueError(
                f"{method_name(self.shipped)} records no validated document counts "
                f"('{VALIDATED_DOCUMENTS}' in its JSON), so it cannot be applied only where it was validated."
            )

    @property
    def counts(self) -> tuple[int, ...]:
        """The document counts the shipped config applies at."""
        assert self.shipped.validated_documents is not None  # __post_init__ checked it
        return self.shipped.validated_documents

    def applies_at(self, documents: int, question_follows: bool = True) -> bool:
        return documents in self.counts and question_follows

    def rewrite(self, engine: EngineLike, prompt: Prompt, *, raw: bool = False) -> Prompt:
        _, spans = engine.document_spans_of(self, prompt, raw=raw)
        if not self.applies_at(len(spans)):
            note_left_out(self.shipped, len(spans), engine.name)
            return prompt
        if not question_follows_documents(prompt):
            note_no_question_after(self.shipped, text_after_documents(prompt) or "", engine.name)
            return prompt
        return self.shipped.rewrite(engine, prompt, raw=raw)  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        shipped = self.shipped.to_dict()
        shipped[VALIDATED_DOCUMENTS] = list(self.counts)  # not a field, but what this method reads
        return {"method": self.kind, "shipped": shipped}

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> MethodConfig:
        return cls(shipped=MethodConfig.from_dict(fields["shipped"]))
