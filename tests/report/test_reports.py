import re
import xml.etree.ElementTree as ET

import pytest

from swa_bench.report import render_html, render_junit, render_markdown, write_reports
from swa_bench.report.charts import all_charts
from swa_bench.report.markdown import md_cell
from swa_bench.results import ResultsError, TaskCell, TaskResults, save_results

HOSTILE = "<script>alert(1)</script>"


def test_write_reports_writes_three_files_atomically(run_dir):
    paths = write_reports(run_dir)
    assert [p.name for p in paths] == ["report.md", "report.html", "junit.xml"]
    assert all(p.parent == run_dir and p.stat().st_size > 0 for p in paths)
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]
    assert write_reports(run_dir / "results.json") == paths


def test_write_reports_on_a_broken_run_keeps_earlier_reports(run_dir):
    write_reports(run_dir)
    before = {p.name: p.read_text() for p in run_dir.iterdir() if p.name.startswith("report")}
    (run_dir / "results.json").write_text("{not json")
    with pytest.raises(ResultsError, match=r"results\.json: invalid JSON"):
        write_reports(run_dir)
    assert {p.name: p.read_text() for p in run_dir.iterdir()
            if p.name.startswith("report")} == before


# --- markdown -----------------------------------------------------------------------------------


def _table(markdown: str, heading: str) -> list[list[str]]:
    """The rows of the table under `## heading`, split on unescaped pipes."""
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def test_markdown_verdict_and_tables(run_results):
    markdown = render_markdown(run_results)
    assert "**ERROR: 11 of 13 cases passed (1 failed, 1 raised); 47 of 48 checks passed**" in \
        markdown
    checks = _table(markdown, "Checks")
    assert checks[0] == ["case", "check", "mode", "result", "worst diagnostic"]
    assert len(checks) == 2 + 48 + 1
    failing = [row for row in checks if row[3] == "**FAIL**"]
    assert len(failing) == 1 and failing[0][0] == "piecewise/halo/T=1024"
    assert "ring.layer3: 96/2048 mismatched" in failing[0][4] and "[1,7,30]" in failing[0][4]
    latency = _table(markdown, "Latency")
    assert latency[0][:3] == ["case", "tokens", "mode"] and len(latency[0]) == 14
    assert latency[0][7:12] == ["speedup", "FLOP ideal", "efficiency", "roofline ideal",
                                "of roofline"]
    assert latency[0][12] == "TFLOP/s ref / replay (MFU)"
    by_case = {c.label: c for c in run_results.cases}
    for row in latency[2:]:
        case = by_case[row[0]]
        assert row[10] == f"{case.roofline_ideal_speedup:.2f}x"
        assert row[11] in ("n/a", f"{100 * case.roofline_efficiency:.1f}%")
    assert len(latency) == 2 + 12
    eager_bounded = [row for row in latency if row[2] == "eager" and row[3] == "bounded"]
    assert [row[1] for row in eager_bounded] == ["64", "256", "1024"]
    assert all(row[7].endswith("x") for row in latency[2:])
    assert len(_table(markdown, "Approximation (replay vs full prefill, per policy)")) == 2 + 2
    advice = _table(markdown, "Trim threshold advice")
    assert advice[2][2] == "256" and advice[3][3] == "replay never wins \\| no data"
    environment = dict(row for row in _table(markdown, "Environment")[2:])
    assert environment["git_sha"] == run_results.environment["git_sha"]
    assert environment["scenario hash"] == run_results.scenario_hash


def test_markdown_passing_run_has_no_failures_section(make_run):
    markdown = render_markdown(make_run(failing=False, error=False))
    assert "**PASS: 12 of 12 cases passed" in markdown and "## Failures" not in markdown


def test_markdown_cells_cannot_break_the_table(make_run):
    assert md_cell("a|b\nc <b>") == "a\\|b c &lt;b>"
    assert md_cell("triton -> torch, x >= 2 & y, &amp;") == "triton -> torch, x >= 2 & y, &amp;amp;"
    results = make_run(scenario_name=HOSTILE)
    results.cases[0].label = "weird|label\nsplit"
    markdown = render_markdown(results)
    assert HOSTILE not in markdown and "&lt;script>" in markdown
    rows = [r for r in _table(markdown, "Checks") if r[0].startswith("weird")]
    assert rows and all(len(r) == 5 and r[0] == "weird\\|label split" for r in rows)


# --- junit --------------------------------------------------------------------------------------


def test_junit_has_a_testcase_per_case_and_check(run_results):
    root = ET.fromstring(render_junit(run_results))
    suite = root.find("testsuite")
    testcases = suite.findall("testcase")
    expected = [(f"swa_bench.synthetic.{case.label}", f"{check.id} {check.name}")
                for case in run_results.cases for check in case.checks]
    checked = [(tc.get("classname"), tc.get("name")) for tc in testcases if tc.get("name") != "run"]
    assert checked == expected
    failures = [tc for tc in testcases if tc.find("failure") is not None]
    assert len(failures) == 1
    failure = failures[0].find("failure")
    assert failures[0].get("classname") == "swa_bench.synthetic.piecewise/halo/T=1024"
    assert failure.get("message").startswith("graph replay differs from eager")
    assert "ring.layer3: 96/2048" in failure.get("message")
    assert "kept_outputs: 3/4096" in failure.text and "ring.layer3" in failure.text
    errors = [tc for tc in testcases if tc.find("error") is not None]
    assert len(errors) == 1 and errors[0].get("classname").endswith("full/bounded/T=64")
    assert errors[0].find("error").get("message") == "RuntimeError: CUDA graph capture failed"
    assert suite.get("tests") == str(len(testcases)) and suite.get("failures") == "1"
    assert suite.get("errors") == "1"


def test_junit_survives_hostile_text(make_run):
    results = make_run(scenario_name=HOSTILE)
    results.cases[-1].error = "bad \x00 byte & <tag> \x1b[31m"
    root = ET.fromstring(render_junit(results))
    error = root.find(".//error")
    assert "& <tag>" in error.text and "\x00" not in error.text
    assert root.find("testsuite").get("name") == f"swa_bench.{HOSTILE}"


# --- html ---------------------------------------------------------------------------------------


def test_html_is_self_contained(run_results):
    html = render_html(run_results)
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<script|<link\b|<iframe|<img\b|@import|\bsrc\s*=", html, re.I)
    assert not re.search(r"url\((?!#)", html)
    hrefs = re.findall(r"href=\"([^\"]*)\"", html)
    assert all(h.startswith("#") for h in hrefs)


def test_html_shows_the_roofline_ideal_and_the_share_of_it(run_results):
    html = render_html(run_results)
    latency = html.split('id="latency"', 1)[1].split("</table>", 1)[0]
    assert "<th>roofline ideal</th><th>of roofline</th>" in latency
    case = next(c for c in run_results.cases if c.roofline_ideal_speedup and c.timing)
    assert f"{case.roofline_ideal_speedup:.2f}x" in latency
    assert f"{100 * case.roofline_efficiency:.1f}%" in latency


def test_html_escapes_hostile_scenario_text(make_run):
    results = make_run(scenario_name=HOSTILE)
    results.cases[0].label = "$<img src=x onerror=alert(2)>$"
    results.environment["hostname"] = '"><script>alert(3)</script>'
    html = render_html(results)
    assert "<script" not in html.lower()
    assert "<img" not in html.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(2)&gt;" in html


def test_html_shows_charts_tables_and_failures(run_results):
    html = render_html(run_results)
    assert html.count("<svg") == 4
    for chart in ("latency", "speedup", "break-even", "approximation"):
        assert f'id="chart-{chart}"' in html
    for table in ("checks", "latency", "advice", "approximation", "environment"):
        assert f'<table id="{table}">' in html
    assert 'class="verdict error"' in html
    failures = html.split('id="failures"', 1)[1].split("</section>", 1)[0]
    assert "piecewise/halo/T=1024" in failures and "full/bounded/T=64" in failures
    assert html.count('<tr class="fail">') == 2  # its check row and its latency row


def test_charts_skip_what_has_no_data(make_run):
    results = make_run()
    for case in results.cases:
        case.approximation = None
    assert [c.id for c in all_charts(results)] == ["latency", "speedup", "break-even"]
    assert all_charts(results.model_copy(update={"cases": []})) == []


def test_chart_svg_ids_do_not_collide(run_results):
    ids = [re.findall(r'\bid="([^"]+)"', chart.svg) for chart in all_charts(run_results)]
    flat = [i for chart_ids in ids for i in chart_ids]
    assert len(flat) == len(set(flat))


def test_save_then_reports_round_trip(tmp_path, make_run):
    results = make_run(failing=False, error=False)
    save_results(tmp_path, results)
    md, html, junit = write_reports(tmp_path)
    assert md.read_text().startswith("# swa-bench: synthetic")
    assert 'class="verdict pass"' in html.read_text()
    assert ET.parse(junit).getroot().get("failures") == "0"


def test_task_chart_draws_only_what_a_log_axis_can_place(make_run):
    """A case with task results but no cells, or cells of zero tokens or NaN accuracy, used to
    crash the whole report ("Data cannot be log-scaled")."""
    results = make_run()
    case = results.cases[0]
    case.tasks = TaskResults(policy=case.policy, model="seeded")
    assert "tasks" not in [c.id for c in all_charts(results)]
    case.tasks.cells = [
        TaskCell(task="recall", prompt_len=0, distance=1, prompts=1, accuracy=1.0,
                 answer_loss=0.1, agreement=1.0),
        TaskCell(task="copy", prompt_len=64, distance=1, prompts=1, accuracy=float("nan"),
                 answer_loss=0.1, agreement=1.0),
        TaskCell(task="copy", prompt_len=128, distance=1, prompts=1, accuracy=0.5,
                 answer_loss=0.1, agreement=1.0)]
    (chart,) = [c for c in all_charts(results) if c.id == "tasks"]
    assert chart.svg.startswith("<svg")


def _whole_and_chunked_tasks(make_run):
    """Full and bounded, each on whole prompts and in chunks of 64 (four prompts of 64 tokens),
    on four cases of the synthetic run: each grade and loss change is against the full prefill
    prefilled alike."""
    from swa_bench.results import HeldOutLoss

    results = make_run()
    figures = [("full", None, 1.0, 1.0, 1.50), ("bounded", None, 0.5, 0.5, 1.60),
               ("full", 64, 1.0, 1.0, 1.52), ("bounded", 64, 0.25, 0.25, 1.70)]
    # the chunked cases first in the file: the tables order them, whole prompts first
    for case, (policy, chunk, accuracy, agreement, loss) in zip(
            results.cases, figures[2:] + figures[:2], strict=False):
        case.policy = policy
        case.tasks = TaskResults(policy=policy, model="v41-mini", chunk_size=chunk, cells=[
            TaskCell(task="recall", prompt_len=64, distance=8, prompts=4, accuracy=accuracy,
                     answer_loss=0.1, agreement=agreement)],
            held_out=[HeldOutLoss(prompt_len=64, prompts=4, continuation=16, loss=loss,
                                  prefill_loss=loss)])
    return results


def test_task_figures_of_whole_and_chunked_prompts_stay_apart(make_run):
    """Each table says how the prompts were prefilled (checks.tasks.chunk_size), and no figure
    of chunked prompts is graded against whole prompts' full prefill or merged with them."""
    from swa_bench.report import tables
    from swa_bench.report.console import task_table
    from tests.report.test_console import rendered

    results = _whole_and_chunked_tasks(make_run)
    assert [(c.policy, c.tasks.chunk_size) for c in tables.task_cases(results)] == [
        ("full", None), ("bounded", None), ("full", 64), ("bounded", 64)]
    assert tables.task_rows(results) == (["full", "bounded"], [
        ("whole", "recall", "64", "8", "100%", "50% (50% agree)"),
        ("chunks of 64", "recall", "64", "8", "100%", "25% (25% agree)")])
    assert tables.held_out_rows(results) == (["full", "bounded"], [
        ("whole", "64", "1.5", "1.6"), ("chunks of 64", "64", "1.52", "1.7")])
    note = tables.task_note(results)
    assert len(note) == 2
    assert note[0].startswith("bounded, whole prompts: 2/4 answers differ") and "+0.1 vs" in note[0]
    assert note[1].startswith("bounded, prompts in chunks of 64: 3/4 answers differ")
    assert "+0.18 vs full" in note[1]
    console = [line.split() for line in rendered(task_table(results), width=100).splitlines()]
    assert ["bounded", "chunks", "of", "64", "25.0%", "–", "3/4", "1.7000", "+0.18"] in [
        [cell for cell in line if cell != "│"] for line in console]
    md = _table(render_markdown(results), "Task accuracy (trained model)")
    assert md[0][:4] == ["prompts", "task", "prompt tokens", "distance"]
    assert ["chunks of 64", "recall", "64", "8", "100%", "25% (25% agree)"] in md
    html = render_html(results)
    assert "<td>chunks of 64</td>" in html and "<th>prompts</th><th>task</th>" in html
    (chart,) = [c for c in all_charts(results) if c.id == "tasks"]
    legend = [t.get_text() for t in chart.figure.legends[0].texts]
    assert legend == ["full", "bounded", "full, chunks of 64", "bounded, chunks of 64"]


# --- figures no correct measurement gives -------------------------------------------------------


def _implausible_run():
    """The threshold sweep's CPU figures, as data: a 3.52x speedup against a 2.93x FLOP ideal
    (120%), and a case whose replay step kept every row (FULL) reporting 1.04x."""
    from tests.report.synthetic import synthetic_run

    results = synthetic_run(error=False, failing=False)
    fast, untrimmed = results.cases[2], results.cases[3]
    fast.ideal_speedup, fast.speedup, fast.efficiency = 2.93, 3.52, 3.52 / 2.93
    untrimmed.deterministic = {**untrimmed.deterministic, "kept_rows": untrimmed.tokens}
    untrimmed.ideal_speedup, untrimmed.speedup, untrimmed.efficiency = 1.0, 1.04, 1.04
    return results, fast.label, untrimmed.label


def test_impossible_figures_are_flagged_in_every_output(tmp_path):
    import io

    from rich.console import Console

    from swa_bench.report import tables
    from swa_bench.report.console import print_run_summary

    results, fast, untrimmed = _implausible_run()
    lines = tables.implausible(results)
    assert lines == [f"{fast}: speedup 3.52x is 120% of the FLOP ideal 2.93x (above 105%: the "
                     "reference path wastes time or the timing is off)",
                     f"{untrimmed}: trimmed nothing, so its 1.04x is noise (speedup n/a)"]
    buffer = io.StringIO()
    print_run_summary(Console(file=buffer, width=80, color_system=None), results, tmp_path)
    console = " ".join(buffer.getvalue().split())
    markdown, html = render_markdown(results), render_html(results)
    junit = ET.fromstring(render_junit(results).encode())
    junit_warnings = [p.get("value") for p in junit.iter("property") if p.get("name") == "warning"]
    assert junit_warnings == lines and "warning: " + lines[0] in junit.find(".//system-out").text
    for line in lines:
        assert f"warning: {line}" in console
        assert md_cell(line) in markdown
        assert line in html.replace("&#39;", "'")
    latency = _table(markdown, "Latency")
    row = next(r for r in latency if r[0] == untrimmed)
    assert "n/a" in row and "1.04x" not in row  # speedup and efficiency both n/a


def test_plausible_figures_raise_no_warning(run_results):
    from swa_bench.report import tables

    assert tables.implausible(run_results) == []
    assert "- ⚠️" not in render_markdown(run_results).split("## Failures")[0]
    assert 'id="implausible"' not in render_html(run_results)


def test_the_environment_reads_as_text_and_names_the_tool(run_results):
    from swa_bench.report import tables

    run_results.environment["gemm_tflops"] = {"float32": 0.5123, "bfloat16": 1.25}
    run_results.swa_bench_version = "0.1.0"
    rows = dict(tables.environment_rows(run_results))
    assert rows["gemm_tflops"] == "float32 0.512, bfloat16 1.25"
    assert rows["swa-bench"] == "0.1.0"
    assert "{" not in render_html(run_results).split('id="environment"')[-1].split("</table>")[0]


def test_graph_cases_report_their_captures_and_memory(make_run):
    results = make_run(failing=False, error=False)
    graphs = _table(render_markdown(results), "Graphs and memory")
    assert graphs[0][4:6] == ["replay graphs", "their MiB"]
    piecewise = [c for c in results.cases if c.graph_mode == "piecewise"]
    assert [row[0] for row in graphs[2:]] == [c.label for c in piecewise]  # no eager case
    by_case = {c.label: c for c in piecewise}
    for row in graphs[2:]:
        case = by_case[row[0]]
        assert row[2] == f"3 captured in 1.5 s, step in {case.tokens}"
        assert row[3] == "96" and row[5] == "1.5"  # MiB held by each kind of graph
        rows_in = case.deterministic["replay_graph_rows"]
        assert row[4] == f"16, 32 captured in 0.2 s, step in {rows_in}"
    off = results.model_copy(deep=True)
    for case in off.cases:
        case.replay_capture_sizes = []
    assert {row[4] for row in _table(render_markdown(off), "Graphs and memory")[2:]} == {"off"}
    html = render_html(results)
    assert '<table id="graphs">' in html and "step in 1024" in html


def test_the_mfu_caption_names_the_peaks_it_is_against():
    from swa_bench.report import tables
    from swa_bench.results import MfuBasis
    from tests.report.synthetic import synthetic_run

    results = synthetic_run(error=False)
    old = tables.mfu_caption(results.cases)  # no basis recorded: the older wording
    assert "measured GEMM rate (environment: gemm_tflops)" in old
    results.cases[0].mfu_basis = MfuBasis(dtype="bfloat16", dtype_tflops=794.0,
                                          fp8_tflops=1480.0, fp8_gemm_flops={"replay": 1})
    results.cases[1].mfu_basis = MfuBasis(dtype="bfloat16", dtype_tflops=794.0)
    caption = tables.mfu_caption(results.cases)
    assert "bfloat16 794 TFLOP/s" in caption
    assert "fp8 1480 TFLOP/s for the fp8 Linears' GEMMs" in caption
    assert caption in render_markdown(results)
    results.cases[0].mfu_basis.fp8_tflops = None  # fp8 GEMMs on a device without the rate
    assert "counted at the dtype's" in tables.mfu_caption(results.cases)
