"""Console tables: readable at 80 columns and when piped, sweeps told apart, markup printed as
written, info results counted apart from passes; the github-action-benchmark export."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console

from swa_bench.report.console import (
    check_summary_line,
    check_table,
    checks_json,
    latency_table,
    print_run_summary,
)
from swa_bench.report.export import github_benchmark_entries
from swa_bench.report.junit import render_junit
from swa_bench.report.markdown import render_markdown
from swa_bench.results import CheckResult
from tests.report import synthetic

MARKUP = "RuntimeError: [enforce fail at alloc.cpp:12] [bold]out of memory[/bold]"


def piped(width: int = 80) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=width, color_system=None), buffer


def rendered(renderable, width: int = 80) -> str:
    console, buffer = piped(width)
    console.print(renderable)
    return buffer.getvalue()


def test_latency_table_fits_80_columns_and_shows_the_spread():
    results = synthetic.synthetic_run()
    text = rendered(latency_table(results))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text, "no cell is cut"
    case = results.cases[0]
    stats = case.timing.reference
    assert f"{stats.p10_ms:.3g}–{stats.p90_ms:.3g}" in text
    assert "n=10 samples" in " ".join(text.split())
    header = text.splitlines()[2]
    for column in ("mode", "policy", "tokens", "ref ms", "replay ms", "speedup"):
        assert column in header


def test_latency_table_shows_each_paths_mfu_within_80_columns():
    results = synthetic.synthetic_run(error=False)
    for i, case in enumerate(results.cases):
        case.mfu = {"reference": 0.125 + i / 1000, "replay": 0.5 + i / 1000}
    results.cases[0].mfu = {}
    text = rendered(latency_table(results))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text, "no cell is cut"
    for i in range(1, len(results.cases)):
        assert f"MFU {100 * (0.125 + i / 1000):.1f}%" in text
        assert f"MFU {100 * (0.5 + i / 1000):.1f}%" in text
    assert text.count("MFU ") == 2 * (len(results.cases) - 1)
    assert "measured GEMM rate" in " ".join(text.split())


def test_latency_table_shows_both_ideals_and_the_share_of_each_within_80_columns():
    results = synthetic.synthetic_run(error=False)
    text = rendered(latency_table(results))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text, "no cell is cut"
    assert "eff" in text.splitlines()[2]
    for case in results.cases:
        assert f"{case.roofline_ideal_speedup:.2f}x" in text
        assert f"{100 * case.roofline_efficiency:.0f}%" in text
        assert f"{100 * case.efficiency:.0f}%" in text
    assert "roofline ideal" in " ".join(text.split())


def test_latency_table_of_results_from_before_the_roofline():
    results = synthetic.synthetic_run(error=False)
    for case in results.cases:
        case.roofline_ideal_speedup = case.roofline_efficiency = None
    text = rendered(latency_table(results))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "roofline" not in " ".join(text.split())
    assert f"{results.cases[0].ideal_speedup:.2f}x" in text


def test_swept_parameters_are_columns():
    results = synthetic.synthetic_run(error=False)
    for case in results.cases:
        case.params["seed"] = case.index % 2
    text = rendered(latency_table(results))
    assert "seed" in text.splitlines()[2]


def test_error_text_is_not_eaten_as_markup():
    results = synthetic.synthetic_run()
    results.cases[-1].error = MARKUP
    console, buffer = piped(200)
    print_run_summary(console, results, Path("run"))
    assert MARKUP in buffer.getvalue()


def test_check_table_progress_free_summary_and_info_apart():
    results = synthetic.synthetic_run(failing=True, error=False)
    info = CheckResult(id="approximation", name="bounded vs full", passed=True, mode="info")
    for case in results.cases:
        case.checks.append(info)
    text = rendered(check_table("synthetic", results.cases))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "info" in text and "FAIL" in text
    counts = results.counts()
    assert counts["checks_info"] == len(results.cases)
    assert counts["checks_passed"] + counts["checks_failed"] + counts["checks_info"] == (
        counts["checks"])
    line = check_summary_line(results.cases)
    assert line.startswith("FAIL") and f"{len(results.cases)} info results" in line


def test_only_info_results_are_not_a_pass():
    results = synthetic.synthetic_run(failing=False, error=False)
    for case in results.cases:
        case.checks = [CheckResult(id="approximation", name="m", passed=True, mode="info")]
    assert results.verdict() == "unverified"
    assert check_summary_line(results.cases).startswith("UNVERIFIED")
    assert checks_json([("s", "s.yaml", results.cases)])["verdict"] == "unverified"
    assert "UNVERIFIED" in render_markdown(results)
    suite = ET.fromstring(render_junit(results)).find("testsuite")
    assert suite.get("skipped") == str(len(results.cases)) and suite.get("failures") == "0"


def test_a_run_without_cases_or_checks_is_not_a_pass():
    results = synthetic.synthetic_run(failing=False, error=False)
    results.cases = []
    assert results.verdict() == "error"
    results = synthetic.synthetic_run(failing=False, error=False)
    for case in results.cases:
        case.checks = []
    assert results.verdict() == "unverified"


def test_github_benchmark_export_is_custom_smaller_is_better():
    results = synthetic.synthetic_run()
    entries = github_benchmark_entries(results)
    timed = [c for c in results.cases if c.timing]
    assert len(entries) == 2 * len(timed)
    assert len({e["name"] for e in entries}) == len(entries)
    first = entries[0]
    assert set(first) == {"name", "unit", "value", "range", "extra"}
    assert first["unit"] == "ms" and first["value"] == round(timed[0].timing.reference.median_ms, 6)
    assert first["name"] == f"synthetic/{timed[0].label}/reference"


def test_report_on_a_read_only_or_full_folder_is_one_line(tmp_path, monkeypatch):
    """Root writes anywhere, so the read-only pre-check is exercised through os.access."""
    import errno
    import os

    import pytest

    import swa_bench.report as report
    from swa_bench.results import ResultsError, save_results

    save_results(tmp_path, synthetic.synthetic_run())
    before = (tmp_path / "results.json").read_bytes()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != tmp_path and real_access(p, mode))
    with pytest.raises(ResultsError, match="read-only"):
        report.write_reports(tmp_path)
    monkeypatch.setattr(os, "access", real_access)

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_text_atomic", full)
    with pytest.raises(ResultsError, match="No space left on device"):
        report.write_reports(tmp_path)
    assert (tmp_path / "results.json").read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_headline_comes_first_per_mode_and_policy_and_piped_lines_have_no_trailing_spaces(
        tmp_path):
    """The issue's first-hour reader found no speedup headline, and 35 of 43 piped lines ended
    in spaces. Synthetic: replay 25% faster above 64 tokens, so each group's median speedup is
    its middle case's."""
    import io

    from rich.console import Console

    from swa_bench.report import tables
    from swa_bench.report.console import print_run_summary
    from tests.report.synthetic import synthetic_run

    results = synthetic_run(error=False, failing=False)
    rows = tables.headline_rows(results)
    assert [(r.graph_mode, r.policy, r.cases) for r in rows] == [
        ("eager", "bounded", 3), ("eager", "halo", 3), ("piecewise", "bounded", 3),
        ("piecewise", "halo", 3)]
    for row in rows:
        group = sorted((c for c in results.cases
                        if (c.graph_mode, c.policy) == (row.graph_mode, row.policy)),
                       key=lambda c: c.speedup)
        assert row.speedup == f"{group[1].speedup:.2f}x"
        assert row.speedup_range == f"{group[0].speedup:.2f}–{group[-1].speedup:.2f}x"
        assert row.efficiency == tables.fmt_share(sorted(c.efficiency for c in group)[1])
        assert row.verdict == "pass"
    buffer = io.StringIO()
    print_run_summary(Console(file=buffer, width=80, color_system=None), results, tmp_path)
    lines = buffer.getvalue().splitlines()
    assert lines[0].strip() == "synthetic: headline"
    assert all(line == line.rstrip() for line in lines)
    assert max(len(line) for line in lines[:12]) <= 80
    assert buffer.getvalue().index("headline") < buffer.getvalue().index("latency")


def test_a_group_that_trimmed_nothing_has_no_headline_speedup():
    from swa_bench.report import tables
    from tests.report.synthetic import synthetic_run

    results = synthetic_run(error=False, failing=False)
    for case in results.cases:
        if case.graph_mode == "eager" and case.policy == "halo":
            case.deterministic = {**case.deterministic, "kept_rows": case.tokens}
    row = next(r for r in tables.headline_rows(results) if (r.graph_mode, r.policy) == (
        "eager", "halo"))
    assert (row.speedup, row.efficiency) == ("n/a", "n/a")


def test_a_sweep_too_wide_for_80_columns_numbers_its_cases_instead_of_cutting_cells():
    """`check coverage | cat` cut cells to `piecewi…` and `halo_al…`: a table wider than the
    console keeps every check cell whole, numbers its rows and lists the labels under it."""
    import io

    from rich.console import Console

    from swa_bench.report.console import print_checks
    from tests.report.synthetic import synthetic_run

    cases = synthetic_run(error=False, failing=False).cases[:4]
    for case in cases:
        case.params = {**case.params, "halo_align": 4, "engine.eager_trim_threshold": 96,
                       "model.n_layers": 8}
        case.checks = [*case.checks, case.checks[0].model_copy(update={"id": "approximation"}),
                       case.checks[0].model_copy(update={"id": "tasks"})]
    buffer = io.StringIO()
    print_checks(Console(file=buffer, width=80, color_system=None), "coverage", cases)
    text = buffer.getvalue()
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    for case in cases:
        assert f"#{case.index}: {case.label}" in text
    narrow = io.StringIO()
    print_checks(Console(file=narrow, width=80, color_system=None), "coverage",
                 synthetic_run(error=False, failing=False).cases[:3])
    assert "#0:" not in narrow.getvalue() and "policy" in narrow.getvalue()


def test_check_names_the_mode_its_verdicts_were_reached_in():
    """`swa-bench check` prints, before its verdict, whether E1/E2's full-batch halves were
    judged within the envelope or bitwise (the batch-invariant mode), from what each case
    recorded; --json carries it per case."""
    import io

    from swa_bench.report.console import print_checks
    from tests.report.synthetic import synthetic_run

    cases = synthetic_run(error=False, failing=False).cases[:2]
    for invariant, words in ((False, "within the rounding envelope"), (True, "bitwise")):
        for case in cases:
            case.batch_invariant = invariant
        buffer = io.StringIO()
        print_checks(Console(file=buffer, width=80, color_system=None), "s", cases)
        lines = buffer.getvalue().splitlines()
        assert any(line.startswith("checks mode:") and words in line for line in lines), lines
    cases[1].batch_invariant = False
    document = checks_json([("s", "s.yaml", cases)])
    assert [c["batch_invariant"] for c in document["scenarios"][0]["cases"]] == [True, False]
