"""Writing files safely (atomic replacement, one writer per folder) and knowing them by content."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

LOCK_FILE = ".lock"
# What `atomic_write` leaves of a file when it is killed mid-write.
_TEMPORARY_FILE = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")


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
    # Not thread-local: the lock belongs to this block, whichever thread ends it.
    lock = FileLock(path / LOCK_FILE, thread_local=False)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock.acquire(blocking=False)
    except Timeout:
        raise RuntimeError(busy_message) from None
    except OSError as exc:  # a read-only folder, a file in the way
        raise RuntimeError(
            f"Cannot write into {path}: {exc.strerror}; choose a folder you can write to."
        ) from None
    try:
        yield
    finally:
        lock.release()


def check_output_folder(
    folder: str | os.PathLike[str],
    marker: str,
    *,
    option: str = "--out",
    early: Collection[str] = (),
    is_ours: Callable[[Path], bool] = Path.is_file,
) -> None:
    """Raise ValueError unless `folder` is new, empty, or written by the command: it holds
    `marker` (the file the command writes first) and `is_ours(marker)`; so a command never
    overwrites, or mixes its files with, files of a user's.

    early: files the command may write before `marker` (what a first run killed in between leaves);
    the lock and `atomic_write`'s temporary files count as the command's too. option: the option
    that names the folder, which the message tells the user to change.
    """
    path = Path(folder)
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder; give {option} a new folder.")
    if (path / marker).exists() and is_ours(path / marker):
        return
    foreign = sorted(
        name
        for name in os.listdir(path)
        if name != LOCK_FILE and name not in early and not _TEMPORARY_FILE.match(name)
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"{path} holds files this command did not write ({shown}); it writes only into a new or "
            f"empty folder or one it wrote before (with its {marker}). Move them out, or give {option} "
            "a new folder."
        )
