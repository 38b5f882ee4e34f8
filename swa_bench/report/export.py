"""Exports of a run for other tools."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from swa_bench.results import (
    CaseResult,
    ResultsError,
    RunResults,
    TimingStats,
    refuse_run_output,
    results_path,
    timed_paths,
)


def _entry(results: RunResults, case: CaseResult, path: str, stats: TimingStats
           ) -> dict[str, Any]:
    extra = f"n={len(stats.samples_ms)}; p10={stats.p10_ms:.4g} p90={stats.p90_ms:.4g} ms"
    if case.speedup is not None:
        extra += f"; speedup {case.speedup:.2f}x"
    return {
        "name": f"{results.scenario_name}/{case.label}/{path}",
        "unit": "ms",
        "value": round(stats.median_ms, 6),
        "range": f"{stats.p10_ms:.4g}-{stats.p90_ms:.4g}",
        "extra": extra,
    }


def github_benchmark_entries(results: RunResults) -> list[dict[str, Any]]:
    """github-action-benchmark's ``customSmallerIsBetter`` entries: one per case and timed path,
    named ``<scenario>/<case label>/<path>`` (stable while the sweep is), value the median in ms,
    range p10–p90, extra the sample count and the speedup. A median that is not a finite number
    is left out (see `left_out`): JSON has no NaN, and the action parses with JSON.parse."""
    return [_entry(results, case, path, stats) for _, case, path, stats in timed_paths(results)
            if math.isfinite(stats.median_ms)]


def left_out(results: RunResults) -> list[str]:
    """Why each entry `github_benchmark_entries` dropped is missing, one line each, by field."""
    return [f"cases.{index}.timing.{path}.median_ms: {stats.median_ms} is not a finite number; "
            f"{results.scenario_name}/{case.label}/{path} left out of the export"
            for index, case, path, stats in timed_paths(results)
            if not math.isfinite(stats.median_ms)]


def export_json(entries: list[dict[str, Any]]) -> str:
    """The entries as strict JSON: a non-finite value raises instead of writing NaN."""
    return json.dumps(entries, indent=2, allow_nan=False) + "\n"


def check_export_out(out: Path, source: Path) -> None:
    """Refuse an --out that would replace what a run wrote: the results file being exported
    (whatever its name) or any run folder's results and reports; raises ResultsError."""
    if Path(out).resolve() == results_path(source).resolve():
        raise ResultsError(out, "--out", "is the results file being exported: refusing to "
                                         "replace it (write it elsewhere)")
    refuse_run_output(out, "--out")
