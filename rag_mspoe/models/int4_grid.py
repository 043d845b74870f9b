"""Recover the 4-bit grid a GGUF Q4_K / Q4_1 weight was stored on (`int4_grid`).

Within each block of 32 inputs of a row, such a tensor's de-quantised values are exactly
`q * s - m` with q in 0..15 (one scale and one minimum per block). Re-fitting a block by its
minimum and maximum loses that grid whenever the block does not use both end codes; reading the
step off the values does not: the step is span / n for an n in 1..15 that puts every value a
whole number of steps from the block's minimum (not every level need be present, so the
smallest gap between values may be several steps). A block with no such n (Q6_K, Q8_0 or Q5_0
blocks, a plain float weight) is off the grid, and so is its whole layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LEVELS = 16
# A value may sit this far (in steps) from its grid level: the file's own float32 rounding of
# q * s - m, far below the distance of an off-grid value (Q6_K/Q8_0 steps are incommensurate).
TOLERANCE = 1e-3
# Rows examined at a time: bounds the sort's temporaries for a large output layer.
_CHUNK_ROWS = 4096
_PROBE_ROWS = 64


class Int4Grid(NamedTuple):
    """Codes [N, K] in 0..15 and per-group scale and zero [K / group, N], float32:
    value = (code - 8) * scale + zero, the int4 kernel's convention."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def int4_grid(weight: torch.Tensor, group_size: int = 32) -> Int4Grid | None:
    """The weight's 4-bit grid in groups of `group_size` inputs, or None if any group is off it."""
    if weight.shape[1] % group_size:
        return None
    parts = []
    # A few rows first: a layer off the grid is refused before the rest of it is examined.
    first = min(_PROBE_ROWS, weight.shape[0])
    for rows in (weight[:first], *weight[first:].split(_CHUNK_ROWS)):
        part = _grid_rows(rows.float(), group_size)
        if part is None:
            return None
        parts.append(part)
    return Int4Grid(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts], 1),
        torch.cat([p.zero for p in parts], 1),
    )


def _grid_rows(weight: torch.Tensor, group_size: int) -> Int4Grid | None:
    n, k = weight.shape
    groups = weight.view(n, k // group_size, group_size)
    low = groups.amin(-1)
    span = groups.amax(-1) - low
    flat = span == 0  # one level only: any step represents it
    steps = _fewest_steps((groups - low[..., None]).view(-1, group_size), span.flatten()).view_as(span)
    if bool(((steps == 0) & ~flat).any()):
        return None
    step = torch.where(flat, 0.0, span / steps.clamp(min=1))
    codes = torch.round((groups - low[..., None]) / torch.where(flat, 1.0, step)[..., None])
    # Centre the used codes in 0..15: the kernel scales (code - 8), so a rounded scale errs least there.
    offset = torch.div(LEVELS - 1 - steps, 2, rounding_mode="floor")
    codes = (codes + offset[..., None]).view(n, k).to(torch.int32)
    zero = low + (8 - offset) * step
    return Int4Grid(codes, step.T.contiguous(), zero.T.contiguous())


def _fewest_steps(above_low: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Per block [B, group] of values less the block's minimum, the fewest steps (1..15) that put
    each a whole number of steps from 0, or 0 if none does.

    The smallest gap between levels may be several steps (levels 0, 2 and 7 of a block), so the
    step is found by trying counts; the file's own step (the fewest) keeps float32 sums exact.
    """
    inverse = 1 / span.clamp(min=torch.finfo(span.dtype).tiny)
    steps = torch.zeros_like(span)

    def settle(count: int, blocks: torch.Tensor) -> None:
        position = above_low[blocks] * (count * inverse[blocks])[:, None]
        fits = (position - torch.round(position)).abs().amax(-1) <= TOLERANCE
        steps[blocks[fits]] = float(count)

    # Most Q4_K blocks span all 15 steps; their fewest count divides 15.
    spanning = (span > 0).nonzero().squeeze(1)
    position = above_low[spanning] * ((LEVELS - 1) * inverse[spanning])[:, None]
    full = spanning[(position - torch.round(position)).abs().amax(-1) <= TOLERANCE]
    for count in (1, 3, 5, 15):
        settle(count, full[steps[full] == 0])
    for count in range(1, LEVELS - 1):
        settle(count, spanning[steps[spanning] == 0])
    return steps
