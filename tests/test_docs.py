"""The documentation: the site builds in strict mode, and the Python in README.md, the
getting-started page and the page on writing a method runs as written, on the embedded model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The pages a newcomer copies code from. Blocks in another language (bash, text, toml) are not run.
RUNNABLE_PAGES = ["README.md", "docs/getting-started.md", "docs/writing-a-method.md"]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return PYTHON_BLOCK.findall((ROOT / page).read_text())


def test_the_site_builds_strictly(tmp_path):
    # Strict: a link to a missing page or anchor, or an API reference to a missing name, fails.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", tmp_path / "site"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "engine" / "index.html").read_text()
    assert "generate_batch" in reference  # the API reference is generated from the docstrings


def test_the_pages_with_runnable_code_have_some():
    for page in RUNNABLE_PAGES:
        assert python_blocks(page), f"{page} has no ```python block"


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_every_python_block_of_a_page_runs(page, tmp_path):
    # One interpreter per page, its blocks in order: a later block may use an earlier one's names.
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(python_blocks(page)))
    result = subprocess.run(
        [sys.executable, script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"{page}:\n{result.stderr[-4000:]}"
