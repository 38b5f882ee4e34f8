"""Progress of a sweep, wherever its output goes.

At a terminal: a transient bar with the case being run, done/total and the time left. Anywhere
else (a CI log, a pipe, ``check --json``'s stderr) a bar is invisible until the end, so a line
per finished case instead: its label, both paths' medians, the speedup, the time so far and the
time left. Counts start at the cases a ``--resume`` kept (1/14, not 0/13), and the time left is
the mean time of the cases finished in this process times the cases left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from swa_bench.results import CaseResult


def clock(seconds: float) -> str:
    """h:mm:ss, as rich's bar columns write it."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def case_line(result: CaseResult) -> str:
    """What a finished case measured, in one short piece: "ref 12.8 ms, replay 12.4 ms, 1.03x",
    or its outcome when it was not timed."""
    timing = result.timing
    if result.status == "error":
        return "ERROR"
    parts = []
    for path, short in (("reference", "ref"), ("replay", "replay")):
        stats = getattr(timing, path, None) if timing is not None else None
        if stats is not None:
            parts.append(f"{short} {stats.median_ms:.4g} ms")
    if result.speedup is not None:
        parts.append(f"{result.speedup:.2f}x")
    parts.append(result.outcome())
    return ", ".join(parts)


class CaseProgress:
    """``start(label)`` before a case, ``finished(result)`` after it (``advance_to(n)`` when
    workers finish cases elsewhere)."""

    def __init__(self, console: Console, name: str, total: int, done: int,
                 progress: Progress | None) -> None:
        self.console, self.name, self.total, self.done = console, name, total, done
        self._progress = progress
        self._task = None if progress is None else progress.add_task(
            escape(name), total=total, completed=done)
        self._started = time.monotonic()
        self._finished_here = 0

    def eta(self) -> float | None:
        """Seconds left: the mean of the cases finished in this process times those left."""
        if self._finished_here == 0:
            return None
        elapsed = time.monotonic() - self._started
        return elapsed / self._finished_here * (self.total - self.done)

    def start(self, label: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=escape(f"{self.name}: {label}"))

    def finished(self, result: CaseResult) -> None:
        self.done += 1
        self._finished_here += 1
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done)
            return
        eta = self.eta()
        left = "" if eta is None or self.done == self.total else f", ETA {clock(eta)}"
        self.console.print(
            f"[{self.done}/{self.total}] {escape(result.label)}: {escape(case_line(result))}; "
            f"{clock(time.monotonic() - self._started)} elapsed{left}",
            highlight=False, soft_wrap=True)

    def advance_to(self, done: int) -> None:
        """Workers (``--gpus``) finished cases up to ``done`` in all."""
        grown = max(done - self.done, 0)
        self._finished_here += grown
        self.done += grown
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done)
        elif grown:
            eta = self.eta()
            left = "" if eta is None or self.done == self.total else f", ETA {clock(eta)}"
            self.console.print(f"[{self.done}/{self.total}] {escape(self.name)}; "
                               f"{clock(time.monotonic() - self._started)} elapsed{left}",
                               highlight=False, soft_wrap=True)


@contextmanager
def case_progress(console: Console, name: str, total: int, done: int = 0
                  ) -> Iterator[CaseProgress]:
    """A bar at a terminal (transient: the summary replaces it), else a line per case."""
    if not console.is_terminal:
        yield CaseProgress(console, name, total, done, None)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield CaseProgress(console, name, total, done, progress)
