"""A method registered from this file alone reaches every place that takes a method: the spec
language, saved configs, rescale, the engine, a sweep, lm-evaluation-harness batching and the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import httpx
import pytest
import torch
from eval_run_helpers import tiny_chat_model
from server_helpers import running

from rag_mspoe import Compose, MethodConfig, Uniform, current_method, load_method, method_name, rescaled
from rag_mspoe.engine import Engine
from rag_mspoe.eval.harness import needs_batch_size_one
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep
from rag_mspoe.methods.method_config import NAMED_METHODS, number_argument
from rag_mspoe.methods.method_spec import parse_method, resolve
from rag_mspoe.methods.registry import METHODS
from rag_mspoe.rope.hooks import ModelHooks


class ToyHooks(ModelHooks):
    """Scales the token embeddings: a change every forward shows, and easy to check by hand."""

    def _install(self) -> None:
        strength = self.method.strength

        def scale(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            return output * strength

        self._handles.append(self.decoder.embed_tokens.register_forward_hook(scale))


@pytest.fixture(scope="module")
def toy():
    @dataclass
    class Toy(MethodConfig):
        kind: ClassVar[str] = "toy"
        hooks: ClassVar[Any] = ToyHooks
        presets: ClassVar[dict[str, dict[str, Any]]] = {"toy": {}}
        argument_name: ClassVar[str] = "toy"
        strength: float = 0.5

        @classmethod
        def from_argument(cls, part: str, argument: str) -> MethodConfig:
            return cls(strength=number_argument(part, argument))

        def reads_last_row(self) -> bool:
            return True

    yield Toy
    del METHODS["toy"]  # other test files must not meet it


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


def test_the_spec_language_and_saved_configs_know_it(toy, tmp_path):
    assert parse_method("toy") == toy() and "toy" in NAMED_METHODS
    assert parse_method("toy:2") == toy(strength=2.0)
    assert resolve("t=toy:2").method == toy(strength=2.0)
    assert method_name(toy()) == "toy"
    assert load_method(toy(strength=3.0).save(tmp_path)) == toy(strength=3.0)
    with pytest.raises(ValueError, match="not a number"):
        parse_method("toy:x")
    with pytest.raises(ValueError, match="Toy does not compose"):
        Compose([toy(), Uniform()])
    assert needs_batch_size_one(toy()) and not needs_batch_size_one(Uniform())


def test_a_clashing_name_is_refused(toy):
    with pytest.raises(ValueError, match=r"spec name\(s\) \['pi'\]"):

        @dataclass
        class Clash(MethodConfig):
            kind: ClassVar[str] = "clash"
            presets: ClassVar[dict[str, dict[str, Any]]] = {"pi": {}}

    assert "clash" not in METHODS


def test_rescale_applies_its_hooks_and_the_engine_runs_it(toy, tiny):
    model, tokenizer = tiny
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        expected = model(inputs_embeds=model.model.embed_tokens(ids) * 2.0).logits
        with rescaled(model, "toy:2"):
            assert torch.allclose(model(ids).logits, expected)
        assert current_method(model) is None

    engine = Engine(model, tokenizer, method="none")
    plain = engine.loglikelihood("Say a word.", ["yes"])
    scaled = engine.loglikelihood("Say a word.", ["yes"], method="toy:2")
    assert scaled != plain
    assert engine.generate("Say a word.", max_new_tokens=2, method="toy:2").method == "toy"
    assert current_method(model) is None


def test_a_sweep_scores_it(toy, tiny, tmp_path):
    config = SweepConfig(
        num_documents=3, positions=(0, 2), methods=("none", "toy:2"), samples=1, metrics=("loglik",)
    )
    run_sweep(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    records = read_records(tmp_path / "results.jsonl")
    by_method = {m: [r["gold_logprob"] for r in records if r["method"] == m] for m in ("none", "toy:2")}
    assert len(by_method["toy:2"]) == 2 and by_method["toy:2"] != by_method["none"]


def test_the_server_answers_with_it(toy, tiny):
    pytest.importorskip("fastapi")
    from rag_mspoe.connectors.server import create_app

    engine = Engine(*tiny, method="none")
    with running(create_app(engine, max_tokens_limit=8)) as url:
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert f"{engine.name}+toy" in [m["id"] for m in models]
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": f"{engine.name}+toy",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "temperature": 0,
            },
        ).json()
    expected = engine.generate([{"role": "user", "content": "hi"}], max_new_tokens=3, method="toy")
    assert reply["choices"][0]["message"]["content"] == expected.text
