"""The `calibrate` command: fit a method to one model and save its config next to a short report.

    rag-mspoe calibrate layers --out runs/cal-layers            # Bezier curve: GA vs CMA-ES
    rag-mspoe calibrate heads --out runs/cal-heads              # static Ms-PoE head order
    rag-mspoe calibrate hidden --out runs/cal-hidden            # positional hidden dimension
    rag-mspoe calibrate search --space pine --data search.jsonl.gz --out runs/cal-pine
                                                                # any space, on real questions
    rag-mspoe calibrate ranking --data search.jsonl.gz --out runs/cal-ranking
                                                                # calibrated reordering's ranking

Each writes `rag_mspoe_method.json` in --out, which `load_model`, `--method` and every connector
accept. Rerunning `calibrate layers` with the same options resumes a killed search.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_mspoe.eval.settings_search.bezier_ga import GASettings
from rag_mspoe.eval.settings_search.fitness import METRICS, CalibrationSplit, FitnessWeights
from rag_mspoe.eval.settings_search.optimizers import OPTIMIZERS, CMAESSettings
from rag_mspoe.models.command_options import add_model_options, model_load_options

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="fit layer factors, a static Ms-PoE head order or the positional hidden dimension to a model",
        description="Calibrate a method for one model on generated examples; writes a method config.",
    )
    commands = parser.add_subparsers(dest="calibration", metavar="WHAT", required=True)
    for run, add_options in (
        (_layers, _layers_options),
        (_heads, _heads_options),
        (_hidden, _hidden_options),
        (_search, _search_options),
        (_ranking, _ranking_options),
    ):
        add_options(_command(commands, run))


# -- shared options ---------------------------------------------------------------------------------
def _common_options(parser: argparse.ArgumentParser, task: str, examples: int, heldout: int) -> None:
    parser.add_argument(
        "--out", required=True, help="folder for the config, the report and (layers) checkpoints"
    )
    add_model_options(parser)
    split = parser.add_argument_group("data (generated; calibration and held-out differ by seed)")
    split.add_argument(
        "--task",
        choices=("qa", "kv"),
        default=task,
        help=f"invented-fact QA or KV retrieval (default {task})",
    )
    split.add_argument("--documents", type=int, default=5, help="documents (or key-value pairs) per prompt")
    split.add_argument(
        "--examples", type=int, default=examples, help="calibration examples, each at 3 gold positions"
    )
    split.add_argument("--data-seed", type=int, default=1, help="generator seed of the calibration split")
    split.add_argument(
        "--heldout-examples", type=int, default=heldout, help="held-out examples (0: no held-out check)"
    )
    split.add_argument("--heldout-seed", type=int, default=2, help="generator seed of the held-out split")
    split.add_argument(
        "--distractor-similarity", type=float, default=0.5, help="QA only: how alike distractors are"
    )
    scoring = parser.add_argument_group("fitness (Eq. 11)")
    scoring.add_argument(
        "--metric",
        choices=METRICS,
        default="choice",
        help="A in Eq. 11: forced-choice accuracy, the gold's choice probability, or its log-likelihood",
    )
    scoring.add_argument(
        "--weights",
        default="0.2,0.3,0.5",
        help="lambda first,middle,last; Eq. 12 needs first < middle < last",
    )


def _splits(args: argparse.Namespace) -> tuple[CalibrationSplit, CalibrationSplit | None]:
    def split(examples: int, seed: int) -> CalibrationSplit:
        return CalibrationSplit(args.task, args.documents, examples, seed, args.distractor_similarity)

    if args.heldout_examples and args.heldout_seed == args.data_seed:
        raise ValueError(
            "--heldout-seed equals --data-seed: the held-out split would repeat the calibration examples."
        )
    heldout = split(args.heldout_examples, args.heldout_seed) if args.heldout_examples else None
    return split(args.examples, args.data_seed), heldout


def add_dataclass_options(
    parser: argparse.ArgumentParser, cls: type, prefix: str = "", title: str = ""
) -> None:
    """One --option per field of a settings dataclass, typed and with the field's help text."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        kind = hints[item.name]
        default = item.default
        if default is dataclasses.MISSING or item.name == "head_order":
            continue
        flag = "--" + (prefix + item.name).replace("_", "-")
        text = item.metadata.get("help", item.name.replace("_", " "))
        help_text = f"{text} Default: {default}." if text.endswith(".") else f"{text} (default {default})"
        if kind in (int, float, str):
            group.add_argument(flag, type=kind, default=default, help=help_text, dest=prefix + item.name)
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(
                flag, choices=typing.get_args(kind), default=default, help=help_text, dest=prefix + item.name
            )
        else:  # sequences and optional lists: comma-separated numbers
            group.add_argument(
                flag,
                default=default,
                help=help_text + ", comma-separated",
                dest=prefix + item.name,
                type=lambda text: [float(v) if "." in v else int(v) for v in text.split(",")],
            )


def dataclass_from_args(cls: type, args: argparse.Namespace, prefix: str = "", **extra: Any) -> Any:
    values = {
        f.name: getattr(args, prefix + f.name)
        for f in dataclasses.fields(cls)
        if hasattr(args, prefix + f.name)
    }
    for item in dataclasses.fields(cls):  # tuples stay tuples (frozen settings compare by value)
        if isinstance(item.default, tuple) and isinstance(values.get(item.name), list):
            values[item.name] = tuple(values[item.name])
    return cls(**values, **extra)


def _engine(args: argparse.Namespace) -> Any:
    from rag_mspoe.engine import Engine

    return Engine.load(args.model, **model_load_options(args))


def _command(commands: Any, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """The parser of the subcommand `run` runs, named as it is (`_layers`: `layers`); its docstring's
    first paragraph is the command's help, the rest its description."""
    help_text, _, description = (inspect.getdoc(run) or "").partition("\n\n")
    parser: argparse.ArgumentParser = commands.add_parser(
        run.__name__.lstrip("_"), help=" ".join(help_text.split()), description=description
    )
    parser.set_defaults(func=run)
    return parser


def _config_path(args: argparse.Namespace) -> Path:
    return Path(args.out) / "rag_mspoe_method.json"


def _timed(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, then the wall time of the run printed after all it printed (not when it fails)."""

    @functools.wraps(run)
    def timed(args: argparse.Namespace) -> int:
        started = time.monotonic()
        code = run(args)
        print(f"wall time of this run: {time.monotonic() - started:.0f} s")
        return code

    return timed


def _print_written(args: argparse.Namespace, found: str | None, none_found: str) -> None:
    """What a search on real questions found and where its config is, or that it wrote none."""
    if found is None:
        print(f"{none_found}; no config written.")
    else:
        print(f"{found} -> {_config_path(args)}")


@dataclasses.dataclass
class _Fitted:
    """A method fitted on the calibration split, with what its report records of the fit."""

    engine: EngineLike
    heldout: CalibrationSplit | None
    result: Any
    wall_s: float
    facts: dict[str, Any]  # wall time and the calibration split, for report.json


def _fit(args: argparse.Namespace, fit: Callable[[EngineLike, CalibrationSplit], Any]) -> _Fitted:
    """`fit(engine, calibration split)` timed, on the model and splits the options name."""
    from rag_mspoe.files import check_output_folder

    # A folder of a fit before is the command's: its config comes first, then report.json.
    check_output_folder(args.out, "report.json", early=(_config_path(args).name,))
    calibration_split, heldout_split = _splits(args)
    engine = _engine(args)
    started = time.monotonic()
    result = fit(engine, calibration_split)
    wall_s = time.monotonic() - started
    facts = {"wall_s": wall_s, "calibration_split": calibration_split.identity()}
    return _Fitted(engine, heldout_split, result, wall_s, facts)


def _print_rows(rows: list[dict[str, Any]]) -> None:
    from rag_mspoe.eval.settings_search.report import comparison_markdown

    print(comparison_markdown(rows), end="")


# -- layers -----------------------------------------------------------------------------------------
def _layers_options(parser: argparse.ArgumentParser) -> None:
    _common_options(parser, task="qa", examples=16, heldout=48)
    search = parser.add_argument_group("search")
    search.add_argument(
        "--optimizers", default="ga,cmaes", help=f"comma-separated, from {', '.join(OPTIMIZERS)}"
    )
    search.add_argument(
        "--budget",
        type=int,
        default=None,
        help="distinct fitness evaluations per optimiser (default: what the GA spends)",
    )
    search.add_argument("--ray", action="store_true", help="evaluate fitness in parallel over Ray")
    search.add_argument("--workers", type=int, default=2, help="Ray workers, each with its own model copy")
    add_dataclass_options(parser, GASettings, title="genetic algorithm and grid (Algorithm 1, Table 1)")
    add_dataclass_options(parser, CMAESSettings, prefix="cmaes_", title="CMA-ES")


@_timed
def _layers(args: argparse.Namespace) -> int:
    """per-layer RoPE factors from a Bezier curve, searched by the constrained GA (and CMA-ES)

    Search the control points of a Bezier curve of per-layer interpolation factors (layer-specific
    scaling paper, Section 3.3) with each optimiser at the same budget of fitness evaluations, then
    compare the picks with none, pi and mspoe on a held-out split.
    """
    from rag_mspoe.eval.settings_search.fitness import LocalEvaluator, RayEvaluator, start_ray_workers
    from rag_mspoe.eval.settings_search.report import write_report
    from rag_mspoe.eval.settings_search.search import LayerSearch, SearchSettings

    settings = SearchSettings(
        optimizers=tuple(name.strip() for name in args.optimizers.split(",")),
        metric=args.metric,
        weights=FitnessWeights.parse(args.weights),
        budget=args.budget,
        ga=dataclass_from_args(GASettings, args),
        cmaes=dataclass_from_args(CMAESSettings, args, prefix="cmaes_"),
    )
    calibration_split, heldout_split = _splits(args)
    engine = _engine(args)
    num_layers = int(engine.model.config.num_hidden_layers)
    with contextlib.ExitStack() as workers_running:  # Ray replicas stop when the search ends
        if args.ray:
            workers = workers_running.enter_context(
                start_ray_workers(
                    args.model,
                    args.workers,
                    threads=args.threads or 1,
                    device=args.device,
                    dtype=args.dtype,
                    quantize=args.quantize,
                )
            )
            calibration: Any = RayEvaluator(workers, calibration_split, engine.name)
            heldout: Any = RayEvaluator(workers, heldout_split, engine.name) if heldout_split else None
        else:
            calibration = LocalEvaluator(engine, calibration_split)
            heldout = LocalEvaluator(engine, heldout_split) if heldout_split else None
        search = LayerSearch(args.out, settings, calibration, num_layers)
        results = search.run()
        rows = search.compare(results, heldout)
    weights = settings.weights
    note = (
        f"Fitness U = {weights.first}*A_first + {weights.middle}*A_middle + {weights.last}*A_last, "
        f"A = {settings.metric} on the calibration split."
    )
    summary = write_report(Path(args.out), results, rows, num_layers, note)
    for result in results:
        print(
            f"{result.name}: control points {list(result.best)}, calibration fitness {result.fitness:.4f}, "
            f"{result.evaluations} evaluations, {result.wall_s:.0f} s"
        )
    _print_rows(rows)
    print(f"config: {_config_path(args)}\nreport: {summary}")
    return 0


# -- heads ------------------------------------------------------------------------------------------
def _heads_options(parser: argparse.ArgumentParser) -> None:
    from rag_mspoe.methods import MsPoE

    _common_options(parser, task="qa", examples=16, heldout=0)
    add_dataclass_options(parser, MsPoE, title="Ms-PoE settings of the frozen method")


def _heads(args: argparse.Namespace) -> int:
    """static Ms-PoE: head order from position-awareness averaged over calibration prompts

    Average Ms-PoE's position-awareness scores over the calibration prompts and freeze the head order,
    so generation skips the per-prompt ranking.
    """
    from rag_mspoe.eval.settings_search.heads import calibrate_head_order
    from rag_mspoe.methods import MsPoE

    def fit(engine: EngineLike, split: CalibrationSplit) -> Any:
        return calibrate_head_order(
            engine, [item.prompt for item in split.items()], base=dataclass_from_args(MsPoE, args)
        )

    fitted = _fit(args, fit)
    config, report = fitted.result
    _save(args, fitted.engine, config, {**report, **fitted.facts})
    lines = [f"| {layer} | {' '.join(map(str, order))} |" for layer, order in enumerate(report["head_order"])]
    _write_markdown(
        args,
        "Static Ms-PoE head order",
        ["| layer | heads, most position-aware first |", "|---|---|", *lines],
        fitted.wall_s,
    )
    _compare(args, fitted.engine, fitted.heldout, [("mspoe", MsPoE()), ("mspoe-static", config)])
    return 0


# -- hidden -----------------------------------------------------------------------------------------
def _hidden_options(parser: argparse.ArgumentParser) -> None:
    from rag_mspoe.eval.settings_search.hidden_dims import DimensionSearchSettings

    _common_options(parser, task="kv", examples=16, heldout=0)
    add_dataclass_options(parser, DimensionSearchSettings, prefix="dim_", title="dimension search")


def _hidden(args: argparse.Namespace) -> int:
    """positional hidden dimension and factor for HiddenScale

    Find the hidden dimension whose value tracks position, and the factor that lowers the gold answers'
    loss on the calibration split; writes no config if none beats the unmodified model.
    """
    from rag_mspoe.eval.settings_search.hidden_dims import (
        DimensionSearchSettings,
        search_positional_dimension,
    )

    def fit(engine: EngineLike, split: CalibrationSplit) -> Any:
        validation = [(item.prompt, item.gold) for item in split.items()]
        return search_positional_dimension(
            engine, validation, dataclass_from_args(DimensionSearchSettings, args, "dim_")
        )

    fitted = _fit(args, fit)
    result = fitted.result
    report = {**result.to_dict(), **fitted.facts}
    lines = ["| dimension | monotone layers | smoothness | loss per factor |", "|---|---|---|---|"]
    lines += [
        f"| {c['dimension']} | {c['monotone_layers']} | {c['smoothness']:.3g} | "
        + ", ".join(f"{f}: {loss:.4f}" for f, loss in c.get("losses", {}).items())
        + " |"
        for c in result.candidates
    ]
    lines.insert(0, f"Unmodified model's loss: {result.baseline_loss:.4f}. Chosen: {result.config}\n")
    if result.config is None:
        _write_json(Path(args.out) / "report.json", report)
        _write_markdown(args, "Positional hidden dimension", lines, fitted.wall_s)
        print("No dimension and factor beat the unmodified model; no config written.")
        return 0
    _save(args, fitted.engine, result.config, report)
    _write_markdown(args, "Positional hidden dimension", lines, fitted.wall_s)
    _compare(args, fitted.engine, fitted.heldout, [("hidden", result.config)])
    return 0


# -- search -----------------------------------------------------------------------------------------
def _real_question_options(parser: argparse.ArgumentParser, what: str) -> None:
    """The run folder and the real questions of a search or study, and their gold positions."""
    parser.add_argument("--out", required=True, help=f"folder of the {what} (resumed when it exists)")
    parser.add_argument("--data", required=True, help=f"QA examples (lost-in-the-middle format) to {what} on")
    parser.add_argument("--documents", type=int, default=10, help="documents per prompt (default 10)")
    parser.add_argument(
        "--positions", default="0,4,9", help="comma-separated gold positions, 0-based (default 0,4,9)"
    )


def _search_options(parser: argparse.ArgumentParser) -> None:
    from rag_mspoe.eval.settings_search.spaces import SPACES

    _real_question_options(parser, "search")
    parser.add_argument("--space", required=True, choices=sorted(SPACES), help="the candidates' method")
    parser.add_argument(
        "--rungs", default="16,48,144", help="new questions per rung, comma-separated (default 16,48,144)"
    )
    parser.add_argument("--keep", type=int, default=4, help="candidates kept from one rung to the next")
    parser.add_argument(
        "--worst-weight",
        type=float,
        default=1.0,
        help="weight of the gain at the unmodified model's worst position in the fitness (default 1)",
    )
    parser.add_argument(
        "--budget-hours", type=float, default=None, help="stop after this many hours; rerun to go on"
    )
    add_model_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


@_timed
def _search(args: argparse.Namespace) -> int:
    """a method's settings on real questions: successive halving over a search space

    Score every candidate of a search space on a few questions of --data (gold log-likelihood at each
    gold position, against the unmodified model), keep the best and score them on new questions, rung
    after rung. Budgeted and resumable: rerun the same command to go on. Writes rag_mspoe_method.json
    only when the winner beats the unmodified model; validate it on questions it was not searched on
    with `rag-mspoe sweep`.
    """
    from rag_mspoe import load_model
    from rag_mspoe.eval.settings_search.halving import HalvingSearch, HalvingSettings
    from rag_mspoe.eval.settings_search.spaces import space_candidates

    settings = HalvingSettings(
        data=str(Path(args.data).resolve()),
        space=args.space,
        num_documents=args.documents,
        positions=tuple(int(p) for p in args.positions.split(",")),
        rungs=tuple(int(n) for n in args.rungs.split(",")),
        keep=args.keep,
        worst_weight=args.worst_weight,
        model=args.model,
    )
    model, tokenizer = load_model(args.model, **model_load_options(args))
    search = HalvingSearch(
        args.out, settings, space_candidates(args.space, int(model.config.num_hidden_layers))
    )
    tables = search.run(
        budget_hours=args.budget_hours, model=model, tokenizer=tokenizer, progress=not args.no_progress
    )
    print((Path(args.out) / "ranking.md").read_text(), end="")
    if len(tables) != len(settings.rungs):
        print(f"{len(tables)} of {len(settings.rungs)} rungs done; rerun the same command to go on.")
        return 0
    winner = search.winner(tables)
    _print_written(
        args,
        None if winner is None else f"Winner: {winner.label}",
        "No candidate beats the unmodified model on the search questions",
    )
    return 0


# -- ranking ----------------------------------------------------------------------------------------
def _ranking_options(parser: argparse.ArgumentParser) -> None:
    _real_question_options(parser, "study")
    parser.add_argument("--samples", type=int, default=40, help="questions (default 40)")
    parser.add_argument("--blocks", type=int, default=8, help="layer bands are runs of this many blocks")
    parser.add_argument("--strengths", default="0,0.5,1,1.5,2", help="bias strengths, comma-separated")
    parser.add_argument("--no-progress", action="store_true", help="no line per recorded prompt")
    add_model_options(parser)


@_timed
def _ranking(args: argparse.Namespace) -> int:
    """calibrated reordering's layers and bias strength: how often its ranking puts the gold first

    One pass per prompt records the question's attention on each document in every layer; every band of
    layers and bias strength is then scored by how often it ranks the gold document first. Resumable
    (attention.jsonl). Writes rag_mspoe_method.json when a setting beats the default's ranking (paired p
    < 0.05); validate it on other questions with `rag-mspoe sweep`.
    """
    from rag_mspoe.eval.settings_search.ranking import study
    from rag_mspoe.eval.sweep.plan import SweepConfig, load_examples

    positions = [int(p) for p in args.positions.split(",")]
    config = SweepConfig(
        data=str(Path(args.data).resolve()),
        num_documents=args.documents,
        positions=tuple(positions),
        samples=args.samples,
        metrics=("loglik",),
    )
    table, best = study(
        _engine(args),
        load_examples(config),
        positions,
        Path(args.out),
        blocks=args.blocks,
        strengths=[float(s) for s in args.strengths.split(",")],
        progress=not args.no_progress,
    )
    print(table, end="")
    _print_written(
        args,
        None if best is None else f"Best: {best.label}",
        "No setting ranks the gold first significantly more often than the default",
    )
    return 0


# -- outputs of heads and hidden ----------------------------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    from rag_mspoe.eval.settings_search.search import write_json

    write_json(path, data)


def _save(args: argparse.Namespace, engine: EngineLike, config: Any, report: dict[str, Any]) -> None:
    path = config.save(args.out, base_model=engine.name)
    _write_json(Path(args.out) / "report.json", report)
    print(f"config: {path}")


def _write_markdown(args: argparse.Namespace, title: str, lines: list[str], wall_s: float) -> None:
    path = Path(args.out) / "summary.md"
    path.write_text(f"# {title}\n\nWall time: {wall_s:.0f} s\n\n" + "\n".join(lines) + "\n")
    print(f"report: {path}")


def _compare(
    args: argparse.Namespace, engine: EngineLike, heldout: CalibrationSplit | None, methods: list[Any]
) -> None:
    """With --heldout-examples: forced choice of the result against the unmodified model."""
    if heldout is None:
        return
    from rag_mspoe.eval.settings_search.fitness import FitnessCache, LocalEvaluator, utility
    from rag_mspoe.eval.settings_search.report import comparison_markdown
    from rag_mspoe.eval.settings_search.search import comparison_rows

    weights = FitnessWeights.parse(args.weights)
    rows = comparison_rows(
        {"held-out": LocalEvaluator(engine, heldout)},
        FitnessCache(Path(args.out) / "fitness_cache.jsonl"),
        [("none", None), *methods],
        lambda scores: utility(scores, weights, args.metric),
    )
    _write_json(Path(args.out) / "heldout.json", rows)
    with (Path(args.out) / "summary.md").open("a") as handle:
        handle.write("\n## Held-out forced-choice accuracy (%)\n\n" + comparison_markdown(rows))
    _print_rows(rows)
