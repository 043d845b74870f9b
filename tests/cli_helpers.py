"""Running the real `rag-mspoe` CLI in a subprocess, and proving what it left untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path


def run_cli(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rag_mspoe.cli", *map(str, argv)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def checksums(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) with the sha256 of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
