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
