"""Methods measured to lose on a model: shown by `rag-mspoe models`, warned about once when used.

The package ships a method for a model only where it won on held-out questions; the converse is
worth saying too. `losses/<model name>.json` lists, for an embedded model, each method that scored
significantly lower than the unmodified model (paired test, p < 0.05) on questions no search had
read, with the run whose records show it (`docs/results/<run>/` in the repository; a test
recomputes every entry from them). LongContextReorder, the reordering users add against
lost-in-the-middle today, is one: on a model that reads its first document best, it moves the
best-ranked documents to the end.
"""

from __future__ import annotations

import functools
import json
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

LOSSES_FOLDER = Path(__file__).parent / "losses"
SIGNIFICANT = 0.05


class MeasuredLossWarning(UserWarning):
    """A method runs on a model where it was measured to lower exact match."""


@dataclass(frozen=True)
class MeasuredLoss:
    """One method's loss on one model: exact match of the unmodified model (`baseline`) and of the
    method (`score`), as shares, on the same `questions`, with the paired test's `p`."""

    method: str
    setting: str
    baseline: float
    score: float
    questions: int
    p: float
    run: str
    why: str

    def summary(self) -> str:
        return (
            f"{self.method}: {100 * self.baseline:.1f} -> {100 * self.score:.1f} % exact match "
            f"({100 * (self.score - self.baseline):+.1f} points, n = {self.questions}, p = {self.p:.2g}), "
            f"{self.setting}"
        )


@functools.cache
def measured_losses(model_name: str) -> tuple[MeasuredLoss, ...]:
    """The methods measured to lose on `model_name` (none for a model without a file)."""
    path = LOSSES_FOLDER / f"{model_name}.json"
    if not path.is_file():
        return ()
    return tuple(MeasuredLoss(**entry) for entry in json.loads(path.read_text(encoding="utf-8")))


_warned: set[tuple[str, str]] = set()
_warned_guard = threading.Lock()


def warn_measured_loss(model_name: str, method: str) -> None:
    """Warn once per process and (model, method) when `method` was measured to lose on the model."""
    loss = next((loss for loss in measured_losses(model_name) if loss.method == method), None)
    if loss is None:
        return
    with _warned_guard:
        if (model_name, method) in _warned:
            return
        _warned.add((model_name, method))
    warnings.warn(
        f"{method} was measured to lower {model_name}'s answers: {loss.summary()}; {loss.why}. "
        "Keep the retrieval order (the default), or use method='calibrated'. Shown once.",
        MeasuredLossWarning,
        stacklevel=3,
    )
