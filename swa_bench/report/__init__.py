"""Reports of a run directory: report.md, report.html and junit.xml, all rendered from results.json.

Rendering happens before any file is written, so a results file that fails to load or render
leaves earlier reports in place; each file is then replaced atomically."""

from __future__ import annotations

from pathlib import Path

from swa_bench.report.html import render_html
from swa_bench.report.junit import render_junit
from swa_bench.report.markdown import render_markdown
from swa_bench.results import load_results, results_path, write_text_atomic

__all__ = ["render_html", "render_junit", "render_markdown", "write_reports"]

REPORT_FILES = ("report.md", "report.html", "junit.xml")


def write_reports(run_dir: str | Path) -> list[Path]:
    """Render the three reports of `run_dir` (or of a results.json's directory) and write them
    beside results.json; raises ResultsError on a missing or invalid results file."""
    source = results_path(run_dir)
    results = load_results(source)
    rendered = (render_markdown(results), render_html(results), render_junit(results))
    return [write_text_atomic(source.parent / name, text)
            for name, text in zip(REPORT_FILES, rendered, strict=True)]
