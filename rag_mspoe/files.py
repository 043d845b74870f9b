"""Writing files safely (atomic replacement, one writer per folder) and knowing them by content."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

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


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, in hex, read in blocks (a data file may be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def path_sha256(path: str | os.PathLike[str]) -> str:
    """A file's sha256 (`file_sha256`), or a folder's: the sha256 of the relative names and sha256s
    of the files under it, in name order, leaving out hidden ones as indexing does. A file edited,
    added, removed or renamed in the folder changes it."""
    root = Path(path)
    if not root.is_dir():
        return file_sha256(root)
    digest = hashlib.sha256()
    for child in sorted(root.rglob("*")):
        relative = child.relative_to(root)
        if child.is_file() and not any(part.startswith(".") for part in relative.parts):
            digest.update(f"{relative.as_posix()}\0{file_sha256(child)}\n".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike[str], busy_message: str) -> Iterator[None]:
    """Hold `folder` for one writer; a second one fails at once with `busy_message`.

    An OS lock on `folder/.lock` (flock on POSIX, msvcrt on Windows), so a killed writer never
    leaves the folder locked. On POSIX the file stays after release: removing a file another
    writer may have opened would let two writers lock the same path.
    """
    # Imported here: only writers need it, and `import rag_mspoe` stays light.
    from filelock import FileLock, Timeout

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    # Not thread-local: the lock belongs to this block, whichever thread ends it.
    lock = FileLock(path / LOCK_FILE, thread_local=False)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        raise RuntimeError(busy_message) from None
    try:
        yield
    finally:
        lock.release()
