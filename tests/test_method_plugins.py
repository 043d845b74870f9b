"""A method in another installed package registers through the `rag_mspoe.methods` entry-point
group and then works in the commands and the server, without a line of this package changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe import Compose, LayerWise, MethodConfig, MsPoE, Pine, Uniform
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.methods import HiddenScale
from rag_mspoe.methods.registry import METHODS
from rag_mspoe.rope.hooks import ModelHooks

# The whole of a third party's package: one module and the metadata pip would write for a
# pyproject with `[project.entry-points."rag_mspoe.methods"] shift = "shift_method:Shift"`.
PLUGIN = '''
from dataclasses import dataclass
from typing import Any, ClassVar

from rag_mspoe.methods.method_config import MethodConfig, check_factor, number_argument
from rag_mspoe.rope.rotary_scaling import RopeScaling


@dataclass
class Shift(RopeScaling):
    """RoPE positions divided by `factor` in the upper half of the layers."""

    kind: ClassVar[str] = "shift"
    presets: ClassVar[dict[str, dict[str, Any]]] = {"shift": {}}
    argument_name: ClassVar[str] = "shift"
    factor: float = 2.0

    def __post_init__(self) -> None:
        check_factor("factor", self.factor)

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        return cls(factor=number_argument(part, argument))

    def layer_factors(self, num_layers: int) -> list[float]:
        return [1.0 if layer < num_layers // 2 else self.factor for layer in range(num_layers)]
'''


def install_plugin(folder: Path, module: str = PLUGIN, entry: str = "shift_method:Shift") -> Path:
    """The package as `pip install --target folder` leaves it: the module and its dist-info."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shift_method.py").write_text(textwrap.dedent(module))
    info = folder / "shift_method-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shift-method\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rag_mspoe.methods]\nshift = {entry}\n")
    return folder


def run_with(plugins: Path, *argv: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI (or a snippet) in a fresh interpreter that has the plugin package on its path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(plugins)}
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "rag_mspoe.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def test_an_installed_plugin_method_runs_in_a_sweep_alone_and_composed(model_dir, tmp_path):
    plugins = install_plugin(tmp_path / "site")
    out = tmp_path / "run"
    common = ["--model", str(model_dir), "--documents", "4", "--samples", "2", "--no-progress"]
    methods = ["none", "shift:3", "shift+layerwise"]
    result = run_with(plugins, "sweep", "--out", str(out), "--methods", *methods, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(out / "results.jsonl")
    assert {r["method"] for r in records} == set(methods)
    # The method changed the model: its gold-answer scores are not the unmodified model's.
    score = {(r["method"], r["example_id"], r["position"]): r["gold_logprob"] for r in records}
    assert any(score[("shift:3", *key[1:])] != value for key, value in score.items() if key[0] == "none")

    # Without the package installed, the same name is unknown: nothing else made it work.
    alone = run_with(
        tmp_path / "empty", "sweep", "--out", str(tmp_path / "x"), "--methods", "shift:3", *common
    )
    assert alone.returncode == 1 and "Unknown method 'shift:3'" in alone.stderr


def test_the_server_offers_a_plugin_method_as_a_model(model_dir, tmp_path):
    plugins = install_plugin(tmp_path / "site")
    code = f"""
from rag_mspoe.connectors.server import ModelRoutes
from rag_mspoe.engine import Engine
routes = ModelRoutes(Engine.load({str(model_dir)!r}))
print(routes.names())
print(routes.method_for(routes.engine.name + "+shift"))
"""
    result = run_with(plugins, code=code)
    assert result.returncode == 0, result.stderr[-3000:]
    names, method = result.stdout.splitlines()[-2:]
    assert "+shift'" in names  # "<model>+shift", beside "<model>+mspoe" and the rest
    assert method == "Shift(factor=2.0)"


def test_a_broken_plugin_is_named_and_the_rest_still_works(tmp_path):
    plugins = install_plugin(tmp_path / "site", module="raise ImportError('needs numpy 9')\n")
    code = "from rag_mspoe import parse_method; print(json.dumps(parse_method('pi:2').to_dict()))"
    result = run_with(plugins, code=f"import json; {code}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["factor"] == 2.0
    assert (
        "method plugin shift = 'shift_method:Shift' (package shift-method) failed to import" in result.stderr
    )
    assert "needs numpy 9" in result.stderr and "Fix or uninstall that package" in result.stderr


def test_a_refused_composition_names_the_pair_and_why():
    with pytest.raises(
        ValueError, match=r"Pine does not compose .*: it .*; apply it on its own, not with MsPoE"
    ):
        Compose([MsPoE(), Pine()])
    with pytest.raises(ValueError, match=r"HiddenScale does not compose .*not with Uniform"):
        Compose([Uniform(), HiddenScale(dimension=3)])
    # Methods of the RoPE family share their hooks and stack.
    assert (
        Compose([LayerWise(factors=[1.0, 2.0]), Uniform(2.0), MsPoE()]).hooks_class()
        is Uniform().hooks_class()
    )


def test_composing_methods_with_different_hooks_are_refused_by_name():
    @dataclass
    class Tilt(MethodConfig):
        kind: ClassVar[str] = "tilt-test"
        hooks: ClassVar[Any] = ModelHooks
        composes: ClassVar[bool] = True

    try:
        with pytest.raises(
            ValueError,
            match=r"Uniform and Tilt do not compose: they are applied by different hooks "
            r"\(RotaryScaleState and ModelHooks\)",
        ):
            Compose([Uniform(), Tilt()])
    finally:
        del METHODS["tilt-test"]  # other tests must not meet it
