"""The manifest of a run folder: what was run, on which model, with which code.

`manifest.json` holds the run's settings (under its kind: sweep, suite, harness, perplexity or
e2e), every method's full config, the digests of its input files, the model, package versions
and the git commit, plus one entry per session of the run (a resumed run adds one).
A resumed run must match what the manifest says made the records already there (see
`runs.loop`); a folder with records but no manifest is refused, since nothing says what made them.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Collection, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rag_mspoe.eval.runs.inputs import with_digests
from rag_mspoe.eval.runs.results import RESULTS_FILE
from rag_mspoe.files import atomic_write, check_output_folder
from rag_mspoe.methods.method_spec import ResolvedMethod

MANIFEST_FILE = "manifest.json"
_PACKAGES = (
    "rag-mspoe",
    "torch",
    "transformers",
    "numpy",
    "faiss-cpu",
    "sentence-transformers",
    "ray",
    "lm-eval",
)


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
    import torch

    from rag_mspoe import model_display_name
    from rag_mspoe.models.quantization import quantization_of

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
        "quantization": quantization_of(model),  # "int8": Linear layers in int8, the rest in dtype
        "threads": torch.get_num_threads(),  # intra-op threads of the process that scores
    }


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); restore it or start in a new folder (--out)."
        ) from exc
    if not isinstance(manifest, dict):
        raise ValueError(
            f"{path} is not a run's manifest (not a JSON object); restore it, or write into a new folder "
            "(--out)."
        )
    return manifest


def claim_run_folder(folder: Path, early_files: Collection[str]) -> None:
    """Refuse a folder a run cannot write into: a file, or a folder of files no run wrote (a run's
    folder holds its manifest; `early_files` are those a kind writes before it). Records without
    their manifest are refused first, with the fix for that."""
    if folder.is_dir() and not (folder / MANIFEST_FILE).is_file():
        refuse_records_without_manifest(folder)
    check_output_folder(folder, MANIFEST_FILE, early=early_files)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    atomic_write(folder / MANIFEST_FILE, (json.dumps(manifest, indent=2, default=str) + "\n").encode())


def refuse_other_settings(
    folder: Path,
    what: str,
    previous: dict[str, Any],
    current: dict[str, Any],
    digests: Mapping[str, str] | None = None,
) -> None:
    """Raise ValueError naming every setting of `current` that differs from the run in `folder`;
    a setting that names an input file is shown with the file's sha256 from `digests`."""
    differing = {key: (previous.get(key), new) for key, new in current.items() if previous.get(key) != new}
    if differing:
        details = ", ".join(
            f"{key}: {with_digests(old, digests or {})} there, {with_digests(new, digests or {})} now"
            for key, (old, new) in differing.items()
        )
        raise ValueError(
            f"{folder} holds {what} ({details}); rerun with the same settings to resume it, "
            "or write into a new folder (--out)."
        )


def refuse_records_without_manifest(folder: Path) -> None:
    """A results file whose manifest is gone: resuming would describe records this run did not make."""
    results = folder / RESULTS_FILE
    if results.is_file() and results.stat().st_size:
        raise ValueError(
            f"{results} holds records but {folder / MANIFEST_FILE} is missing, so nothing says which "
            f"settings made them; restore {MANIFEST_FILE}, or write into a new folder (--out)."
        )


def record_methods(manifest: dict[str, Any], methods: list[ResolvedMethod], folder: Path) -> None:
    """Add the methods' full configs to the manifest; a name that meant another config in this
    run folder is refused, since its records would mix."""
    known = manifest.setdefault("methods", {})
    for method in methods:
        config = jsonable(method.to_dict())
        if method.name in known and _as_now(known[method.name]) != config:
            raise ValueError(
                f"Method name {method.name!r} meant another config in {folder}; "
                "give this one another label (label=spec), or write into a new folder (--out)."
            )
        known[method.name] = config


def _as_now(recorded: dict[str, Any]) -> Any:
    """A config a manifest recorded, as this version writes it: a setting added to a method since
    then takes its default, so the config means what it meant."""
    from rag_mspoe.methods.method_spec import ResolvedMethod

    try:
        return jsonable(ResolvedMethod.from_dict(recorded).to_dict())
    except (KeyError, TypeError, ValueError):
        return recorded  # no longer readable: compared as written


def new_session(**extra: Any) -> dict[str, Any]:
    """A manifest's entry for one session of a run: when, with which packages and code."""
    return {"started": _now(), "versions": package_versions(), "git": git_state(), **extra}


def finish_session(manifest: dict[str, Any], records: int, complete: bool) -> None:
    manifest["sessions"][-1].update({"finished": _now(), "records": records, "complete": complete})


def jsonable(data: Any) -> Any:
    """`data` as JSON would give it back (tuples as lists, other objects as strings), for comparing."""
    return json.loads(json.dumps(data, default=str))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
