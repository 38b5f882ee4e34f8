"""run/progress: a line per finished case off a terminal (label, ms, speedup, elapsed, ETA), a bar
with an ETA at one, counts that start at what a --resume kept."""

from __future__ import annotations

import io

from rich.console import Console

from swa_bench.run.progress import case_line, case_progress, clock
from tests.report.synthetic import synthetic_run


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=100, force_terminal=terminal, color_system=None), buffer


def test_off_a_terminal_a_line_per_finished_case_with_its_figures_and_eta():
    cases = synthetic_run(error=False).cases[:3]
    console, buffer = _console(terminal=False)
    with case_progress(console, "synthetic", total=4, done=1) as progress:
        for case in cases:
            progress.start(case.label)
            progress.finished(case)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 3, lines
    first = cases[0]
    assert lines[0].startswith(f"[2/4] {first.label}: ref {first.timing.reference.median_ms:.4g}"
                               f" ms, replay {first.timing.replay.median_ms:.4g} ms, "
                               f"{first.speedup:.2f}x, pass; 0:00:00 elapsed, ETA 0:00:0")
    assert lines[1].startswith("[3/4] ") and "ETA" in lines[1]
    assert lines[2].startswith("[4/4] ") and "ETA" not in lines[2], "nothing is left"
    assert all(line == line.rstrip() for line in lines)


def test_at_a_terminal_a_bar_with_an_eta_and_no_lines():
    console, buffer = _console(terminal=True)
    case = synthetic_run(error=False).cases[0]
    with case_progress(console, "synthetic", total=2, done=1) as progress:
        progress.start(case.label)
        progress.finished(case)
        bar = progress._progress
        (task,) = bar.tasks
        assert (task.completed, task.total) == (2, 2)
        assert any("ETA" in str(getattr(c, "text_format", "")) for c in bar.columns)
    assert "[2/2]" not in buffer.getvalue()


def test_a_case_that_raised_or_was_not_timed_says_so():
    run = synthetic_run()
    raised = run.cases[-1]
    assert case_line(raised) == "ERROR"
    untimed = run.cases[0].model_copy(update={"timing": None, "speedup": None})
    assert case_line(untimed) == "pass"
    assert clock(3725.4) == "1:02:05"


def test_workers_progress_counts_from_what_was_kept():
    console, buffer = _console(terminal=False)
    with case_progress(console, "synthetic", total=5, done=2) as progress:
        progress.advance_to(4)
        progress.advance_to(4)  # no new case: no line
        progress.advance_to(5)
    lines = buffer.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["[4/5]", "[5/5]"]
