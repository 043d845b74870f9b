"""A built wheel installs in a fresh virtual environment, provides all four import packages, and
gives a user's type checker our types."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The package, its connectors, pipelines and eval, and the folder of shipped calibrated configs.
PACKAGES = [
    "rag_mspoe",
    "rag_mspoe.connectors",
    "rag_mspoe.pipelines",
    "rag_mspoe.eval",
    "rag_mspoe.calibrated",
]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel, and the python of a fresh venv it is installed in (without dependencies)."""
    folder = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the sources: setuptools reuses a build/ folder left in the checkout, and
    # would ship whatever an older layout left there.
    source = folder / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".*", "build", "*.egg-info", "__pycache__", "docs", "tests", "benchmarks", "site"
        ),
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", folder, source],
        check=True,
        capture_output=True,
        text=True,
    )
    # A data folder setuptools does not count as a package ships anyway, under a wall of warnings
    # a new user sees on every install.
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr
    (wheel,) = folder.glob("rag_mspoe-*.whl")
    env_dir = folder / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", wheel], check=True)
    return wheel, python


@pytest.mark.slow
def test_wheel_installs_and_imports_all_packages(installed_wheel, tmp_path):
    wheel, python = installed_wheel
    names = zipfile.ZipFile(wheel).namelist()
    for folder in ("rag_mspoe", "rag_mspoe/connectors", "rag_mspoe/pipelines", "rag_mspoe/eval"):
        assert f"{folder}/__init__.py" in names
    assert "rag_mspoe/py.typed" in names
    # The shipped configs and their validation records, which the demo shows without a clone.
    shipped = [
        path.relative_to(ROOT).as_posix() for path in (ROOT / "rag_mspoe" / "calibrated").rglob("*.json")
    ]
    assert any("/validation/" in name for name in shipped)
    assert set(shipped) <= set(names)
    assert any(name.startswith("rag_mspoe/pipelines/demo_corpus/") for name in names)

    # The fresh environment borrows the heavy dependencies (torch, transformers) from this one,
    # appended after its own site-packages, so the wheel, not the source tree, is what imports.
    dependencies = sysconfig.get_paths()["purelib"]
    script = (
        f"import sys; sys.path.append({dependencies!r}); import importlib; "
        f"mods = [importlib.import_module(m) for m in {PACKAGES!r}]; "
        "print('\\n'.join(m.__file__ for m in mods))"
    )
    result = subprocess.run([python, "-c", script], check=True, capture_output=True, text=True, cwd=tmp_path)
    files = result.stdout.split()
    assert len(files) == len(PACKAGES)
    assert all(str(python.parents[1]) in f for f in files), files


# A user's script, and the type each revealed expression must have (never Any).
USER_SCRIPT = """
from rag_mspoe import Engine, EngineLike, MsPoE, parse_method
from rag_mspoe.connectors.langchain import ChatRagMsPoE

engine = Engine.load(method="mspoe")
reveal_type(engine)
reveal_type(engine.method)
reveal_type(engine.generate("Who wrote Hamlet?"))
reveal_type(parse_method("pi:2"))
reveal_type(MsPoE())
like: EngineLike = engine
reveal_type(like.score_continuations("Q", ["a", "b"]))
reveal_type(ChatRagMsPoE)
"""
REVEALED = [
    "rag_mspoe.engine.Engine",
    "rag_mspoe.methods.method_config.MethodConfig | None",
    "rag_mspoe.engine.engine_types.GenerationResult",
    "rag_mspoe.methods.method_config.MethodConfig | None",
    "rag_mspoe.rope.mspoe.MsPoE",
    "list[tuple[float, int]]",
    "rag_mspoe.connectors.langchain.ChatRagMsPoE",
]


@pytest.mark.slow
def test_a_users_type_checker_sees_the_installed_wheels_types(installed_wheel, tmp_path):
    _, python = installed_wheel
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_SCRIPT))
    # mypy from this environment, resolving imports in the fresh venv's site-packages: the wheel,
    # not the source tree (run from an empty folder, with no search path of ours).
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", python, "--no-incremental", "user.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")},
    )
    revealed = [
        line.split("Revealed type is ", 1)[1].strip('"')
        for line in result.stdout.splitlines()
        if "Revealed type" in line
    ]
    assert len(revealed) == len(REVEALED), result.stdout + result.stderr
    for seen, expected in zip(revealed, REVEALED, strict=True):
        assert expected in seen, (seen, expected)  # without our types, mypy reveals Any
