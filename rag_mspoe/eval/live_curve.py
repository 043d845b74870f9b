"""The demo's live position curve: a small gold-position sweep on this machine.

The questions (`demo_questions.jsonl.gz`) are 8 NQ-open questions (Kwiatkowski et al., 2019,
CC BY-SA 3.0) with their gold Wikipedia passage and 9 retrieved distractors (the
lost-in-the-middle format of Liu et al., 2023), from the validation half of the project's split,
which no method was searched on.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep
from rag_mspoe.models.loading import model_display_name
from rag_mspoe.pipelines.demo import MethodAnswer

CURVE_POSITIONS = (0, 4, 9)  # first, middle and last of 10 documents
CURVE_MAX_NEW_TOKENS = 48  # room for a sentence-long answer
# A live curve item (an NQ prompt of about 1,200 tokens, up to 48 new tokens and the gold
# answer's log-likelihood) against one corpus answer of the same method (a prompt of about
# 1,200 tokens, up to 32 new tokens), for the live curve's expected duration. Measured in one
# run on the 0.5B, one thread, a busy 2-core machine: 515 s for 2 questions at 3 positions,
# 2.5 times the 208 s its own corpus answers (12.9 s unmodified, 21.7 s calibrated) add up to.
CURVE_ITEM_PER_ANSWER = 2.5


def demo_questions_file() -> Path:
    return Path(str(resources.files("rag_mspoe.eval") / "demo_questions.jsonl.gz"))


def expected_curve_seconds(answers: Sequence[MethodAnswer], questions: int) -> float:
    """About how long the live curve of `questions` questions takes, from this run's own answers."""
    by_method: dict[str, list[float]] = {}
    for answer in answers:
        by_method.setdefault(answer.method, []).append(answer.seconds)
    per_item = sum(sum(seconds) / len(seconds) for seconds in by_method.values())
    return CURVE_ITEM_PER_ANSWER * per_item * questions * len(CURVE_POSITIONS)


def run_position_curve(
    model: Any, tokenizer: Any, methods: Sequence[str], folder: Path, *, questions: int, max_new_tokens: int
) -> Any:
    """Sweep the gold passage of `questions` real questions through the first, middle and last of
    10 documents under each method: greedy answers (exact match) and the gold answer's
    log-likelihood, with the sweep's table and plot in `folder` (resumed if it exists)."""
    config = SweepConfig(
        num_documents=10,
        positions=CURVE_POSITIONS,
        methods=tuple(methods),
        samples=questions,
        data=str(demo_questions_file()),
        generator=None,
        metrics=("loglik", "generate"),
        max_new_tokens=max_new_tokens,
        # One question at every position per batch: the bar moves once per question and method.
        batch_size=len(CURVE_POSITIONS),
        model=model_display_name(model),
    )
    return run_sweep(config, folder, model=model, tokenizer=tokenizer, progress=True)
