"""Running the real `rag-mspoe` CLI in a subprocess (or killing it mid-run), and proving what it
left untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
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


def kill_once_written(argv: list[str | Path], results: Path, lines: int, timeout: float = 120) -> None:
    """Start the CLI and SIGKILL it as soon as `results` holds `lines` lines (it must still be running)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rag_mspoe.cli", *map(str, argv)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if results.is_file() and results.read_bytes().count(b"\n") >= lines:
                break
            time.sleep(0.005)
        assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else ""
    finally:
        process.kill()  # SIGKILL: no cleanup runs, as when a machine dies
        process.wait()
        if process.stderr:
            process.stderr.close()
