"""``swa-bench export``: a run's medians as github-action-benchmark's ``customSmallerIsBetter``
JSON (the entries are ``report.export``'s), on stdout or atomically into ``--out``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from swa_bench.report.export import (
    check_export_out,
    export_json,
    github_benchmark_entries,
    left_out,
)
from swa_bench.results import load_results, results_path, write_text_atomic
from swa_bench.run.errors import CommandError


def export_command(run_dir: Path, out: Path | None, warn: Callable[[str], None]) -> str | None:
    """The JSON, or None once it is written to ``out``; ``warn`` gets a line per median left
    out, before anything is written. An ``out`` that names a run's own files is refused before
    anything is read."""
    try:
        if out is not None:
            check_export_out(out, run_dir)
        results = load_results(run_dir)
        text = export_json(github_benchmark_entries(results))
        for line in left_out(results):
            warn(f"warning: {results_path(run_dir)}: {line}")
        if out is None:
            return text
        write_text_atomic(out, text)
    except OSError as err:
        if out is None:  # the run directory itself (a name no file system holds)
            raise CommandError(f"{run_dir}: cannot read: {err.strerror or err}") from None
        raise CommandError(f"{out}: --out: cannot write: {err.strerror or err}") from None
    return None
