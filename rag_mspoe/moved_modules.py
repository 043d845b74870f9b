"""Old module paths, still importable: each flat module that moved into a subpackage.

`import rag_mspoe.loading` (or `from rag_mspoe import loading`, or `mock.patch("rag_mspoe.loading.x")`)
gives the module now at `rag_mspoe.models.loading` (the same module object, so patching either
name patches both) and warns once with a DeprecationWarning naming the new path. One finder on
`sys.meta_path`, installed when this module is imported (first thing `import rag_mspoe` does),
does it for every entry of MOVED; no file is left at an old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# old path -> new path. `rag_mspoe.engine` and `rag_mspoe.methods` kept their names: they became
# the packages, and still export the names code imported from them.
MOVED = {
    f"rag_mspoe.{name}": f"rag_mspoe.{package}.{name}"
    for package, names in {
        "engine": [
            "document_prefix",
            "engine_base",
            "engine_generation",
            "engine_scoring",
            "engine_types",
            "prefix_scoring",
            "stopping",
            "text_stream",
            "token_logprobs",
        ],
        "methods": ["hidden_scaling", "method_config", "method_spec"],
        "models": ["devices", "embedded_models", "loading", "model_cache", "models_command", "quantization"],
        "prompts": ["chat_template", "document_prompts", "template_encoding"],
        "tools": [
            "grammar",
            "json_output",
            "tool_calls",
            "tool_format",
            "tool_grammar",
            "tool_parsing",
            "tool_stream",
        ],
    }.items()
    for name in names
}


def moved(old: str) -> ModuleType:
    """The module now at old's new path, with the warning that names it."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)


class _Alias(importlib.abc.Loader):
    """Loads an old path as the already imported module at its new path."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # Importing under the old name stamped the old spec on the module: give it back its own.
        module.__spec__ = self.spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(moved(fullname)))


if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
