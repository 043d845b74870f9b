"""lm-evaluation-harness backend: the harness's task zoo on a rescaled model.

    from rag_mspoe.eval.harness import harness_lm, run_harness, HarnessConfig
    lm = harness_lm(model, tokenizer, "mspoe")      # an lm_eval HFLM over the rescaled model
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])
    unrescale(model)                                # harness_lm rescales in place

    config = HarnessConfig(tasks=("caps_local",), include_path="tasks/", methods=("none", "pi:2"))
    run_harness(config, "runs/harness")

`run_harness` runs every task under every method (specs as for the sweep: `pi:2`,
`layerwise+pi`, `cal=path.json`, `dynamic-ntk:2`, ...) and streams one record per (method,
task, metric) to results.jsonl; a resumed run skips the (method, task) pairs it has, and
writes manifest.json, table.md and summary.json. The model is restored after each method.

Per-prompt Ms-PoE (MsPoE without head_order) ranks heads from the last row of each sequence of a
forward, and hidden-state scaling rescales that row. The harness right-pads loglikelihood
batches and passes no attention mask, so in a batch a shorter sequence's last row is padding
and its result would depend on the batch it falls in: for these methods the batch size is 1.
Under the harness Ms-PoE ranks heads on the request the harness feeds (context and
continuation without its last token), as the Ms-PoE reference code does; the sweep's scorer
ranks on the prompt only, so the two give slightly different log-likelihoods.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_mspoe import MethodConfig, method_name, rescaled
from rag_mspoe.eval.method_engines import EngineSet, require_given_order
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import Key, read_records
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve, resolve_all
from rag_mspoe.models.command_options import model_load_options
from rag_mspoe.models.loading import source_name
from rag_mspoe.rope.variants import rope_variant

logger = logging.getLogger(__name__)

KEY_FIELDS = ("method", "request", "task", "metric", "filter")
INSTALL_HINT = 'lm-evaluation-harness is not installed; pip install "rag-mspoe[harness]".'


@dataclass(frozen=True)
class HarnessConfig:
    tasks: tuple[str, ...]
    methods: tuple[str, ...] = ("none", "mspoe")
    include_path: str | None = None  # a folder of task YAML files, searched before the harness's own
    limit: int | None = None  # documents per task (None: all)
    num_fewshot: int | None = None  # None: each task's default
    batch_size: int = 8  # 1 for methods with per-prompt Ms-PoE or hidden-state scaling
    model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(dict.fromkeys(self.tasks)))
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.tasks:
            raise ValueError("Give at least one task.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}.")


def import_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return lm_eval


def needs_batch_size_one(method: MethodConfig | None) -> bool:
    """True when a method reads the last row of each sequence: per-prompt Ms-PoE, hidden-state scaling."""
    return method is not None and method.reads_last_row()


def _as_eval_method(method: Any) -> ResolvedMethod:
    if method is None:
        return resolve("none")
    if isinstance(method, MethodConfig):
        return ResolvedMethod(name=method_name(method), method=method)
    found = resolve(method if isinstance(method, ResolvedMethod) else str(method))
    require_given_order([found], "to the harness")
    return found


def _effective_batch_size(method: ResolvedMethod, batch_size: int | str) -> int | str:
    if batch_size != 1 and needs_batch_size_one(method.method):
        logger.warning(
            "%s ranks heads (or scales hidden states) on the last row of each sequence; the harness "
            "right-pads its batches, so it runs with batch size 1 instead of %s.",
            method.name,
            batch_size,
        )
        return 1
    return batch_size


def _hflm(model: Any, tokenizer: Any, batch_size: int | str, **hflm_kwargs: Any) -> Any:
    import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **hflm_kwargs)


def harness_lm(
    model: Any, tokenizer: Any, method: Any = None, *, batch_size: int | str = 8, **hflm_kwargs: Any
) -> Any:
    """An lm_eval HFLM over `model` rescaled with `method`, for `lm_eval.simple_evaluate`.

    `method`: None, a config, a name or saved config path, or a sweep spec ("pi:2",
    "layerwise+pi"). The model is rescaled in place: `unrescale(model)` undoes it. A spec with
    a transformers RoPE type (dynamic-ntk, yarn) runs on a model variant sharing the weights,
    `lm.model`, and leaves `model` alone. Per-prompt Ms-PoE and hidden-state scaling run with
    batch size 1 (see the module docstring). Other keyword arguments go to HFLM (max_length,
    softmax_dtype, ...).
    """
    import_lm_eval()
    resolved = _as_eval_method(method)
    target = rope_variant(model, resolved.rope_parameters) if resolved.needs_variant else model
    from rag_mspoe import rescale, unrescale

    if resolved.method is None:
        unrescale(target)
    else:
        rescale(target, resolved.method)
    return _hflm(target, tokenizer, _effective_batch_size(resolved, batch_size), **hflm_kwargs)


def task_manager(tasks: Sequence[str], include_path: str | None = None) -> Any:
    """A TaskManager that knows every task in `tasks` (names or glob patterns), or a ValueError.

    Tasks found in `include_path` alone skip indexing the harness's own few thousand tasks.
    """
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path {include_path} is not a folder of task YAML files.")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([task]) for task in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        where = f" or in {include_path}" if include_path else ""
        raise ValueError(
            f"Unknown task(s) {unknown}: not among lm-evaluation-harness's tasks{where}. "
            "List them with `lm-eval ls tasks`, or give --include-path the folder of your task YAML."
        )
    return manager


@dataclass
class Harness(Evaluation):
    """Units: (method, task) pairs; each gives one record per (task or group, metric, filter)."""

    kind = "harness"
    command_help = "lm-evaluation-harness tasks (its zoo or local YAML) on the model, per method"
    command_description = (
        "Run lm-evaluation-harness tasks under each method into OUT (results.jsonl, manifest.json, "
        "table.md, summary.json); rerun to resume. Needs the harness extra."
    )
    pairing = Pairing("metric", ("task", "filter"), ("value",))
    key_fields = KEY_FIELDS
    growing = ("tasks", "methods")
    identity_fields = ("include_path", "limit", "num_fewshot", "model")
    unit_name = "task"
    config: HarnessConfig
    methods: Sequence[ResolvedMethod]
    manager: Any = None

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        return str(write_harness_report(folder)["markdown"])

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tasks", nargs="+", required=True, help="harness task names or glob patterns")
        parser.add_argument("--include-path", default=None, help="folder of your own task YAML files")
        parser.add_argument(
            "--methods", nargs="+", default=["none", "mspoe"], help="method specs as for sweep"
        )
        parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
        parser.add_argument(
            "--num-fewshot", type=int, default=None, help="few-shot examples (default: task's)"
        )
        parser.add_argument(
            "--batch-size", type=int, default=8, help="requests per forward (1 for per-prompt Ms-PoE)"
        )
        parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
        config = HarnessConfig(
            tasks=tuple(args.tasks),
            methods=tuple(args.methods),
            include_path=str(Path(args.include_path).resolve()) if args.include_path else None,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            batch_size=args.batch_size,
            model=args.model,
        )
        summary = run_harness(config, args.out, **model_load_options(args), progress=not args.no_progress)
        print(summary["markdown"])
        return 0

    def plan(self, folder: Path, done: set[Key]) -> list[tuple[ResolvedMethod, str]]:
        requested = {key[:2] for key in done}  # (method, request)
        return [
            (m, task) for m in self.methods for task in self.config.tasks if (m.name, task) not in requested
        ]

    def prepare(self) -> None:
        self.manager = task_manager(self.config.tasks, self.config.include_path)

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        lm_eval = import_lm_eval()
        models = EngineSet(model, tokenizer)

        def score(unit: tuple[ResolvedMethod, str]) -> list[dict[str, Any]]:
            method, task = unit
            target = models.model_for(method)
            with rescaled(target, method.method):  # the model is itself again after each task
                output = lm_eval.simple_evaluate(
                    model=_hflm(target, tokenizer, _effective_batch_size(method, self.config.batch_size)),
                    tasks=[task],
                    num_fewshot=self.config.num_fewshot,
                    limit=self.config.limit,
                    task_manager=self.manager,
                    log_samples=False,
                )
            return result_records(output, method.name, task)

        return score


def run_harness(config: HarnessConfig, folder: str | Path, **options: Any) -> dict[str, Any]:
    """Run every pending (method, task) into `folder`; returns the summary.

    options: those of `run_evaluation` (model, tokenizer, threads, device, dtype, progress: our
    bar over (method, task) pairs; the harness shows its own bars regardless).
    """
    import_lm_eval()
    methods = [
        _as_eval_method(m) for m in resolve_all(config.methods, source_name(config.model))
    ]  # document orders refused
    outcome = run_evaluation(Harness(config, methods), folder, **options)
    return write_harness_report(outcome.folder, [m.name for m in methods])


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def result_records(output: dict[str, Any], method: str, request: str) -> list[dict[str, Any]]:
    """One record per (task or group, metric, filter) of a `simple_evaluate` result."""
    records = []
    for task, metrics in output["results"].items():
        for key, value in metrics.items():
            metric, sep, filter_name = key.partition(",")
            if not sep or metric.endswith("_stderr") or _number(value) is None:
                continue
            records.append(
                {
                    "method": method,
                    "request": request,
                    "task": task,
                    "metric": metric,
                    "filter": filter_name,
                    "value": _number(value),
                    "stderr": _number(metrics.get(f"{metric}_stderr,{filter_name}")),
                    "samples": output.get("n-samples", {}).get(task, {}).get("effective"),
                    "num_fewshot": output.get("n-shot", {}).get(task),
                    "higher_is_better": output.get("higher_is_better", {}).get(task, {}).get(metric),
                }
            )
    return records


def _column(record: dict[str, Any]) -> str:
    name = f"{record['task']}/{record['metric']}"
    return name if record["filter"] == "none" else f"{name} [{record['filter']}]"


def write_harness_report(folder: Path, method_order: Sequence[str] = ()) -> dict[str, Any]:
    """summary.json and table.md (methods x task/metric) from results.jsonl."""
    records = read_records(folder / "results.jsonl")
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for record in records:
        table.setdefault(record["method"], {})[_column(record)] = {
            "value": record["value"],
            "stderr": record["stderr"],
            "samples": record["samples"],
        }
    methods = [m for m in dict.fromkeys([*method_order, *table]) if m in table]
    columns = list(dict.fromkeys(_column(r) for r in records))
    lines = ["| method | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for method in methods:
        cells = []
        for column in columns:
            cell = table[method].get(column)
            if cell is None:
                cells.append("-")
            elif cell["stderr"] is None:
                cells.append(f"{cell['value']:.4f}")
            else:
                cells.append(f"{cell['value']:.4f} ± {cell['stderr']:.4f}")
        lines.append("| " + " | ".join([method, *cells]) + " |")
    markdown = "\n".join(lines) + "\n\nlm-evaluation-harness metrics (± standard error) per method.\n"
    summary = {"methods": methods, "columns": columns, "results": table, "markdown": markdown}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    (folder / "table.md").write_text(markdown)
    return summary
