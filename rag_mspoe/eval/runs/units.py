"""What turns a unit of work into records, as the run loop and the Ray workers both see it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Scorer = Callable[[Any], list[dict[str, Any]]]  # unit -> its records


class UnitScoring(Protocol):
    """What a worker needs: the model to load (`config.model`) and a scorer of units with it.

    Every `Evaluation` is one; calibration scores its candidates through another."""

    @property
    def config(self) -> Any: ...

    def scorer(self, model: Any, tokenizer: Any) -> Scorer: ...
