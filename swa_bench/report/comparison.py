"""How a comparison reads: rows worst first, the verdict line, compare.md and ``compare --json``.

Renders ``compare.Comparison`` and decides nothing: every status, change and p-value is the
comparison's; the console table (``console.print_comparison``) uses the same order and line.
"""

from __future__ import annotations

import json
import math

from swa_bench.compare import Comparison, ComparisonRow
from swa_bench.report.markdown import md_cell, md_table
from swa_bench.report.tables import printable

_ORDER = {"regressed": 0, "incomparable": 1, "warning": 2, "missing": 3, "improved": 4, "new": 5,
          "unchanged": 6}
_HEAD = {"regressed": "REGRESSED", "ok": "OK",
         "nothing compared": "FAILED (no case in common: nothing compared)"}


def _head(comparison: Comparison) -> str:
    if comparison.verdict == "not comparable":
        n = comparison.incomparable
        return f"NOT COMPARABLE ({n} case{'s' if n > 1 else ''} ran other kernels)"
    return _HEAD[comparison.verdict]


def sorted_rows(comparison: Comparison) -> list[ComparisonRow]:
    """Regressions first, unchanged cases last; by label within a status."""
    return sorted(comparison.rows, key=lambda row: (_ORDER[row.status], row.label))


def verdict_line(comparison: Comparison) -> str:
    counts = comparison.counts()
    gate = (f"timing gated at +{100 * comparison.max_slowdown:g}% beyond the noise "
            f"(alpha {comparison.alpha:g})"
            if comparison.timing_gated else "timing not gated")
    return (f"{_head(comparison)}: "
            + ", ".join(f"{n} {status}" for status, n in counts.items()) + f"; {gate}")


def _timing_cell(row: ComparisonRow, path: str) -> str:
    delta = next((t for t in row.timings if t.path == path), None)
    if delta is None or delta.baseline_ms is None or delta.current_ms is None:
        return "–"
    change = "" if delta.change is None else f" ({100 * delta.change:+.1f}%)"
    return f"{delta.baseline_ms:.3f} → {delta.current_ms:.3f}{change}"


def comparison_markdown(comparison: Comparison, *, baseline: str, current: str) -> str:
    """compare.md (and the step summary): the verdict, the warnings, a row per case."""
    lines = ["# swa-bench compare", "", f"Baseline `{md_cell(baseline)}`, current "
             f"`{md_cell(current)}`.", "", f"**{md_cell(verdict_line(comparison))}**", ""]
    lines += [f"- ⚠️ {md_cell(warning)}" for warning in comparison.warnings]
    if comparison.warnings:
        lines.append("")
    rows = [(row.label, f"**{row.status}**" if row.status == "regressed" else row.status,
             _timing_cell(row, "reference"), _timing_cell(row, "replay"), "; ".join(row.reasons))
            for row in sorted_rows(comparison)]
    lines += [md_table(["case", "status", "reference ms", "replay ms", "reasons"], rows), ""]
    return printable("\n".join(lines))


def comparison_json(comparison: Comparison, *, baseline: str, current: str) -> dict:
    """``compare --json``: the verdict, tallies, warnings and every row with its timings; a
    non-finite figure is its string ("nan", "inf"), so the document stays strict JSON."""
    def finite(x: float | None) -> float | str | None:
        return x if x is None or math.isfinite(x) else str(x)

    return {
        "verdict": comparison.verdict,
        "baseline": baseline, "current": current, "counts": comparison.counts(),
        "matched": comparison.matched, "timing_gated": comparison.timing_gated,
        "max_slowdown": comparison.max_slowdown, "alpha": comparison.alpha,
        "warnings": list(comparison.warnings),
        "rows": [{"label": row.label, "key": json.loads(row.key[0]),
                  "status": row.status, "reasons": list(row.reasons),
                  "timings": [{"path": t.path, "baseline_ms": finite(t.baseline_ms),
                               "current_ms": finite(t.current_ms), "change": finite(t.change),
                               "p_slower": t.p_slower, "p_faster": t.p_faster,
                               "verdict": t.verdict} for t in row.timings]}
                 for row in sorted_rows(comparison)],
    }
