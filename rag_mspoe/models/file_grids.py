"""The 4-bit grids of a model folder's stored weights, found once per converted GGUF (`FileGrids`).

"int4-exact" and "int8-prompt+int4" read each layer's float32 weight from the folder's
safetensors files (a converted GGUF's de-quantised values) and find the 4-bit grid it lies on
(`rag_mspoe.models.int4_grid`): about a second per large layer, 75 s for the 1.5B's 168 Q4_K layers
on one thread, at every load. In the cache of converted models (`model_cache.cache_dir`) the
grids found are saved once beside the weights (`GRIDS_FILE`, written whole and renamed into
place; codes two to a byte), and later loads read them back. A folder outside that cache, a
user's own, is never written to.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rag_mspoe.models.int4_grid import Int4Grid, int4_grid
from rag_mspoe.models.model_cache import cache_dir

logger = logging.getLogger(__name__)

GRIDS_FILE = "int4-grids.safetensors"
# Saved grids are read back only under the same version: change it when int4_grid's results change.
_VERSION = "1"
_INDEX = "model.safetensors.index.json"
_WEIGHTS = "model.safetensors"


class FileGrids:
    """The grid of each stored weight of `folder` (None: no folder), saved where the cache allows."""

    def __init__(self, folder: str | os.PathLike[str] | None, group_size: int) -> None:
        self._folder = Path(folder) if folder is not None else None
        self._group_size = group_size
        self._files = _stored_files(self._folder)
        self._path = None if self._folder is None else self._folder / GRIDS_FILE
        self._saved, self._saved_off = self._saved_names()
        # The grids this load found, as they are saved (codes two to a byte: 4 bytes a code held
        # until the load ends would outweigh the model); None: off the grid.
        self._found: dict[str, dict[str, torch.Tensor] | None] = {}

    def grid(self, names: list[str], weight: torch.Tensor) -> Int4Grid | None:
        """The grid of the first of a parameter's `names` stored in the folder, else of `weight`."""
        name = next((n for n in names if n in self._files), None)
        if name is None:
            return int4_grid(weight, self._group_size)
        if name in self._saved_off:
            return None
        if name in self._saved:
            return self._read_saved(name)
        with safe_open(self._files[name], "pt") as handle:
            grid = int4_grid(handle.get_tensor(name), self._group_size)
        self._found[name] = None if grid is None else _saved_form(name, grid)
        return grid

    def save(self) -> None:
        """Save the grids found by this load with those saved before, where the folder is in the cache."""
        if not self._found or self._folder is None or self._path is None or not _in_cache(self._folder):
            return
        tensors = self._saved_tensors(self._saved - self._found.keys())
        for saved in self._found.values():
            tensors.update(saved or {})
        off = sorted(self._saved_off | {n for n, saved in self._found.items() if saved is None})
        metadata = {"version": _VERSION, "group_size": str(self._group_size), "off_grid": json.dumps(off)}
        try:
            handle, tmp = tempfile.mkstemp(prefix=f".{GRIDS_FILE}-", dir=self._folder)
            os.close(handle)
            try:
                save_file(tensors, tmp, metadata=metadata)
                os.replace(tmp, self._path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except OSError as exc:
            # A full disk or a read-only cache: this load is done, the next finds them again.
            logger.warning(
                "Could not save the 4-bit grids into %s (%s); they are found again at the next load",
                self._folder,
                exc,
            )

    def _saved_names(self) -> tuple[set[str], set[str]]:
        """(the weights whose grids are saved, those saved as off the grid); none from another version."""
        if self._path is None or not self._path.is_file():
            return set(), set()
        with safe_open(self._path, "pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("version") != _VERSION or metadata.get("group_size") != str(self._group_size):
                return set(), set()  # another grid finder's: found again and overwritten
            stored = handle.keys()  # a file handle, not a dict
        return {key.rsplit(".", 1)[0] for key in stored}, set(json.loads(metadata.get("off_grid", "[]")))

    def _read_saved(self, name: str) -> Int4Grid:
        """One weight's saved grid, read as its layer is quantised (all at once: 4 bytes a code held)."""
        assert self._path is not None  # a name is saved only where the file is
        codes, scale, zero = _keys(name)
        with safe_open(self._path, "pt") as handle:
            return Int4Grid(
                _from_two_per_byte(handle.get_tensor(codes)),
                handle.get_tensor(scale),
                handle.get_tensor(zero),
            )

    def _saved_tensors(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The saved tensors of some weights' grids, as saved."""
        if self._path is None or not names:
            return {}
        with safe_open(self._path, "pt") as handle:
            return {key: handle.get_tensor(key) for name in names for key in _keys(name)}


def _keys(name: str) -> tuple[str, str, str]:
    return f"{name}.codes", f"{name}.scale", f"{name}.zero"


def _saved_form(name: str, grid: Int4Grid) -> dict[str, torch.Tensor]:
    codes, scale, zero = _keys(name)
    return {codes: _two_per_byte(grid.codes), scale: grid.scale.contiguous(), zero: grid.zero.contiguous()}


def _stored_files(folder: Path | None) -> dict[str, Path]:
    """Each tensor name stored in the folder's safetensors files, and its file."""
    if folder is not None and (folder / _INDEX).is_file():
        index = json.loads((folder / _INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in index.items()}
    if folder is not None and (folder / _WEIGHTS).is_file():
        with safe_open(folder / _WEIGHTS, "pt") as handle:
            return dict.fromkeys(handle.keys(), folder / _WEIGHTS)
    return {}


def _in_cache(folder: Path) -> bool:
    return folder.resolve().is_relative_to(cache_dir().resolve())


def _two_per_byte(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 (K even) as bytes [N, K / 2]: the even column low, the odd one high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _from_two_per_byte(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], -1).view(packed.shape[0], -1)
    return codes.to(torch.int32)
