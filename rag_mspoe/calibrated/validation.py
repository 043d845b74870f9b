"""The committed validation of each shipped method, carried by the package in compact form.

A config ships here only after a held-out sweep measured it (`docs/results/<run>/` in the
repository: every record, several MB). An installed package has no such folder, so for each
shipped config it carries `validation/<model name>.json`: for every question and gold position
of that sweep, the unmodified model's and the shipped method's exact match and gold
log-likelihood, nothing else (about 20 kB). `rag-mspoe demo` draws the committed position curve
from it with the same statistics as `rag-mspoe report`.

The file is made from the run folder by `build_validation` (`python -m
rag_mspoe.calibrated.validation` rewrites every one); a test rebuilds it from docs/results and
compares, so the two cannot drift.
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
METRICS = ("match", "gold_logprob")
_DIGITS = 4  # nats kept per log-likelihood: the tables print 2


@dataclass(frozen=True)
class ValidationRun:
    """Where the records of a shipped config's validation sit in the repository, and how they were made."""

    model: str
    folder: str  # relative to the repository's root
    label: str  # the run's label for the shipped config
    command: str  # reproduces the two labels' records (in a clone of the repository)


VALIDATION_RUNS = {
    run.model: run
    for run in [
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
    ]
}


def validation_path(model_name: str) -> Path:
    return SEARCH_PATH[0] / VALIDATION_FOLDER / f"{model_name}.json"


def load_validation(model_name: str) -> dict[str, Any] | None:
    """The committed validation of the config shipped for `model_name`, or None."""
    path = validation_path(model_name)
    return json.loads(path.read_text()) if path.is_file() else None


def build_validation(repository: Path, run: ValidationRun) -> dict[str, Any]:
    """The compact validation of `run` from its records in `repository`.

    Refuses a run whose label did not score the config shipped for the model, and questions
    not scored at every position by both labels (the curve must be paired)."""
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
                scores[key] = {metric: record[metric] for metric in METRICS}
                seconds += record["seconds"]
    questions = sorted({key[2] for key in scores}, key=int)
    missing = [
        key
        for key in ((name, p, q) for name in names.values() for p in positions for q in questions)
        if key not in scores
    ]
    if missing:
        raise ValueError(f"{folder}: {len(missing)} items are not scored, e.g. {missing[0]}; finish the run.")
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
            name: {
                "match": {
                    str(p): "".join(str(int(scores[name, p, q]["match"])) for q in questions)
                    for p in positions
                },
                "gold_logprob": {
                    str(p): [round(scores[name, p, q]["gold_logprob"], _DIGITS) for q in questions]
                    for p in positions
                },
            }
            for name in names.values()
        },
    }


def validation_records(validation: dict[str, Any]) -> list[dict[str, Any]]:
    """The compact validation as sweep records (method, position, example_id, match,
    gold_logprob), as `rag_mspoe.eval.report.summarize` reads them."""
    records = []
    for method, metrics in validation["scores"].items():
        for position in validation["positions"]:
            matches = metrics["match"][str(position)]
            likelihoods = metrics["gold_logprob"][str(position)]
            for question, match, likelihood in zip(
                validation["questions"], matches, likelihoods, strict=True
            ):
                records.append(
                    {
                        "method": method,
                        "position": position,
                        "example_id": question,
                        "match": float(match),
                        "gold_logprob": likelihood,
                    }
                )
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
    for run in VALIDATION_RUNS.values():
        path = validation_path(run.model)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(build_validation(repository, run), separators=(",", ":")) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    # python -m rag_mspoe.calibrated.validation [REPOSITORY], from a clone (default: the working folder)
    for path in write_validations(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
