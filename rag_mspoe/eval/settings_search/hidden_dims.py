"""Find the positional hidden dimension to scale (positional hidden-state scaling paper, Section 3.2).

1. Average each layer's hidden states over random-token inputs (no content, only position).
2. Per layer and dimension, min-max normalise the tokens after the first `skip`, fit a cubic
   and call the dimension monotone there if the fit's differences keep one sign.
3. Keep dimensions monotone in more than `monotone_fraction` of the layers; rank them by
   smoothness (sum of squared second differences after a Savitzky-Golay filter, smaller is
   smoother) and keep the `top_k` smoothest.
4. Score each with every factor by the teacher-forced loss of the gold answers of a
   validation set (KV retrieval in the paper), against the unmodified model; pick the lowest,
   or report that none beats the unmodified model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from rag_mspoe.methods import HiddenScale

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike


@dataclass
class DimensionSearchSettings:
    samples: int = 4  # random-token sequences averaged
    length: int = 1024  # tokens per sequence
    skip: int = 300  # leading tokens left out of the fit: the first positions behave differently
    monotone_fraction: float = 0.25  # monotone in more than this fraction of the layers
    top_k: int = 10  # smoothest candidates scored on the validation set
    factors: tuple[float, ...] = (0.5, 0.0, -0.5, -1.0)
    layers: list[int] | None = None  # layers to scale; None: HiddenScale's default (middle layers)
    savgol_window: int = 51
    savgol_order: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.skip + 8 > self.length:
            raise ValueError(f"length ({self.length}) must exceed skip ({self.skip}) by at least 8 tokens.")
        if not self.factors:
            raise ValueError("Give at least one scaling factor to try.")


@dataclass
class DimensionSearchResult:
    config: HiddenScale | None  # None: no candidate beat the unmodified model
    baseline_loss: float
    candidates: list[dict[str, Any]] = field(default_factory=list)  # with their loss per factor
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict() if self.config else None,
            "baseline_loss": self.baseline_loss,
            "candidates": self.candidates,
            "settings": self.settings,
        }


def positional_profile(engine: EngineLike, settings: DimensionSearchSettings) -> np.ndarray:
    """[layers, T, hidden]: each layer's output averaged over random-token sequences."""
    tokenizer = engine.tokenizer
    vocab = engine.model.config.vocab_size
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([t for t in range(vocab) if t not in special])
    rng = np.random.default_rng(settings.seed)
    total: np.ndarray | None = None
    for _ in tqdm(range(settings.samples), desc="hidden states", leave=False):
        ids = rng.choice(allowed, size=settings.length).tolist()
        states = engine.prefill(ids, method="none", hidden_states=True).hidden_states
        assert states is not None  # asked for with hidden_states=True
        layers = np.stack([h.numpy() for h in states[1:]])  # skip the embeddings
        total = layers if total is None else total + layers
    assert total is not None
    return total / settings.samples


def _normalised_tail(profile: np.ndarray, skip: int) -> tuple[np.ndarray, np.ndarray]:
    """Min-max normalised [layers, T', hidden] after `skip`, and which entries are not constant."""
    tail = profile[:, skip:, :]
    low, high = tail.min(axis=1, keepdims=True), tail.max(axis=1, keepdims=True)
    spread = high - low
    varies = spread[:, 0, :] > 0
    return (tail - low) / np.where(spread > 0, spread, 1.0), varies


def monotone_layer_counts(profile: np.ndarray, skip: int) -> np.ndarray:
    """[hidden]: in how many layers a cubic fit of each dimension against position is monotone."""
    normalised, varies = _normalised_tail(profile, skip)
    steps = normalised.shape[1]
    x = np.linspace(0.0, 1.0, steps)
    design = np.vander(x, 4)
    counts = np.zeros(profile.shape[2], dtype=int)
    for layer in range(profile.shape[0]):
        coefficients, *_ = np.linalg.lstsq(design, normalised[layer], rcond=None)
        slope = np.diff(design @ coefficients, axis=0)
        monotone = (slope >= 0).all(axis=0) | (slope <= 0).all(axis=0)
        counts += monotone & varies[layer]
    return counts


def smoothness(profile: np.ndarray, skip: int, dims: Sequence[int], window: int, order: int) -> np.ndarray:
    """Per dimension: squared second differences of the Savitzky-Golay-filtered curves, summed over layers."""
    from scipy.signal import savgol_filter

    normalised, _ = _normalised_tail(profile[:, :, list(dims)], skip)
    window = min(window, normalised.shape[1] - (1 - normalised.shape[1] % 2))  # odd, within the curve
    filtered = savgol_filter(normalised, window_length=window, polyorder=min(order, window - 1), axis=1)
    return (np.diff(filtered, n=2, axis=1) ** 2).sum(axis=(0, 1))


def candidate_dimensions(profile: np.ndarray, settings: DimensionSearchSettings) -> list[dict[str, Any]]:
    """The `top_k` smoothest dimensions monotone in more than the set fraction of layers."""
    counts = monotone_layer_counts(profile, settings.skip)
    eligible = np.flatnonzero(counts > settings.monotone_fraction * profile.shape[0])
    if eligible.size == 0:
        return []
    scores = smoothness(
        profile, settings.skip, eligible.tolist(), settings.savgol_window, settings.savgol_order
    )
    best = np.argsort(scores, kind="stable")[: settings.top_k]
    return [
        {
            "dimension": int(eligible[i]),
            "monotone_layers": int(counts[eligible[i]]),
            "smoothness": float(scores[i]),
        }
        for i in best
    ]


def validation_loss(engine: EngineLike, validation: Sequence[tuple[Any, str]], method: Any) -> float:
    """Mean per-token negative log-likelihood of each gold answer after its prompt."""
    losses = []
    for prompt, answer in validation:
        ((total, tokens),) = engine.score_continuations(prompt, [answer], method=method)
        losses.append(-total / tokens)
    return float(np.mean(losses))


def search_positional_dimension(
    engine: EngineLike,
    validation: Sequence[tuple[Any, str]],
    settings: DimensionSearchSettings | None = None,
    *,
    progress: bool = True,
) -> DimensionSearchResult:
    """Run the whole search; `validation` holds (prompt, gold answer) pairs."""
    settings = settings or DimensionSearchSettings()
    if not validation:
        raise ValueError("The validation set is empty; give (prompt, gold answer) pairs, e.g. KV retrieval.")
    candidates = candidate_dimensions(positional_profile(engine, settings), settings)
    baseline = validation_loss(engine, validation, "none")
    best: tuple[float, HiddenScale] | None = None
    trials = [(c, f) for c in candidates for f in settings.factors]
    for candidate, factor in tqdm(trials, desc="validation", disable=not progress):
        method = HiddenScale(dimension=candidate["dimension"], factor=factor, layers=settings.layers)
        loss = validation_loss(engine, validation, method)
        candidate.setdefault("losses", {})[str(factor)] = loss
        if best is None or loss < best[0]:
            best = (loss, method)
    chosen = best[1] if best is not None and best[0] < baseline else None
    return DimensionSearchResult(chosen, baseline, candidates, asdict(settings))
