"""An evaluation kind defined in this file alone, as one `Evaluation` subclass, gets its own
`rag-mspoe` command from the real parser, and `report` and `compare` read its run folders."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe.cli import build_parser, main
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import RESULTS_FILE, Key, read_records
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve_all
from rag_mspoe.models.command_options import model_load_options
from rag_mspoe.models.loading import source_name


@dataclass(frozen=True)
class TokenCountConfig:
    words: tuple[str, ...]
    methods: tuple[str, ...]
    model: str | None = None


@pytest.fixture(scope="module")
def token_count():
    @dataclass
    class TokenCount(Evaluation):
        """Units: (method, word); a record: how many tokens the model's tokenizer makes of the word."""

        kind = "token-count"
        command_help = "tokens per word, per method"
        pairing = Pairing(None, ("word",), ("tokens",))
        key_fields = ("method", "word")
        identity_fields = ("words", "model")
        config: TokenCountConfig
        methods: Sequence[ResolvedMethod]

        def plan(self, folder: Path, done: set[Key]) -> list[tuple[str, str]]:
            units = [(m.name, word) for m in self.methods for word in self.config.words]
            return [unit for unit in units if unit not in done]

        def scorer(self, model: Any, tokenizer: Any) -> Scorer:
            def score(unit: tuple[str, str]) -> list[dict[str, Any]]:
                method, word = unit
                return [{"method": method, "word": word, "tokens": len(tokenizer(word)["input_ids"])}]

            return score

        @classmethod
        def report(cls, folder: Path, options: argparse.Namespace) -> str:
            records = read_records(folder / RESULTS_FILE)
            return f"{len(records)} words counted, {sum(r['tokens'] for r in records)} tokens in all"

        @classmethod
        def add_options(cls, parser: argparse.ArgumentParser) -> None:
            parser.add_argument("words", nargs="+")
            parser.add_argument("--out", required=True)
            parser.add_argument("--methods", nargs="+", default=["none"])

        @classmethod
        def run_command(cls, args: argparse.Namespace) -> int:
            config = TokenCountConfig(tuple(args.words), tuple(args.methods), args.model)
            methods = resolve_all(config.methods, source_name(config.model))
            outcome = run_evaluation(
                cls(config, methods), args.out, **model_load_options(args), progress=not args.no_progress
            )
            print(f"{outcome.written} records written")
            return 0

    yield TokenCount
    del Evaluation.registry[TokenCount.kind]  # other test files must not meet it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"))


def test_its_command_runs_resumes_reports_and_compares(token_count, model_dir, tmp_path, capsys):
    assert "tokens per word, per method" in build_parser().format_help()
    count = ["token-count", "harbour", "lighthouse", "--model", str(model_dir), "--no-progress"]
    a, b = tmp_path / "a", tmp_path / "b"

    assert main([*count, "--out", str(a)]) == 0
    assert "2 records written" in capsys.readouterr().out
    assert main([*count, "--out", str(a), "--methods", "none", "pi"]) == 0  # resumed: only pi's are new
    assert "2 records written" in capsys.readouterr().out
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["token-count"]["methods"] == ["none", "pi"]
    assert len(read_records(a / RESULTS_FILE)) == 4

    assert main(["report", str(a)]) == 0
    tokens = sum(record["tokens"] for record in read_records(a / RESULTS_FILE))
    assert capsys.readouterr().out == f"4 words counted, {tokens} tokens in all\n"

    assert main([*count, "--out", str(b)]) == 0
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 0
    assert "| none | all | 2 |" in capsys.readouterr().out

    assert main([*count[:2], "--out", str(a), "--model", str(model_dir)]) == 1  # other words: refused
    assert "a token-count run with other settings" in capsys.readouterr().err


def test_a_kind_without_its_command_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"Mute \(kind 'mute'\) has no command_help, run_command"):

        class Mute(Evaluation):
            kind = "mute"

            @classmethod
            def add_options(cls, parser: argparse.ArgumentParser) -> None:
                parser.add_argument("--out", required=True)

    assert "mute" not in Evaluation.registry
