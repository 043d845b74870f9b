"""The short report of a layer-factor search: fitness per generation and factors per layer as PNG,
factors and the calibration vs held-out comparison as Markdown."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_mspoe.eval.settings_search.fitness import POSITIONS
from rag_mspoe.eval.settings_search.search import OptimizerResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Label, grid and legend the axes, write the figure to `path` and free it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_fitness(results: Sequence[OptimizerResult], path: Path) -> Path:
    """Best-so-far (solid) and generation mean (dashed) fitness against evaluations spent."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for result in results:
        spent = [row["evaluations"] for row in result.history]
        (line,) = ax.plot(
            spent, [row["best_so_far"] for row in result.history], marker="o", label=f"{result.name} best"
        )
        ax.plot(
            spent,
            [row["mean"] for row in result.history],
            linestyle="--",
            color=line.get_color(),
            label=f"{result.name} generation mean",
        )
    return _save(
        plt,
        fig,
        ax,
        path,
        "distinct fitness evaluations",
        "fitness U (calibration split)",
        "Layer-factor search",
    )


def plot_factors(results: Sequence[OptimizerResult], num_layers: int, path: Path) -> Path:
    """The chosen factor of every layer, with each curve's control points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    layers = list(range(num_layers))
    for result in results:
        (line,) = ax.plot(layers, result.config.layer_factors(num_layers), label=result.name)
        ax.scatter(
            [x for x, _ in result.best], [y for _, y in result.best], color=line.get_color(), marker="x"
        )
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":", label="unmodified")
    return _save(
        plt,
        fig,
        ax,
        path,
        "layer",
        "RoPE interpolation factor",
        "Calibrated factors per layer (x: control points)",
    )


def factors_markdown(results: Sequence[OptimizerResult], num_layers: int) -> str:
    names = [r.name for r in results]
    lines = ["| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    columns = [r.config.layer_factors(num_layers) for r in results]
    for layer in range(num_layers):
        lines.append(f"| {layer} | " + " | ".join(f"{column[layer]:.3f}" for column in columns) + " |")
    points = [f"- {r.name}: control points {[(x, y) for x, y in r.best]}" for r in results]
    return "\n".join([*points, "", *lines]) + "\n"


def comparison_markdown(rows: Sequence[dict[str, Any]], measure: str = "accuracy") -> str:
    """Per gold position, in %: forced-choice `accuracy` or the gold's choice `probability`; their
    average, and the fitness U."""
    lines = [
        "| split | method | first | middle | last | average | U |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        values = [100 * row["scores"][measure][p] for p in POSITIONS]
        cells = " | ".join(f"{v:.1f}" for v in values)
        average = f"{sum(values) / len(values):.1f}"
        lines.append(f"| {row['split']} | {row['method']} | {cells} | {average} | {row['fitness']:.4f} |")
    return "\n".join(lines) + "\n"


def optimizers_markdown(results: Sequence[OptimizerResult]) -> str:
    lines = ["| optimiser | evaluations | calibration fitness | wall time (s) |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.evaluations} | {r.fitness:.4f} | {r.wall_s:.0f} |")
    return "\n".join(lines) + "\n"


def write_report(
    folder: Path,
    results: Sequence[OptimizerResult],
    rows: Sequence[dict[str, Any]],
    num_layers: int,
    fitness_note: str = "",
) -> Path:
    """fitness.png, factors.png, factors.md and summary.md in `folder`; returns summary.md.

    fitness_note: how U was computed (metric, weights), printed above the tables."""
    folder.mkdir(parents=True, exist_ok=True)
    plot_fitness(results, folder / "fitness.png")
    plot_factors(results, num_layers, folder / "factors.png")
    (folder / "factors.md").write_text(factors_markdown(results, num_layers))
    summary = folder / "summary.md"
    summary.write_text(
        f"# Layer-factor calibration\n\n{fitness_note}\n\n## Optimisers (same budget of evaluations)\n\n"
        + optimizers_markdown(results)
        + "\n## Forced-choice accuracy (%) by gold position\n\n"
        + comparison_markdown(rows)
        + "\n## The gold's forced-choice probability (%) by gold position\n\n"
        + comparison_markdown(rows, "probability")
        + "\n![fitness per generation](fitness.png)\n\n![factors per layer](factors.png)\n"
    )
    return summary
