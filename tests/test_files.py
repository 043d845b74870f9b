"""One writer per folder, across processes: the lock the index, sweeps and calibration runs share."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rag_mspoe.files import LOCK_FILE, folder_lock

HOLD = """
import sys, time
from rag_mspoe.files import folder_lock
with folder_lock(sys.argv[1], "busy"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_is_refused_at_once_and_the_lock_file_stays(tmp_path):
    with (
        folder_lock(tmp_path, "first"),
        pytest.raises(RuntimeError, match="^Folder busy$"),
        folder_lock(tmp_path, "Folder busy"),
    ):
        pass
    with folder_lock(tmp_path, "Folder busy"):  # released: the next writer gets it
        pass
    assert [path.name for path in tmp_path.iterdir()] == [LOCK_FILE]


def test_a_writer_in_another_process_is_refused_and_a_killed_one_leaves_the_folder_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(RuntimeError, match="busy"), folder_lock(tmp_path, "busy"):
            pass
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(tmp_path, "busy"):
        pass
