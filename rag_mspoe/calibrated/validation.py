"""The committed validation of each shipped method, carried by the package in compact form.

A config ships here only after a held-out sweep measured it (`docs/results/<run>/` in the
repository: every record, several MB). An installed package has no such folder, so for each
shipped config and each number of documents it was measured at, it carries
`validation/<model name>-<N>docs.json`: for every question and gold position of that sweep, the
unmodified model's and the shipped method's exact match and gold log-likelihood, nothing else
(about 20 kB). `rag-mspoe demo` draws the committed position curve of the first (the headline
run) with the same statistics as `rag-mspoe report`.

A config's `validated_documents` are the counts where its run shows a win
(`rag_mspoe.eval.shipping_rule.wins`); a test checks the two agree. The files are made from the
run folders by `build_validation` (`python -m rag_mspoe.calibrated.validation` rewrites every
one); a test rebuilds them from docs/results and compares, so the two cannot drift.
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_mspoe.calibrated import SEARCH_PATH, calibrated_method

VALIDATION_FOLDER = "validation"
BASELINE = "none"
SHIPPED = "calibrated"  # the name the shipped method goes by (`--method calibrated`)
METRICS = ("match", "gold_logprob")  # exact match always; the log-likelihood where the run scored it
_DIGITS = 4  # nats kept per log-likelihood: the tables print 2


@dataclass(frozen=True)
class ValidationRun:
    """Where the records of a shipped config's validation sit in the repository, and how they were made."""

    model: str
    folder: str  # relative to the repository's root
    label: str  # the run's label for the shipped config
    command: str  # reproduces the two labels' records (in a clone of the repository)


# Per model, its shipped config's validation runs, one per number of documents; the first is the
# headline run (the demo's curve).
VALIDATION_RUNS: dict[str, tuple[ValidationRun, ...]] = {
    "qwen2.5-coder-0.5b-instruct": (
        ValidationRun(
            model="qwen2.5-coder-0.5b-instruct",
            folder="docs/results/nq10-0.5b",
            label="layers-12-17",
            command=(
                "rag-mspoe sweep --model qwen2.5-coder-0.5b-instruct "
                "--data docs/results/nq10-split/validation-10.jsonl.gz --documents 10 --positions 0,4,9 "
                "--methods none calibrated --samples 300 --metrics loglik generate --max-new-tokens 64 "
                "--threads 1 --ray local --ray-workers 2 --out runs/val10-0.5b"
            ),
        ),
        ValidationRun(
            model="qwen2.5-coder-0.5b-instruct",
            folder="docs/results/nq3-0.5b",
            label="calibrated",
            command=(
                "rag-mspoe sweep --model qwen2.5-coder-0.5b-instruct "
                "--data docs/results/nq5-0.5b/validation-5.jsonl.gz --documents 3 --positions 0,1,2 "
                "--methods none calibrated --samples 300 --metrics generate --max-new-tokens 64 "
                "--threads 1 --out runs/val3-0.5b"
            ),
        ),
        ValidationRun(
            model="qwen2.5-coder-0.5b-instruct",
            folder="docs/results/nq4-0.5b",
            label="calibrated",
            command=(
                "rag-mspoe sweep --model qwen2.5-coder-0.5b-instruct "
                "--data docs/results/nq5-0.5b/validation-5.jsonl.gz --documents 4 --positions 0,1,2,3 "
                "--methods none calibrated --samples 300 --metrics generate --max-new-tokens 64 "
                "--threads 1 --ray local --ray-workers 2 --out runs/val4-0.5b"
            ),
        ),
        ValidationRun(
            model="qwen2.5-coder-0.5b-instruct",
            folder="docs/results/nq5-0.5b",
            label="calibrated",
            command=(
                "rag-mspoe sweep --model qwen2.5-coder-0.5b-instruct "
                "--data docs/results/nq5-0.5b/validation-5.jsonl.gz --documents 5 --positions 0,2,4 "
                "--methods none calibrated --samples 300 --metrics loglik generate --max-new-tokens 64 "
                "--threads 1 --ray local --ray-workers 2 --out runs/val5-0.5b"
            ),
        ),
        ValidationRun(
            model="qwen2.5-coder-0.5b-instruct",
            folder="docs/results/nq20-0.5b",
            label="calibrated",
            command=(
                "rag-mspoe sweep --model qwen2.5-coder-0.5b-instruct "
                "--data docs/results/nq20-1.5b/validation-20.jsonl.gz --documents 20 --positions 0,9,19 "
                "--methods none calibrated --samples 300 --metrics loglik generate --max-new-tokens 64 "
                "--threads 1 --ray local --ray-workers 2 --out runs/val20-0.5b"
            ),
        ),
    ),
    "qwen2.5-coder-1.5b-instruct": (
        ValidationRun(
            model="qwen2.5-coder-1.5b-instruct",
            # The confirmatory run on 300 questions nothing had read; the first validation
            # (docs/results/nq20-1.5b, label judge-keep-first) was partly read by the design.
            folder="docs/results/nq20-1.5b-confirm",
            label="calibrated",
            command=(
                "rag-mspoe sweep --model qwen2.5-coder-1.5b-instruct "
                "--data docs/results/nq20-1.5b-confirm/validation-20-fresh.jsonl.gz --documents 20 "
                "--positions 0,9,19 --methods none calibrated --samples 300 --metrics generate "
                "--max-new-tokens 64 --threads 1 --ray local --ray-workers 2 --out runs/confirm20-1.5b"
            ),
        ),
    ),
}


def validation_path(model_name: str, documents: int) -> Path:
    return SEARCH_PATH[0] / VALIDATION_FOLDER / f"{model_name}-{documents}docs.json"


def load_validations(model_name: str) -> list[dict[str, Any]]:
    """The committed validations of the config shipped for `model_name`, the headline run first."""
    folder = SEARCH_PATH[0] / VALIDATION_FOLDER
    found = [json.loads(path.read_text()) for path in sorted(folder.glob(f"{model_name}-*docs.json"))]
    found = [validation for validation in found if validation["model"] == model_name]
    headline = VALIDATION_RUNS[model_name][0].folder if model_name in VALIDATION_RUNS else None
    return sorted(found, key=lambda validation: (validation["run"] != headline, validation["num_documents"]))


def load_validation(model_name: str) -> dict[str, Any] | None:
    """The committed headline validation of the config shipped for `model_name`, or None."""
    validations = load_validations(model_name)
    return validations[0] if validations else None


def build_validation(repository: Path, run: ValidationRun) -> dict[str, Any]:
    """The compact validation of `run` from its records in `repository`.

    Refuses a run whose label did not score the config shipped for the model; keeps the questions
    scored at every position by both labels (the curve must be paired)."""
    folder = repository / run.folder
    manifest = json.loads((folder / "manifest.json").read_text())
    recorded = manifest["methods"][run.label]
    shipped = calibrated_method(run.model).to_dict()
    if recorded["method"] != json.loads(json.dumps(shipped)):
        raise ValueError(
            f"{folder}: the label {run.label!r} scored {recorded['method']}, not the config shipped "
            f"for {run.model} ({shipped}); point VALIDATION_RUNS at the run of the shipped config."
        )
    sweep = manifest["sweep"]
    positions = [int(p) for p in sweep["positions"]]
    names = {BASELINE: BASELINE, run.label: SHIPPED}
    scores: dict[tuple[str, int, str], dict[str, float]] = {}
    seconds = 0.0
    with gzip.open(folder / "results.jsonl.gz", "rt") as handle:
        for line in handle:
            record = json.loads(line)
            if record["method"] in names:
                key = (names[record["method"]], int(record["position"]), str(record["example_id"]))
                scores[key] = {metric: record[metric] for metric in METRICS if record.get(metric) is not None}
                seconds += record["seconds"]
    # The paired questions: scored by both labels at every position (a run stopped by its budget
    # may hold part of its last question).
    questions = sorted(
        (
            q
            for q in {key[2] for key in scores}
            if all((n, p, q) in scores for n in names.values() for p in positions)
        ),
        key=int,
    )
    if not questions:
        raise ValueError(f"{folder}: no question is scored by both labels at every position; finish the run.")
    # A run measured with `--metrics generate` alone has exact match and no log-likelihood.
    paired = [scores[name, p, q] for name in names.values() for p in positions for q in questions]
    metrics = [metric for metric in METRICS if all(metric in score for score in paired)]
    if "match" not in metrics:
        raise ValueError(f"{folder}: the records hold no exact match; run the sweep with --metrics generate.")
    return {
        "model": run.model,
        "run": run.folder,
        "label": run.label,
        "method": recorded["method"],
        "data": sweep["data"],
        "num_documents": sweep["num_documents"],
        "max_new_tokens": sweep["max_new_tokens"],
        "positions": positions,
        "questions": questions,
        "cpu_hours": round(seconds / 3600, 1),
        "command": run.command,
        # Per method and metric, per gold position, the questions' scores in `questions` order;
        # exact match as a string of 0s and 1s.
        "scores": {
            name: {metric: _by_position(scores, name, metric, positions, questions) for metric in metrics}
            for name in names.values()
        },
    }


def _by_position(
    scores: dict[tuple[str, int, str], dict[str, float]],
    name: str,
    metric: str,
    positions: list[int],
    questions: list[str],
) -> dict[str, Any]:
    """Per gold position, the questions' scores in `questions` order: exact match as a string of
    0s and 1s, a log-likelihood as a list of rounded nats."""
    if metric == "match":
        return {str(p): "".join(str(int(scores[name, p, q]["match"])) for q in questions) for p in positions}
    return {str(p): [round(scores[name, p, q][metric], _DIGITS) for q in questions] for p in positions}


def validation_metrics(validation: dict[str, Any]) -> list[str]:
    """The metrics a validation holds: exact match, and the log-likelihood where the run scored it."""
    return [metric for metric in METRICS if metric in validation["scores"][BASELINE]]


def validation_records(validation: dict[str, Any]) -> list[dict[str, Any]]:
    """The compact validation as sweep records (method, position, example_id, match and, where
    scored, gold_logprob), as `rag_mspoe.eval.report.summarize` reads them."""
    records = []
    held = validation_metrics(validation)
    for method, metrics in validation["scores"].items():
        for position in validation["positions"]:
            columns = {name: metrics[name][str(position)] for name in held}
            for index, question in enumerate(validation["questions"]):
                record = {"method": method, "position": position, "example_id": question}
                for name, column in columns.items():
                    record[name] = float(column[index]) if name == "match" else column[index]
                records.append(record)
    return records


def middle_position(validation: dict[str, Any]) -> int:
    positions = validation["positions"]
    return int(positions[len(positions) // 2])


def exact_match(validation: dict[str, Any], method: str, position: int) -> float:
    """A method's exact match (%) with the gold document at `position`."""
    answers = validation["scores"][method]["match"][str(position)]
    return 100 * answers.count("1") / len(answers)


def write_validations(repository: Path) -> list[Path]:
    """Rewrite every shipped validation file from the records in `repository`."""
    written = []
    for run in (run for runs in VALIDATION_RUNS.values() for run in runs):
        validation = build_validation(repository, run)
        path = validation_path(run.model, validation["num_documents"])
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(validation, separators=(",", ":")) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    # python -m rag_mspoe.calibrated.validation [REPOSITORY], from a clone (default: the working folder)
    for path in write_validations(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
