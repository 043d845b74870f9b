"""The base of the methods that work by rewriting the prompt (calibrated and position-invariant
reordering): the engine hands them itself and the prompt, and the model then reads the new prompt
unmodified.

Kept apart from `MethodConfig`: a rewrite runs the engine (`EngineLike`), whose protocol names
`MethodConfig`, so only this subclass, above both, speaks of the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_mspoe.methods.method_config import MethodConfig

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.prompts.chat_template import Prompt


class PromptRewriting(MethodConfig):
    def rewrites_prompt(self) -> bool:
        return True

    def rewrite(self, engine: EngineLike, prompt: Prompt, *, raw: bool = False) -> Prompt:
        """The prompt the model reads instead of `prompt`; called by the engine with its lock held,
        so it may run the model."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it rewrites prompts.")
