"""Writing files safely: atomic replacement, and one writer per folder."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: writers are not serialised there
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename it into place.

    Readers see the old file or the new one, never a half-written one.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A plain exclusive open (not mkstemp) so the file gets the usual permissions from the umask.
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temporary, "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike[str], busy_message: str) -> Iterator[None]:
    """Hold `folder` for one writer; a second one fails at once with `busy_message`."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / LOCK_FILE, "a") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(busy_message) from None
        yield
