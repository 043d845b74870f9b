"""Search a method's settings on real questions by successive halving, as sweeps that resume.

    out/
      search.json            the settings and the data's sha256; a rerun with other settings or
                             another data file is refused
      candidates/<label>.json every candidate config of the space
      data/rung-<r>.jsonl.gz the rung's questions: disjoint slices of the search data
      rung-<r>/              a gold-position sweep (`--metrics loglik`) of none and the candidates
                             still in the race, over that rung's questions
      ranking.json, ranking.md  every rung's fitness table
      rag_mspoe_method.json  the winner of the last rung, when it beats the unmodified model

Rung 1 scores every candidate on a few questions; each later rung keeps the best `keep` of the
rung before and scores them on new questions. A candidate's fitness counts every question it was
scored on: the mean gain in the gold answer's log-likelihood per token over the unmodified model
across the gold positions, plus `worst_weight` times the gain at the worst position (the one where
the unmodified model does worst), so a candidate cannot buy the average with the middle. The sweeps
resume where they stopped, and which candidates go on follows from the records alone, so a killed
or budget-stopped search picks up by running the same command again.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rag_mspoe.files import atomic_write
from rag_mspoe.methods.method_config import MethodConfig

BASELINE = "none"


@dataclass(frozen=True)
class HalvingSettings:
    data: str  # QA examples in the lost-in-the-middle format, searched on (never the validation split)
    space: str  # a name of rag_mspoe.eval.settings_search.spaces.SPACES
    num_documents: int = 10
    positions: tuple[int, ...] = (0, 4, 9)
    rungs: tuple[int, ...] = (16, 48, 144)  # new questions per rung
    keep: int = 4  # candidates that go on from one rung to the next
    worst_weight: float = 1.0
    model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "positions", tuple(self.positions))
        object.__setattr__(self, "rungs", tuple(self.rungs))
        if not self.rungs or any(n < 1 for n in self.rungs):
            raise ValueError(f"rungs are positive numbers of questions, got {list(self.rungs)}.")
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}.")
        if not self.worst_weight >= 0:
            raise ValueError(f"worst_weight must be 0 or more, got {self.worst_weight}.")


@dataclass
class Standing:
    """One candidate's scores on the questions it was scored on, against the unmodified model."""

    label: str
    questions: int
    gain: dict[int, float]  # per gold position: mean gain in log-likelihood per token
    level: dict[int, float]  # per gold position: the candidate's mean log-likelihood per token
    fitness: float
    # Paired standard error of the fitness's average term, for reading the table.
    stderr: float = field(default=0.0)


def standings(
    records: Sequence[dict[str, Any]], labels: Sequence[str], positions: Sequence[int], worst_weight: float
) -> list[Standing]:
    """Fitness of each label over the examples where it and the baseline were scored at every
    position, best first."""
    per_token: dict[tuple[str, int, str], float] = {
        (r["method"], r["position"], r["example_id"]): r["gold_logprob"] / r["gold_tokens"] for r in records
    }
    baseline_examples = {e for m, _, e in per_token if m == BASELINE}
    result = []
    for label in labels:
        examples = sorted(
            e
            for e in baseline_examples
            if all((label, p, e) in per_token and (BASELINE, p, e) in per_token for p in positions)
        )
        if not examples:
            continue
        level = {p: statistics.fmean(per_token[label, p, e] for e in examples) for p in positions}
        base = {p: statistics.fmean(per_token[BASELINE, p, e] for e in examples) for p in positions}
        gain = {p: level[p] - base[p] for p in positions}
        worst = min(positions, key=lambda p: base[p])
        fitness = statistics.fmean(gain.values()) + worst_weight * gain[worst]
        per_example = [
            statistics.fmean(per_token[label, p, e] - per_token[BASELINE, p, e] for p in positions)
            for e in examples
        ]
        stderr = statistics.stdev(per_example) / math.sqrt(len(examples)) if len(examples) > 1 else 0.0
        result.append(Standing(label, len(examples), gain, level, fitness, stderr))
    return sorted(result, key=lambda s: -s.fitness)


class HalvingSearch:
    """The rungs of one search folder (see the module docstring)."""

    def __init__(self, folder: str | Path, settings: HalvingSettings, candidates: dict[str, MethodConfig]):
        if BASELINE in candidates:
            raise ValueError(f"{BASELINE!r} is the baseline of every rung; give candidates other labels.")
        self.folder = Path(folder)
        self.settings = settings
        self.candidates = candidates
        self._check_folder()

    def _check_folder(self) -> None:
        from rag_mspoe.eval.settings_search.search import claim_search_folder

        configs = {label: config.to_dict() for label, config in self.candidates.items()}
        identity = {**asdict(self.settings), "candidates": configs}
        claim_search_folder(self.folder, identity, check_unhashed_data=self._check_saved_rungs)
        for label, config in self.candidates.items():
            target = self.folder / "candidates" / f"{label}.json"
            if not target.is_file():
                config.save(target)

    def _check_saved_rungs(self) -> None:
        """Raise ValueError unless each rung's saved questions are still their slice of the data
        (the check a folder written before the data's digest was kept needs)."""
        from rag_mspoe.eval.data.loaders import load_qa

        examples = self._examples()
        offset = 0
        for rung, size in enumerate(self.settings.rungs, start=1):
            saved = self.folder / "data" / f"rung-{rung}.jsonl.gz"
            if saved.is_file() and load_qa(saved) != examples[offset : offset + size]:
                raise ValueError(
                    f"{saved} holds the questions rung {rung} ran on, and they are not questions "
                    f"{offset + 1}-{offset + size} of {self.settings.data} now: the file changed since "
                    f"the search in {self.folder} started. Restore it to resume, or use a new --out folder."
                )
            offset += size

    def run(self, *, budget_hours: float | None = None, **load: Any) -> list[list[Standing]]:
        """Run (or resume) the rungs within the budget; returns every finished rung's standings."""
        deadline = None if budget_hours is None else time.monotonic() + budget_hours * 3600
        examples = self._examples()
        tables: list[list[Standing]] = []
        labels = list(self.candidates)
        offset = 0
        stopped: list[Standing] = []  # the standings so far of a rung the budget or a kill stopped
        for rung, size in enumerate(self.settings.rungs, start=1):
            if tables:
                labels = [s.label for s in tables[-1][: self.settings.keep]]
            # A spent budget still scores one batch: every run makes progress.
            left = None if deadline is None else max((deadline - time.monotonic()) / 3600, 1e-9)
            outcome = self._run_rung(rung, examples[offset : offset + size], labels, left, load)
            offset += size
            if not outcome.complete:
                if self._scored_any(rung, labels):
                    stopped = self._standings(rung, labels)
                break
            tables.append(self._standings(rung, labels))
        self._write_ranking(tables, stopped)
        return tables

    def _examples(self) -> list[Any]:
        from rag_mspoe.eval.data.loaders import load_qa

        examples = load_qa(self.settings.data)
        needed = sum(self.settings.rungs)
        if len(examples) < needed:
            raise ValueError(
                f"{self.settings.data} holds {len(examples)} questions; the rungs "
                f"{list(self.settings.rungs)} need {needed}. Lower --rungs."
            )
        return examples

    def _run_rung(
        self, rung: int, examples: list[Any], labels: list[str], hours: float | None, load: dict
    ) -> Any:
        from rag_mspoe.eval.data.loaders import save_jsonl
        from rag_mspoe.eval.sweep.plan import SweepConfig
        from rag_mspoe.eval.sweep.run import run_sweep

        data = self.folder / "data" / f"rung-{rung}.jsonl.gz"
        if not data.is_file():
            data.parent.mkdir(parents=True, exist_ok=True)
            save_jsonl(data, examples)
        specs = [BASELINE] + [f"{label}={self.folder / 'candidates' / f'{label}.json'}" for label in labels]
        config = SweepConfig(
            task="qa",
            num_documents=self.settings.num_documents,
            positions=self.settings.positions,
            methods=tuple(specs),
            samples=len(examples),
            data=str(data.resolve()),
            generator=None,
            metrics=("loglik",),
            model=self.settings.model,
        )
        return run_sweep(config, self.folder / f"rung-{rung}", budget_hours=hours, **load)

    def _scored_any(self, rung: int, labels: list[str]) -> bool:
        from rag_mspoe.eval.runs.results import read_records

        path = self.folder / f"rung-{rung}" / "results.jsonl"
        return path.is_file() and any(r["method"] in labels for r in read_records(path))

    def _standings(self, rung: int, labels: list[str]) -> list[Standing]:
        from rag_mspoe.eval.runs.results import read_records

        records = [
            record
            for r in range(1, rung + 1)
            for record in read_records(self.folder / f"rung-{r}" / "results.jsonl")
        ]
        return standings(records, labels, self.settings.positions, self.settings.worst_weight)

    def _write_ranking(self, tables: list[list[Standing]], stopped: list[Standing]) -> None:
        payload = {
            "rungs": [[asdict(s) for s in table] for table in tables],
            "unfinished_rung": [asdict(s) for s in stopped],
        }
        atomic_write(self.folder / "ranking.json", (json.dumps(payload, indent=2) + "\n").encode())
        text = ranking_markdown(tables, self.settings, stopped)
        atomic_write(self.folder / "ranking.md", text.encode())
        best = self.winner(tables)
        target = self.folder / "rag_mspoe_method.json"
        if best is not None:
            self.candidates[best.label].save(target, base_model=self.settings.model)
        elif target.is_file():
            target.unlink()

    def winner(self, tables: list[list[Standing]]) -> Standing | None:
        """The best of the last rung when every rung ran and it beats the unmodified model."""
        if len(tables) < len(self.settings.rungs) or not tables[-1]:
            return None
        best = tables[-1][0]
        return best if best.fitness > 0 else None


def ranking_markdown(
    tables: list[list[Standing]], settings: HalvingSettings, stopped: list[Standing] | None = None
) -> str:
    lines = [
        f"# Search `{settings.space}` on {Path(settings.data).name}\n",
        "Gain in the gold answer's log-likelihood per token over the unmodified model, per gold "
        f"position (0-based); fitness = mean gain + {settings.worst_weight:g} x gain at the unmodified "
        "model's worst position; +- is the paired standard error of the mean gain.\n",
    ]
    for rung, table in enumerate(tables, start=1):
        lines += _rung_table(f"Rung {rung}", table, settings.positions)
    if stopped:
        lines += _rung_table(f"Rung {len(tables) + 1}, stopped before its end", stopped, settings.positions)
    return "\n".join(lines) + "\n"


def _rung_table(title: str, table: list[Standing], positions: Sequence[int]) -> list[str]:
    lines = [f"\n## {title}\n"]
    if table:
        first = table[0]
        levels = " / ".join(f"{first.level[p] - first.gain[p]:.3f}" for p in positions)
        where = "/".join(str(p) for p in positions)
        lines.append(f"The unmodified model: {levels} nats per token at positions {where}.\n")
    lines += [
        "| candidate | questions | "
        + " | ".join(f"gain @{p}" for p in positions)
        + " | fitness | mean gain |",
        "|---|---:|" + "---:|" * (len(positions) + 2),
    ]
    for s in table:
        mean = statistics.fmean(s.gain.values())
        cells = " | ".join(f"{s.gain[p]:+.4f}" for p in positions)
        lines.append(
            f"| {s.label} | {s.questions} | {cells} | {s.fitness:+.4f} | {mean:+.4f} +- {s.stderr:.4f} |"
        )
    return lines
