"""The one registry of methods: each method's config class by its kind, and how it is filled.

A method registers itself: defining a `MethodConfig` subclass that has a `kind` calls `register`
(from `MethodConfig.__init_subclass__`), in whatever module, test or notebook defines it. Every
lookup (`registered_methods`, and so the spec language, saved configs and NAMED_METHODS) first
imports, once per process:

    BUILT_IN_METHODS   the modules of the methods that ship with the package (listed below)
    PLUGIN_GROUP       the methods other installed packages list under this entry-point group,
                       `[project.entry-points."rag_mspoe.methods"] shift = "pkg:Shift"`

so a lookup knows every method whatever the process happened to import before. To ship a method,
add its module to BUILT_IN_METHODS; a method defined anywhere else needs no line here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from importlib import import_module
from typing import Any

# A MethodConfig subclass. method_config registers through this module, so naming the class here,
# even for type checkers only, would close an import cycle.
MethodClass = Any

# The modules of the methods that ship, each defining (and so registering) its config class, in
# the order lookups give them (NAMED_METHODS, the server's model list).
BUILT_IN_METHODS = (
    "rag_mspoe.methods.method_config",  # Compose: several methods at once ("layerwise+pi")
    "rag_mspoe.attention.attention_calibration",  # AttentionCalibration ("attention-calibration")
    "rag_mspoe.attention.reorder",  # CalibratedReorder ("calibrated-reorder")
    "rag_mspoe.attention.invariant_reorder",  # InvariantReorder ("invariant-reorder", ":KEEP")
    "rag_mspoe.methods.where_validated",  # WhereValidated: a shipped reordering where validated ("auto")
    "rag_mspoe.attention.pine",  # Pine: position-invariant inference ("pine", "pine:SOFTNESS")
    "rag_mspoe.methods.hidden_scaling",  # HiddenScale: hidden-state scaling ("hidden:DIM,FACTOR")
    "rag_mspoe.rope.layerwise",  # LayerWise: one factor per layer ("layerwise")
    "rag_mspoe.rope.mspoe",  # MsPoE: per-head ratios ("mspoe", "mspoe:1.2-1.8")
    "rag_mspoe.rope.uniform",  # Uniform: position interpolation ("pi", "pi:2")
)
# Other packages register methods under this entry-point group, each entry naming a MethodConfig
# subclass (or the module defining one).
PLUGIN_GROUP = "rag_mspoe.methods"

# Every registered method by kind: the built-in ones in the order above, then the others as registered.
METHODS: dict[str, MethodClass] = {}
_loaded = False


def register(method: MethodClass) -> None:
    """Add a method's config class under its kind, refused when one of its spec names (presets,
    argument name) is another method's. The kind itself may be registered again (a reloaded module)."""
    taken = {
        name: other.__name__
        for other in METHODS.values()
        if other.kind != method.kind
        for name in (*other.presets, other.argument_name)
        if name
    }
    clashes = sorted(name for name in {*method.presets, method.argument_name} if name in taken)
    if clashes:
        raise ValueError(
            f"{method.__name__} takes the spec name(s) {clashes}, already used by "
            f"{sorted({taken[n] for n in clashes})}; choose other names."
        )
    METHODS[method.kind] = method


def registered_methods() -> Mapping[str, MethodClass]:
    """Every method by kind: the package's own and those installed packages register."""
    global _loaded
    if not _loaded:
        _loaded = True  # first: the modules imported here look methods up themselves
        for module in BUILT_IN_METHODS:
            import_module(module)
        # The built-in ones first, in their list's order, whichever module the process imported first.
        rank = {module: index for index, module in enumerate(BUILT_IN_METHODS)}
        ordered = sorted(METHODS.values(), key=lambda method: rank.get(method.__module__, len(rank)))
        METHODS.clear()
        METHODS.update((method.kind, method) for method in ordered)
        _load_plugins()
    return METHODS


def _load_plugins() -> None:
    """Import the methods other installed packages register. A plugin that fails to import is
    skipped with a warning naming it, so that one broken package does not stop the rest."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=PLUGIN_GROUP):
        owner = f"{entry.name} = {entry.value!r}" + (f" (package {entry.dist.name})" if entry.dist else "")
        try:
            loaded = entry.load()
        except Exception as exc:  # any error of a third party's import: reported, not fatal
            warnings.warn(
                f"The method plugin {owner} failed to import ({type(exc).__name__}: {exc}); its methods "
                "are not available. Fix or uninstall that package.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if isinstance(loaded, type) and loaded not in METHODS.values():
            warnings.warn(
                f"The method plugin {owner} names {loaded.__name__}, which is not a MethodConfig "
                "subclass with a `kind`; point the entry point at the method's config class.",
                RuntimeWarning,
                stacklevel=2,
            )
