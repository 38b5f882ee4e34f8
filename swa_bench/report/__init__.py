"""Rendering, and the reports of a run directory: report.md, report.html and junit.xml, all
rendered from results.json (``markdown``, ``html`` with ``charts``, ``junit``); the console's
tables (``console``), a comparison's compare.md and JSON (``comparison``), exports (``export``).

Rendering decides nothing (the verdicts are the results' and the comparison's) and happens before
any file is written, so a results file that fails to load or render leaves earlier reports in
place; each file is then replaced atomically."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from swa_bench.report.html import render_html
from swa_bench.report.junit import render_junit
from swa_bench.report.markdown import render_markdown
from swa_bench.results import (
    ResultsError,
    load_results,
    refuse_run_output,
    results_path,
    write_text_atomic,
)

__all__ = ["append_step_summary", "append_step_summary_text", "render_html", "render_junit",
           "render_markdown", "write_reports"]

REPORT_FILES = ("report.md", "report.html", "junit.xml")


def write_reports(run_dir: str | Path) -> list[Path]:
    """Render the three reports of `run_dir` (or of a results.json's directory) and write them
    beside results.json; raises ResultsError on a missing or invalid results file."""
    source = results_path(run_dir)
    results = load_results(source)
    rendered = (render_markdown(results), render_html(results), render_junit(results))
    folder = source.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ResultsError(folder, None, "cannot write the reports: the folder is read-only "
                                         "(copy the run folder somewhere writable)")
    written = []
    for name, text in zip(REPORT_FILES, rendered, strict=True):
        try:
            written.append(write_text_atomic(folder / name, text))
        except OSError as err:
            raise ResultsError(folder / name, None,
                               f"cannot write: {err.strerror or err}") from None
    return written


def _summary_problem(target: str) -> str | None:
    """Why $GITHUB_STEP_SUMMARY must not be appended to, or None. Only a regular file (or a
    path to create) is: a FIFO nobody reads blocks forever, a device is not a summary, and a
    run's own output (results.json) would be corrupted by markdown appended to it."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot append: {err.strerror or err}"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a pipe, device or folder): not appended"
    try:
        refuse_run_output(target, "GITHUB_STEP_SUMMARY")
    except ResultsError:
        return "is a run folder's output file: not appended"
    return None


def append_step_summary_text(markdown: str) -> None:
    """Append ``markdown`` to $GITHUB_STEP_SUMMARY when GitHub Actions sets it; a summary that
    cannot be written is a warning, never a failed run. The open is non-blocking and refused on
    anything but a regular file (checked on the opened descriptor too: no race with a swap)."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return
    problem = _summary_problem(target)
    if problem is None:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
            with os.fdopen(fd, "a", encoding="utf-8") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    problem = "is not a regular file: not appended"
                else:
                    handle.write(markdown.rstrip("\n") + "\n\n")
        except OSError as err:
            problem = f"cannot append: {err.strerror or err}"
    if problem is not None:
        print(f"warning: GITHUB_STEP_SUMMARY {target}: {problem}", file=sys.stderr)


def append_step_summary(run_dir: str | Path) -> None:
    """The run's report.md into $GITHUB_STEP_SUMMARY (see ``append_step_summary_text``)."""
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        append_step_summary_text((Path(run_dir) / "report.md").read_text(encoding="utf-8"))
