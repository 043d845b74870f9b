"""A built wheel installs in a fresh virtual environment and provides all four import packages."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The four top-level folders, and the folder of shipped calibrated configs.
PACKAGES = [
    "rag_mspoe",
    "rag_mspoe.connectors",
    "rag_mspoe.pipelines",
    "rag_mspoe.eval",
    "rag_mspoe.calibrated",
]


@pytest.mark.slow
def test_wheel_installs_and_imports_all_packages(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            tmp_path,
            ROOT,
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("rag_mspoe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for folder in ("rag_mspoe", "rag_mspoe/connectors", "rag_mspoe/pipelines", "rag_mspoe/eval"):
        assert f"{folder}/__init__.py" in names
    # The shipped configs and their validation records, which the demo shows without a clone.
    shipped = [
        path.relative_to(ROOT).as_posix() for path in (ROOT / "rag_mspoe" / "calibrated").rglob("*.json")
    ]
    assert any("/validation/" in name for name in shipped)
    assert set(shipped) <= set(names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", wheel], check=True)
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
    assert all(str(env_dir) in f for f in files), files
