"""The manifest of a run folder: what was run, on which model, with which code.

`manifest.json` holds the sweep settings, every method's full config, the model, package
versions and the git commit, plus one entry per session of the run (a resumed run adds one).
A resumed run must match what the manifest says made the records already there; a folder with
records but no manifest is refused, since nothing says what made them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rag_mspoe.eval.registry import EvalMethod
from rag_mspoe.eval.results import RESULTS_FILE
from rag_mspoe.eval.sweep import SweepConfig

MANIFEST_FILE = "manifest.json"
_PACKAGES = ("rag-mspoe", "torch", "transformers", "numpy", "faiss-cpu", "sentence-transformers", "ray")


def package_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def git_state() -> dict[str, Any]:
    """Commit of the source tree this package runs from, and whether it had uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}  # an installed wheel: no repository around it
    return {"commit": commit, "dirty": bool(status.strip())}


def model_facts(model: Any) -> dict[str, Any]:
    from rag_mspoe import model_display_name

    config = model.config
    return {
        "name": model_display_name(model),
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None),
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": getattr(config, "rope_parameters", None),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        return dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); restore it or start in a new folder.") from exc


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    path = folder / MANIFEST_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def start_session(folder: Path, config: SweepConfig, methods: list[EvalMethod]) -> dict[str, Any]:
    """Check the folder holds this sweep (or nothing) and record a new session; returns the manifest.

    A resumed run must have the same settings; it may add methods and positions. A method
    name must keep meaning the same config.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        refuse_records_without_manifest(folder)
        manifest = {"sweep": config.to_dict(), "methods": {}, "sessions": []}
    else:
        previous = SweepConfig.from_dict(manifest["sweep"])
        refuse_other_settings(folder, "a run of another sweep", previous.identity(), config.identity())
        merged = config.to_dict()
        merged["methods"] = list(dict.fromkeys([*previous.methods, *config.methods]))
        merged["positions"] = sorted({*previous.positions, *config.positions})
        manifest["sweep"] = merged
    record_methods(manifest, methods, folder)
    manifest["sessions"].append(new_session(host_cpus=os.cpu_count()))
    return manifest


def refuse_other_settings(folder: Path, what: str, previous: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise ValueError naming every setting of `current` that differs from the run in `folder`."""
    differing = {key: (previous.get(key), new) for key, new in current.items() if previous.get(key) != new}
    if differing:
        details = ", ".join(f"{key}: {old!r} there, {new!r} now" for key, (old, new) in differing.items())
        raise ValueError(
            f"{folder} holds {what} ({details}); rerun with the same settings to resume it, "
            "or write into a new folder."
        )


def refuse_records_without_manifest(folder: Path) -> None:
    """A results file whose manifest is gone: resuming would describe records this run did not make."""
    results = folder / RESULTS_FILE
    if results.is_file() and results.stat().st_size:
        raise ValueError(
            f"{results} holds records but {folder / MANIFEST_FILE} is missing, so nothing says which "
            f"settings made them; restore {MANIFEST_FILE}, or write into a new folder."
        )


def check_resume(folder: Path, kind: str, identity: dict[str, Any], methods: list[EvalMethod]) -> None:
    """Refuse to resume a `kind` run (e2e, perplexity, ...) in `folder` unless `identity` (the
    settings its records depend on) matches and every method label keeps meaning the same config."""
    manifest = read_manifest(folder)
    if manifest is None:
        refuse_records_without_manifest(folder)
        return
    previous = manifest.get(kind) or {}
    refuse_other_settings(folder, f"a {kind} run with other settings", previous, jsonable(identity))
    check_methods(manifest, methods, folder)


def record_session(
    folder: Path, kind: str, settings: dict[str, Any], methods: list[EvalMethod], model: Any
) -> None:
    """Write the manifest of a `kind` run after `check_resume`: its settings (methods of earlier
    sessions kept), the methods' configs, the model, and this session."""
    manifest = read_manifest(folder) or {"methods": {}, "sessions": []}
    settings = jsonable(settings)
    earlier = (manifest.get(kind) or {}).get("methods", [])
    settings["methods"] = list(dict.fromkeys([*earlier, *settings["methods"]]))
    manifest[kind] = settings
    record_methods(manifest, methods, folder)
    manifest["model"] = model_facts(model)
    manifest["sessions"].append(new_session())
    write_manifest(folder, manifest)


def check_methods(manifest: dict[str, Any], methods: list[EvalMethod], folder: Path) -> None:
    """Refuse a method name that meant another config in this run folder: its records would mix."""
    for method in methods:
        known = manifest.get("methods", {}).get(method.name)
        if known is not None and known != jsonable(method.to_dict()):
            raise ValueError(
                f"Method name {method.name!r} meant another config in {folder}; "
                "give this one another label (label=spec)."
            )


def record_methods(manifest: dict[str, Any], methods: list[EvalMethod], folder: Path) -> None:
    """Add the methods' full configs to the manifest, after `check_methods`."""
    check_methods(manifest, methods, folder)
    manifest.setdefault("methods", {}).update({m.name: jsonable(m.to_dict()) for m in methods})


def new_session(**extra: Any) -> dict[str, Any]:
    """A manifest's entry for one session of a run: when, with which packages and code."""
    return {"started": _now(), "versions": package_versions(), "git": git_state(), **extra}


def finish_session(manifest: dict[str, Any], model: dict[str, Any], records: int, complete: bool) -> None:
    manifest["model"] = model
    manifest["sessions"][-1].update({"finished": _now(), "records": records, "complete": complete})


def jsonable(data: Any) -> Any:
    """`data` as JSON would give it back (tuples as lists, other objects as strings), for comparing."""
    return json.loads(json.dumps(data, default=str))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
