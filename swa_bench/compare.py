"""The regression gate: compare a current run against a baseline run, case by case.

Cases match on what they measure (swept params, graph mode, policy, trim threshold, tokens), not on
their index, so reordering a sweep or adding cases keeps the matches. Timing only regresses when the
slowdown is both statistically significant (one-sided Mann-Whitney U, current > baseline) and larger
than `max_slowdown`: significance alone flags microsecond noise on quiet machines, size alone flags
noise on busy ones. Deterministic figures (kept rows, captured graphs, FLOPs) must match exactly.
A pair of cases that ran other kernels (backend, tile, launch mode: ``CaseResult.kernels``) did not
measure the same thing: it is "incomparable" and fails the gate, unless the comparison is asked for
as an A/B (``allow_config_change``), when it is compared and the difference is warned about.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.markup import escape
from scipy.stats import mannwhitneyu

from swa_bench.results import (
    TIMED_PATHS,
    CaseResult,
    ResultsError,
    RunResults,
    TimingStats,
    is_stream,
    load_results,
    refuse_run_output,
    results_path,
    timed_paths,
    write_text_atomic,
)

RowStatus = Literal["improved", "regressed", "unchanged", "new", "missing", "warning",
                    "incomparable"]
TimingVerdict = Literal["slower", "faster", "unchanged", "too few samples", "absent", "invalid"]
ENVIRONMENT_GATE_KEYS = ("gpu", "torch", "cuda")
CaseKey = tuple[str, int]  # what the case measures (case_key), and which repeat of it (1, 2...)


@dataclass(frozen=True)
class TimingDelta:
    """One timed path of one matched case; `change` is current/baseline - 1 of the medians."""

    path: str
    baseline_ms: float | None
    current_ms: float | None
    change: float | None
    p_slower: float | None
    p_faster: float | None
    verdict: TimingVerdict

    def describe(self) -> str:
        if self.verdict == "absent":
            side = "current" if self.current_ms is None else "baseline"
            return f"{self.path} timing absent in {side}"
        if self.verdict == "invalid":
            return (f"{self.path} timing is not a finite number > 0 ms "
                    f"({self.baseline_ms} -> {self.current_ms} ms)")
        text = f"{self.path} {self.baseline_ms:.3f} -> {self.current_ms:.3f} ms"
        p = {"slower": self.p_slower, "faster": self.p_faster}.get(self.verdict)
        if self.change is not None:
            text += f" ({100 * self.change:+.1f}%" + (f", p={p:.2g})" if p is not None else ")")
        return text


@dataclass(frozen=True)
class ComparisonRow:
    key: CaseKey
    label: str
    status: RowStatus
    reasons: tuple[str, ...]
    timings: tuple[TimingDelta, ...] = ()


@dataclass(frozen=True)
class Comparison:
    rows: tuple[ComparisonRow, ...]
    warnings: tuple[str, ...]
    timing_gated: bool
    max_slowdown: float
    alpha: float

    @property
    def regressed(self) -> bool:
        return any(row.status == "regressed" for row in self.rows)

    @property
    def incomparable(self) -> int:
        """Cases in both runs that ran other kernels, not accepted as an A/B comparison."""
        return sum(row.status == "incomparable" for row in self.rows)

    @property
    def matched(self) -> int:
        """Cases found in both runs: what was actually compared."""
        return sum(row.status not in ("new", "missing", "incomparable") for row in self.rows)

    @property
    def failed(self) -> bool:
        """The gate fails on a regression, on cases that ran other kernels, and when nothing was
        compared at all."""
        return self.regressed or self.incomparable > 0 or self.matched == 0

    def counts(self) -> dict[str, int]:
        tally = Counter(row.status for row in self.rows)
        return {status: tally.get(status, 0) for status in
                ("regressed", "incomparable", "improved", "warning", "unchanged", "new",
                 "missing")}


def case_key(case: CaseResult) -> str:
    return json.dumps({"params": case.params, "graph_mode": case.graph_mode,
                       "policy": case.policy, "trim_threshold": case.trim_threshold,
                       "tokens": case.tokens}, sort_keys=True, default=str)


def _keyed(results: RunResults) -> dict[CaseKey, CaseResult]:
    """Cases by key; a repeat (a sweep that measures the same thing twice) is told apart by its
    count, kept beside the key rather than in its text, where any param value could fake it."""
    keyed: dict[CaseKey, CaseResult] = {}
    seen: Counter[str] = Counter()
    for case in results.cases:
        key = case_key(case)
        seen[key] += 1
        keyed[key, seen[key]] = case
    return keyed


def kernel_differences(baseline: CaseResult, current: CaseResult) -> list[str]:
    """What differs between the kernels two cases ran (``backend torch -> triton``); none when
    they agree or a side did not record them (a results file from before they were recorded)."""
    if baseline.kernels is None or current.kernels is None:
        return []
    before, after = baseline.kernels.model_dump(), current.kernels.model_dump()
    return [f"{key} {before[key]} -> {after[key]}" for key in before if before[key] != after[key]]


def environment_differences(baseline: RunResults, current: RunResults) -> list[str]:
    return [f"{key}: {baseline.environment.get(key)!r} -> {current.environment.get(key)!r}"
            for key in ENVIRONMENT_GATE_KEYS
            if baseline.environment.get(key) != current.environment.get(key)]


def _times(stats: TimingStats) -> list[tuple[str, float]]:
    """Every time of one timed path, by its field name in results.json."""
    return [("median_ms", stats.median_ms),
            *((f"samples_ms.{i}", x) for i, x in enumerate(stats.samples_ms))]


def _plausible(stats: TimingStats) -> bool:
    """No timer measures NaN, infinite or <= 0 ms: such a figure is reported, never compared."""
    return all(math.isfinite(x) and x > 0 for _, x in _times(stats))


def check_times(results: RunResults, file: Path) -> None:
    """Raise ResultsError at the first finite time <= 0 ms: bad input, as it would otherwise
    pass for an infinite speedup (NaN and infinity are kept: they regress in the comparison)."""
    for index, case, path, stats in timed_paths(results):
        for field, x in _times(stats):
            if math.isfinite(x) and x <= 0:
                raise ResultsError(file, f"cases.{index}.timing.{path}.{field}",
                                   f"must be > 0 ms, got {x:g} (case {case.label})")


def _p_value(current: list[float], baseline: list[float], alternative: str) -> float:
    p = float(mannwhitneyu(current, baseline, alternative=alternative).pvalue)
    return 1.0 if math.isnan(p) else p


def compare_timing(path: str, baseline: TimingStats | None, current: TimingStats | None, *,
                   max_slowdown: float, alpha: float, min_samples: int) -> TimingDelta | None:
    if baseline is None and current is None:
        return None
    if baseline is None or current is None:
        return TimingDelta(path, baseline and baseline.median_ms, current and current.median_ms,
                           None, None, None, "absent")
    if not (_plausible(baseline) and _plausible(current)):
        return TimingDelta(path, baseline.median_ms, current.median_ms, None, None, None,
                           "invalid")
    change = current.median_ms / baseline.median_ms - 1.0
    if min(len(baseline.samples_ms), len(current.samples_ms)) < min_samples:
        return TimingDelta(path, baseline.median_ms, current.median_ms, change, None, None,
                           "too few samples")
    p_slower = _p_value(current.samples_ms, baseline.samples_ms, "greater")
    p_faster = _p_value(current.samples_ms, baseline.samples_ms, "less")
    speedup = baseline.median_ms / current.median_ms - 1.0
    verdict: TimingVerdict = "unchanged"
    if p_slower < alpha and change > max_slowdown:
        verdict = "slower"
    elif p_faster < alpha and speedup > max_slowdown:
        verdict = "faster"
    return TimingDelta(path, baseline.median_ms, current.median_ms, change, p_slower, p_faster,
                       verdict)


def _exact_differences(name: str, baseline: dict[str, int], current: dict[str, int]
                       ) -> tuple[list[str], list[str]]:
    """(changed values, keys present on one side only): the first regress, the second warn, so
    a runner that starts recording a new figure does not fail every comparison."""
    changed = [f"{name}.{key} {baseline[key]} -> {current[key]}"
               for key in sorted(baseline.keys() & current.keys()) if baseline[key] != current[key]]
    one_sided = [f"{name}.{key} only in {'baseline' if key in baseline else 'current'}"
                 for key in sorted(baseline.keys() ^ current.keys())]
    return changed, one_sided


def compare_case(key: CaseKey, baseline: CaseResult, current: CaseResult, *,
                 timing_gate: str | None, max_slowdown: float, alpha: float,
                 min_samples: int, allow_config_change: bool = False) -> ComparisonRow:
    """`timing_gate` is None when timing may regress, else why it may not (reported instead).
    Cases that ran other kernels are "incomparable", or with `allow_config_change` compared as
    an A/B: timing gated, the kernels' difference and changed deterministic figures warned
    about. Either way the kernels' difference is named."""
    regressions: list[str] = []
    improvements: list[str] = []
    warnings: list[str] = []
    kernels = kernel_differences(baseline, current)
    if kernels and allow_config_change:
        warnings.append("A/B: kernels differ (" + ", ".join(kernels) + ")")

    if current.status == "error" and baseline.status != "error":
        regressions.append(f"case now raises: {' '.join((current.error or '').split())}")
    elif baseline.status == "error" and current.status != "error":
        improvements.append("case no longer raises")
    elif current.status == "error":
        warnings.append("case still raises")

    baseline_checks = {check.id: check for check in baseline.checks}
    current_checks = {check.id: check for check in current.checks}
    for check_id, check in current_checks.items():
        before = baseline_checks.get(check_id)
        if before is None:
            continue
        if before.passed and not check.passed:
            regressions.append(f"{check_id} now fails" + (f": {check.message}" if check.message
                                                          else ""))
        elif not before.passed and check.passed:
            improvements.append(f"{check_id} now passes")
        elif not check.passed:
            warnings.append(f"{check_id} still fails")
    if current.status != "error":
        warnings += [f"{check_id} not run in current"
                     for check_id in baseline_checks.keys() - current_checks.keys()]

    for name in ("deterministic", "flops"):
        changed, one_sided = _exact_differences(name, getattr(baseline, name),
                                                getattr(current, name))
        # Other kernels count other FLOPs (a kernel's formula is not the PyTorch path's): in an
        # A/B comparison a changed figure is reported, not a regression.
        regressions += [] if kernels else changed
        warnings += [f"{c} [other kernels]" for c in changed] if kernels else []
        warnings += one_sided

    timings = []
    for path in TIMED_PATHS:
        delta = compare_timing(path, getattr(baseline.timing, path, None),
                               getattr(current.timing, path, None), max_slowdown=max_slowdown,
                               alpha=alpha, min_samples=min_samples)
        if delta is None:
            continue
        timings.append(delta)
        if delta.verdict == "invalid":
            regressions.append(delta.describe())
        elif delta.verdict in ("absent", "too few samples"):
            warnings.append(f"{delta.describe()}: {delta.verdict}, timing not gated"
                            if delta.verdict == "too few samples" else delta.describe())
        elif delta.verdict in ("slower", "faster") and timing_gate is not None:
            warnings.append(f"{delta.describe()} [not gated: {timing_gate}]")
        elif delta.verdict == "slower":
            regressions.append(delta.describe())
        elif delta.verdict == "faster":
            improvements.append(delta.describe())

    status: RowStatus = ("regressed" if regressions else "warning" if warnings
                         else "improved" if improvements else "unchanged")
    reasons = regressions + warnings + improvements
    if kernels and not allow_config_change:
        status = "incomparable"
        reasons.insert(0, "kernels differ (" + ", ".join(kernels) + "): not the same measurement "
                       "(--allow-config-change compares them as an A/B)")
    return ComparisonRow(key, current.label, status, tuple(reasons), tuple(timings))


def compare_runs(baseline: RunResults, current: RunResults, *, max_slowdown: float = 0.05,
                 alpha: float = 0.01, min_samples: int = 5, gate_timing: bool = True,
                 allow_config_change: bool = False) -> Comparison:
    """Match cases and classify each; pure. Missing cases are reported but never regress."""
    env_diffs = environment_differences(baseline, current)
    run_warnings = []
    timing_gate = None
    if env_diffs:
        timing_gate = "environments differ"
        run_warnings.append("environments differ (" + "; ".join(env_diffs) + "): timing is "
                            "reported but not gated")
    elif not gate_timing:
        timing_gate = "timing gate off"
    if baseline.scenario_hash != current.scenario_hash:
        run_warnings.append("scenario files differ (hash); cases are matched by their params")

    baseline_cases, current_cases = _keyed(baseline), _keyed(current)
    rows = []
    for key, case in current_cases.items():
        before = baseline_cases.get(key)
        if before is None:
            rows.append(ComparisonRow(key, case.label, "new", ("not in baseline",)))
        else:
            rows.append(compare_case(key, before, case, timing_gate=timing_gate,
                                     max_slowdown=max_slowdown, alpha=alpha,
                                     min_samples=min_samples,
                                     allow_config_change=allow_config_change))
    for key, case in baseline_cases.items():
        if key not in current_cases:
            rows.append(ComparisonRow(key, case.label, "missing", ("in baseline only",)))
    missing = sum(row.status == "missing" for row in rows)
    if missing:
        run_warnings.append(f"{missing} baseline case{'s' if missing > 1 else ''} missing from "
                            "current")
    return Comparison(tuple(rows), tuple(run_warnings), timing_gate is None, max_slowdown, alpha)


# --- rendering and the CLI body ------------------------------------------------------------------

_ORDER = {"regressed": 0, "incomparable": 1, "warning": 2, "missing": 3, "improved": 4, "new": 5,
          "unchanged": 6}


def _timing_cell(row: ComparisonRow, path: str) -> str:
    delta = next((t for t in row.timings if t.path == path), None)
    if delta is None or delta.baseline_ms is None or delta.current_ms is None:
        return "–"
    change = "" if delta.change is None else f" ({100 * delta.change:+.1f}%)"
    return f"{delta.baseline_ms:.3f} → {delta.current_ms:.3f}{change}"


def sorted_rows(comparison: Comparison) -> list[ComparisonRow]:
    return sorted(comparison.rows, key=lambda row: (_ORDER[row.status], row.label))


def verdict_line(comparison: Comparison) -> str:
    counts = comparison.counts()
    n = comparison.incomparable
    head = ("REGRESSED" if comparison.regressed
            else f"NOT COMPARABLE ({n} case{'s' if n > 1 else ''} ran other kernels)" if n
            else "FAILED (no case in common: nothing compared)" if comparison.failed else "OK")
    gate = (f"timing gated at +{100 * comparison.max_slowdown:g}% (alpha {comparison.alpha:g})"
            if comparison.timing_gated else "timing not gated")
    return f"{head}: " + ", ".join(f"{n} {status}" for status, n in counts.items()) + f"; {gate}"


def comparison_markdown(comparison: Comparison, *, baseline: str, current: str) -> str:
    from swa_bench.report.markdown import md_cell, md_table

    lines = ["# swa-bench compare", "", f"Baseline `{md_cell(baseline)}`, current "
             f"`{md_cell(current)}`.", "", f"**{md_cell(verdict_line(comparison))}**", ""]
    lines += [f"- ⚠️ {md_cell(warning)}" for warning in comparison.warnings]
    if comparison.warnings:
        lines.append("")
    rows = [(row.label, f"**{row.status}**" if row.status == "regressed" else row.status,
             _timing_cell(row, "reference"), _timing_cell(row, "replay"), "; ".join(row.reasons))
            for row in sorted_rows(comparison)]
    lines += [md_table(["case", "status", "reference ms", "replay ms", "reasons"], rows), ""]
    return "\n".join(lines)


def comparison_json(comparison: Comparison, *, baseline: str, current: str) -> dict:
    """``compare --json``: the verdict, tallies, warnings and every row with its timings."""
    def finite(x: float | None) -> float | str | None:
        return x if x is None or math.isfinite(x) else str(x)

    return {
        "verdict": ("regressed" if comparison.regressed else
                    "not comparable" if comparison.incomparable else
                    "nothing compared" if comparison.failed else "ok"),
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
    from swa_bench.report import append_step_summary_text
    from swa_bench.report.console import print_comparison

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
    try:
        write_text_atomic(out, markdown)
    except OSError as exc:
        return _fail(f"{out}: --out: cannot write: {exc.strerror or exc}")
    if as_json:
        print(json.dumps(comparison_json(comparison, baseline=str(baseline),
                                         current=str(current)), indent=2))
    else:
        print_comparison(console, comparison)
        console.print(f"wrote {escape(str(out))}", highlight=False)
    append_step_summary_text(markdown)
    return 1 if comparison.failed else 0
