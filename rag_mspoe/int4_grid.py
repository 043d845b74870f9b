"""Recover the 4-bit grid a GGUF Q4_K / Q4_1 weight was stored on (`int4_grid`).

Within each block of 32 inputs of a row, such a tensor's de-quantised values are exactly
`q * s - m` with q in 0..15 (one scale and one minimum per block). Re-fitting a block by its
minimum and maximum loses that grid whenever the block does not use both end codes; reading the
step off the values does not: the step is span / n for the fewest n in 1..15 that puts every value
a whole number of steps from the block's minimum (not every level need be present, so the
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
    for rows in weight.split(_CHUNK_ROWS):
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
    # The fewest steps (1..15) that put every value of a block on a whole step from its minimum:
    # the smallest gap between levels may be several steps (levels 0, 2 and 7 of a block).
    steps = torch.zeros_like(span)
    for count in range(1, LEVELS):
        position = (groups - low[..., None]) * (count / span.clamp(min=torch.finfo(span.dtype).tiny))[
            ..., None
        ]
        fits = (position - torch.round(position)).abs().amax(-1) <= TOLERANCE
        steps = torch.where((steps == 0) & fits, float(count), steps)
    flat = span == 0  # one level only: any step represents it
    if bool(((steps == 0) & ~flat).any()):
        return None
    step = torch.where(flat, 0.0, span / steps.clamp(min=1))
    codes = torch.round((groups - low[..., None]) / torch.where(flat, 1.0, step)[..., None])
    # Centre the used codes in 0..15: the kernel scales (code - 8), so a rounded scale errs least there.
    offset = torch.div(LEVELS - 1 - steps, 2, rounding_mode="floor")
    codes = (codes + offset[..., None]).view(n, k).to(torch.int32)
    zero = low + (8 - offset) * step
    return Int4Grid(codes, step.T.contiguous(), zero.T.contiguous())
