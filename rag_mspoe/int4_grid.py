"""Recover the 4-bit grid a GGUF Q4_K / Q4_1 weight was stored on (`int4_grid`).

Within each block of 32 inputs of a row, such a tensor's de-quantised values are exactly
`q * s - m` with q in 0..15 (one scale and one minimum per block). Re-fitting a block by its
minimum and maximum loses that grid whenever the block does not use both end codes; reading the
step off the distinct values does not: it is the smallest gap between them (not every level need
be present, but any two levels are a whole number of steps apart), refined as span / steps. A block
whose values are not whole steps from its minimum, or span more than 15 steps (Q6_K, Q8_0, Q5_0
blocks, a plain float weight), is off the grid, and so is its whole layer.
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
    ordered = groups.sort(-1).values
    low, span = ordered[..., 0], ordered[..., -1] - ordered[..., 0]
    gaps = ordered.diff(dim=-1)
    smallest = torch.where(gaps > 0, gaps, torch.inf).amin(-1)
    flat = span == 0  # one level only: any step represents it
    steps = torch.where(flat, 0.0, torch.round(span / smallest))
    if bool((steps > LEVELS - 1).any()):
        return None
    step = torch.where(flat, 1.0, span / steps.clamp(min=1))
    position = (groups - low[..., None]) / step[..., None]
    codes = torch.round(position)
    if bool(((position - codes).abs() > TOLERANCE).any()):
        return None
    # Centre the used codes in 0..15: the kernel scales (code - 8), so a rounded scale errs least there.
    offset = torch.div(LEVELS - 1 - steps, 2, rounding_mode="floor")
    codes = (codes + offset[..., None]).view(n, k).to(torch.int32)
    scale = torch.where(flat, 0.0, step)
    zero = low + (8 - offset) * scale
    return Int4Grid(codes, scale.T.contiguous(), zero.T.contiguous())
