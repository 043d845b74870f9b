"""The flat modules that moved into subpackages are still importable by their old paths."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import rag_mspoe
from rag_mspoe.moved_modules import MOVED

PACKAGE = Path(rag_mspoe.__file__).parent


def forget(old: str) -> None:
    """Drop an old name from the import cache, as in a fresh interpreter (the module stays loaded)."""
    sys.modules.pop(old, None)
    rag_mspoe.__dict__.pop(old.rpartition(".")[2], None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_moved_module_and_names_its_new_path(old):
    new = importlib.import_module(MOVED[old])
    forget(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is new
    # The module keeps its own identity: pickling, reloading and tracebacks use the new path.
    assert module.__spec__.name == MOVED[old]
    assert module.__name__ == MOVED[old]


def test_the_old_paths_are_files_no_more_and_the_new_ones_are():
    for old, new in MOVED.items():
        assert not (PACKAGE.parent / f"{old.replace('.', '/')}.py").exists(), old
        assert (PACKAGE.parent / f"{new.replace('.', '/')}.py").is_file(), new


def test_old_spellings_of_an_import_all_work(monkeypatch):
    from rag_mspoe.models import loading

    forget("rag_mspoe.loading")
    with pytest.warns(DeprecationWarning):
        from rag_mspoe import loading as old_loading  # the `from package import module` form
    assert old_loading is loading

    forget("rag_mspoe.loading")
    with pytest.warns(DeprecationWarning):
        assert rag_mspoe.loading is loading  # an attribute of the package, never imported by name

    # Patching by the old dotted path patches the module code runs.
    monkeypatch.setattr("rag_mspoe.loading.default_threads", lambda: 7)
    assert loading.default_threads() == 7


def test_a_name_that_never_existed_is_still_an_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rag_mspoe.no_such_module")
    with pytest.raises(AttributeError, match="no_such_module"):
        rag_mspoe.no_such_module  # noqa: B018
