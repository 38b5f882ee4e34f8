"""``swa-bench compare``: read two runs, gate the comparison, write compare.md, print the verdict.

Every input is checked before anything is compared or written: both results files load and hold
no time <= 0 ms, and ``--out`` is a writable file that is no run's results or report. Without
``--out`` compare.md goes beside the current run's results, and only when the gate passed. Bad input
is one line on stderr and exit code 2; the comparison itself is ``compare.compare_runs``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from swa_bench.compare import check_times, compare_runs
from swa_bench.report import append_step_summary_text
from swa_bench.report.comparison import comparison_json, comparison_markdown
from swa_bench.report.console import print_comparison
from swa_bench.results import (
    ResultsError,
    is_stream,
    load_results,
    refuse_run_output,
    results_path,
    write_text_atomic,
)


def _fail(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)
    return 2


def _check_out(out: Path, protected: set[Path], explicit: bool) -> str | None:
    """Why compare.md cannot be written to ``out`` (checked before comparing), or None."""
    hint = "" if explicit else " (pass --out FILE elsewhere)"
    if out.is_dir():
        return f"{out}: --out: is a directory, expected a file path"
    if not out.parent.is_dir():
        return f"{out}: --out: directory {out.parent} does not exist"
    if out.resolve() in protected:
        return f"{out}: --out: refusing to overwrite a results file"
    try:
        refuse_run_output(out, "--out", own="compare.md")
    except ResultsError as exc:
        return str(exc)
    if is_stream(out):
        return None if os.access(out, os.W_OK) else f"{out}: --out: cannot write: not writable"
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists()
                                                         and not os.access(out, os.W_OK)):
        return f"{out}: --out: cannot write: the folder is read-only{hint}"
    return None


def compare_command(baseline: Path, current: Path, *, max_slowdown: float = 0.05,
                    out: Path | None = None, gate_timing: bool = True,
                    console: Console | None = None, as_json: bool = False,
                    allow_config_change: bool = False) -> int:
    """Exit code: 0 no regression, 1 a regression, cases that ran other kernels (unless
    ``allow_config_change``) or nothing compared, 2 bad input (one line on stderr).
    ``as_json`` prints the comparison as JSON on stdout instead of the table."""
    console = console or Console()
    if not math.isfinite(max_slowdown) or max_slowdown < 0:
        return _fail(f"--max-slowdown: must be a finite number >= 0, got {max_slowdown}")
    try:
        baseline_results = load_results(baseline)
        current_results = load_results(current)
        check_times(baseline_results, results_path(baseline))
        check_times(current_results, results_path(current))
    except ResultsError as exc:
        return _fail(str(exc))
    current_json = results_path(current)
    explicit = out is not None
    out = Path(out) if out is not None else current_json.parent / "compare.md"
    protected = {results_path(baseline).resolve(), current_json.resolve()}
    problem = _check_out(out, protected, explicit)
    if problem is not None:
        return _fail(problem)

    comparison = compare_runs(baseline_results, current_results, max_slowdown=max_slowdown,
                              gate_timing=gate_timing, allow_config_change=allow_config_change)
    markdown = comparison_markdown(comparison, baseline=str(baseline), current=str(current))
    # The default out is the current run's folder, which compare does not own: a failed gate
    # (often two runs that were never meant to be compared) leaves it as it was.
    keep = explicit or not comparison.failed
    if keep:
        try:
            write_text_atomic(out, markdown)
        except OSError as exc:
            return _fail(f"{out}: --out: cannot write: {exc.strerror or exc}")
    if as_json:
        print(json.dumps(comparison_json(comparison, baseline=str(baseline),
                                         current=str(current)), indent=2))
    else:
        print_comparison(console, comparison)
        console.print(f"wrote {escape(str(out))}" if keep else
                      f"{escape(str(out))} not written: the gate failed and the folder is the "
                      "current run's (--out FILE keeps the comparison)", highlight=False,
                      soft_wrap=True)
    append_step_summary_text(markdown)
    return 1 if comparison.failed else 0
