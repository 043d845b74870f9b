"""What `rag_mspoe` exports is importable and described in its docstring."""

from __future__ import annotations

import re

import rag_mspoe


def test_every_exported_name_is_importable_and_documented():
    for name in rag_mspoe.__all__:
        assert getattr(rag_mspoe, name) is not None, name
        assert re.search(rf"(?<![\w.]){name}\b", rag_mspoe.__doc__ or ""), f"{name} is not documented"


def test_the_engine_is_the_engine_module_s():
    from rag_mspoe.engine import Engine

    assert rag_mspoe.Engine is Engine


def test_the_methods_package_lists_every_built_in_method_once():
    import rag_mspoe.methods as methods
    from rag_mspoe.methods.registry import BUILT_IN_METHODS, registered_methods

    built_in = {cls.__name__ for cls in registered_methods().values() if cls.__module__ in BUILT_IN_METHODS}
    assert len(built_in) == len(BUILT_IN_METHODS)  # one method a module
    assert built_in <= set(methods.__all__)
    for name in methods.__all__:
        assert getattr(methods, name) is not None, name
