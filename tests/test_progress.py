"""Progress bars: a bar on a terminal keeps moving while one long unit of work runs."""

from __future__ import annotations

import io
import time

from rag_mspoe import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_is_redrawn_while_a_unit_runs_and_stops_when_closed(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.05)
    bar = progress.progress_bar(total=3, desc="sweep", unit="batch", progress=True)
    drawn = terminal.getvalue().count("\r")
    time.sleep(0.5)  # one unit of work, no update
    redrawn = terminal.getvalue().count("\r")
    assert redrawn >= drawn + 3
    bar.close()
    closed = terminal.getvalue()
    time.sleep(0.3)
    assert terminal.getvalue() == closed


def test_off_a_terminal_nothing_is_redrawn(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.05)
    bar = progress.progress_bar(total=3, desc="sweep", unit="batch", progress=True)
    written = log.getvalue()
    time.sleep(0.3)
    assert log.getvalue() == written
    bar.close()
