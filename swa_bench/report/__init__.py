"""Rendering, and the reports of a run directory: report.md, report.html and junit.xml, all
rendered from results.json (``markdown``, ``html`` with ``charts``, ``junit``); the console's
tables (``console``), a comparison's compare.md and JSON (``comparison``), exports (``export``).

Rendering decides nothing (the verdicts are the results' and the comparison's) and happens before
any file is written, so a results file that fails to load or render leaves earlier reports in
place; each file is then replaced atomically."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from swa_bench.report.html import render_html
from swa_bench.report.junit import render_junit
from swa_bench.report.markdown import render_markdown
from swa_bench.results import ResultsError, load_results, results_path, write_text_atomic

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


def append_step_summary_text(markdown: str) -> None:
    """Append ``markdown`` to $GITHUB_STEP_SUMMARY when GitHub Actions sets it; a summary that
    cannot be written is a warning, never a failed run."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return
    try:
        with open(target, "a", encoding="utf-8") as handle:
            handle.write(markdown.rstrip("\n") + "\n\n")
    except OSError as err:
        print(f"warning: GITHUB_STEP_SUMMARY {target}: cannot append: {err.strerror or err}",
              file=sys.stderr)


def append_step_summary(run_dir: str | Path) -> None:
    """The run's report.md into $GITHUB_STEP_SUMMARY (see ``append_step_summary_text``)."""
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        append_step_summary_text((Path(run_dir) / "report.md").read_text(encoding="utf-8"))
