"""Calibrated method configs shipped with the package, one per embedded model, like adapters.

`method="calibrated"` (and `--method calibrated`) resolves to `<model name>.json` in this
folder for the loaded model, the name `rag-mspoe models` lists. A config gets here only after it
was calibrated on that model and measured on held-out data; `rag-mspoe calibrate` writes one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rag_mspoe.methods.method_config import MethodConfig, load_method

# Folders searched in order; the package's own folder only, unless a test adds one.
SEARCH_PATH: list[Path] = [Path(__file__).parent]

_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # model names that can be file names


class NoCalibratedMethodError(ValueError):
    """No calibrated config ships for a model; the message says how to make and use one."""


def calibrated_config_path(model_name: str) -> Path | None:
    """The shipped config for `model_name`, or None."""
    if not _FILE_NAME.fullmatch(model_name):
        return None  # a hub id or a path: never a shipped name
    for folder in SEARCH_PATH:
        path = folder / f"{model_name}.json"
        if path.is_file():
            return path
    return None


def shipped_models() -> list[str]:
    """The models a calibrated config ships for."""
    return sorted({path.stem for folder in SEARCH_PATH for path in folder.glob("*.json")})


def default_method(model_name: str, documents: int | None = None) -> str:
    """The method `ask` applies when told none: "calibrated" where a config ships for the model (it
    won on questions it was not chosen on) and, when the prompts' document count is known, was
    validated at that count; else "none". Ms-PoE at its published ratios made the Qwen models'
    answers worse at every position, so no rescaling is on unasked. Where the count varies (a
    server, a chain), "auto" decides per prompt (`rag_mspoe.methods.where_validated`)."""
    if calibrated_config_path(model_name) is None:
        return "none"
    counts = calibrated_method(model_name).validated_documents
    return "calibrated" if documents is None or counts is None or documents in counts else "none"


def calibrated_method(model_name: str) -> MethodConfig:
    """The calibrated config for the model `model_name`; NoCalibratedMethodError when none ships."""
    path = calibrated_config_path(model_name)
    if path is None:
        out = f"runs/calibrate-{model_name.replace('/', '-')}"
        shipped = ", ".join(shipped_models()) or "none"
        raise NoCalibratedMethodError(
            f"No calibrated method ships for the model {model_name!r}; one ships for {shipped} (load "
            "one by its name: model=NAME in the LangChain and LlamaIndex adapters, --model NAME in "
            "commands, Engine.load(NAME)). Or make one for this model with "
            f"`rag-mspoe calibrate search --model {model_name} --space calibrated-reorder "
            f"--data questions.jsonl.gz --out {out}` (or `calibrate layers`, `heads`, `hidden`), "
            f"then use it with `--method-config calibrated={out}/rag_mspoe_method.json` "
            f"(serve) or `--method {out}/rag_mspoe_method.json` (any command, and method= in Python)."
        )
    base_model = json.loads(path.read_text()).get("base_model")
    if base_model and base_model != model_name:
        raise NoCalibratedMethodError(
            f"{path} was calibrated for {base_model!r}, not {model_name!r}; it must not ship under that name."
        )
    method = load_method(path)
    object.__setattr__(method, "shipped_as", "calibrated")  # the name users typed, on every screen
    return method
