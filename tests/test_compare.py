import io
import json
import math
import os
import random
from pathlib import Path

import pytest
from rich.console import Console

from swa_bench.compare import (
    case_key,
    compare_command,
    compare_runs,
    comparison_json,
    verdict_line,
)
from swa_bench.results import CaseTiming, KernelRecord, RunResults, save_results
from tests.report import synthetic


def run(*, scale: float = 1.0, samples: int = 30, noise: float = 0.02, seed: int = 0,
        **kwargs) -> RunResults:
    """A clean synthetic run whose timings are redrawn around `scale` x the base medians."""
    results = synthetic.synthetic_run(failing=False, error=False, **kwargs)
    rng = random.Random(seed)
    for case in results.cases:
        base = case.timing
        case.timing = CaseTiming(
            reference=synthetic.timing_stats(base.reference.median_ms * scale, samples=samples,
                                             noise=noise, rng=rng),
            replay=synthetic.timing_stats(base.replay.median_ms * scale, samples=samples,
                                          noise=noise, rng=rng))
    return results


def statuses(comparison) -> set[str]:
    return {row.status for row in comparison.rows}


def test_identical_runs_pass():
    baseline = run()
    comparison = compare_runs(baseline, baseline.model_copy(deep=True))
    assert statuses(comparison) == {"unchanged"}
    assert not comparison.regressed and comparison.timing_gated and not comparison.warnings


def test_independent_draws_of_the_same_timing_pass():
    comparison = compare_runs(run(seed=0), run(seed=1))
    assert not comparison.regressed
    assert statuses(comparison) <= {"unchanged"}


def test_ten_percent_slowdown_with_many_samples_regresses():
    comparison = compare_runs(run(seed=0), run(scale=1.10, seed=1))
    assert comparison.regressed
    assert statuses(comparison) == {"regressed"}
    row = comparison.rows[0]
    assert any(r.startswith("replay") and "+" in r and "p=" in r for r in row.reasons)
    assert {t.verdict for t in row.timings} == {"slower"}


def test_ten_percent_slowdown_with_three_samples_only_warns():
    comparison = compare_runs(run(samples=3, seed=0), run(scale=1.10, samples=3, seed=1))
    assert not comparison.regressed
    assert statuses(comparison) == {"warning"}
    assert all("too few samples" in reason for row in comparison.rows for reason in row.reasons)


def test_significant_but_small_slowdown_is_not_a_regression():
    comparison = compare_runs(run(noise=0.002, seed=0), run(scale=1.03, noise=0.002, seed=1))
    assert all(t.p_slower < 0.01 for row in comparison.rows for t in row.timings)
    assert not comparison.regressed
    stricter = compare_runs(run(noise=0.002, seed=0), run(scale=1.03, noise=0.002, seed=1),
                            max_slowdown=0.01)
    assert statuses(stricter) == {"regressed"}


def test_ten_percent_speedup_is_an_improvement():
    comparison = compare_runs(run(seed=0), run(scale=1 / 1.10, seed=1))
    assert statuses(comparison) == {"improved"} and not comparison.regressed


def test_a_check_that_starts_failing_regresses():
    baseline = run()
    current = baseline.model_copy(deep=True)
    case = current.cases[5]
    case.checks[0] = case.checks[0].model_copy(update={"passed": False, "message": "kept rows"})
    case.status = "failed"
    comparison = compare_runs(baseline, current)
    regressed = [row for row in comparison.rows if row.status == "regressed"]
    assert [row.label for row in regressed] == [case.label]
    assert regressed[0].reasons[0] == "E1 now fails: kept rows"
    back = compare_runs(current, baseline)
    assert not back.regressed
    assert [row.status for row in back.rows if row.label == case.label] == ["improved"]


def test_a_case_that_starts_raising_regresses():
    baseline = run()
    current = baseline.model_copy(deep=True)
    current.cases[0] = current.cases[0].model_copy(
        update={"status": "error", "error": "RuntimeError: boom", "timing": None, "checks": []})
    row = compare_runs(baseline, current).rows[0]
    assert row.status == "regressed" and "case now raises: RuntimeError: boom" in row.reasons


def test_missing_case_is_reported_but_does_not_fail():
    baseline = run()
    current = baseline.model_copy(deep=True)
    dropped = current.cases.pop(3)
    comparison = compare_runs(baseline, current)
    assert not comparison.regressed
    missing = [row for row in comparison.rows if row.status == "missing"]
    assert [row.label for row in missing] == [dropped.label]
    assert any("missing" in warning for warning in comparison.warnings)
    reverse = compare_runs(current, baseline)
    assert [row.label for row in reverse.rows if row.status == "new"] == [dropped.label]
    assert not reverse.regressed


def test_flop_or_deterministic_change_regresses():
    baseline = run()
    current = baseline.model_copy(deep=True)
    current.cases[2].flops = {**current.cases[2].flops, "replay": current.cases[2].flops["replay"]
                              + 1}
    current.cases[4].deterministic = {**current.cases[4].deterministic, "kept_rows": 999}
    comparison = compare_runs(baseline, current, gate_timing=False)
    regressed = {row.label: row.reasons for row in comparison.rows if row.status == "regressed"}
    assert set(regressed) == {baseline.cases[2].label, baseline.cases[4].label}
    assert any(r.startswith("flops.replay ") for r in regressed[baseline.cases[2].label])
    assert any(r.startswith("deterministic.kept_rows ") and r.endswith("-> 999")
               for r in regressed[baseline.cases[4].label])


def with_kernels(results: RunResults, **changes) -> RunResults:
    """``results`` with every case recording the interpreted Triton kernels, ``changes`` over."""
    out = results.model_copy(deep=True)
    for case in out.cases:
        case.kernels = KernelRecord(**{"backend": "triton", "tile": "auto", "launch": "direct",
                                       "interpret": True, **changes})
    return out


@pytest.mark.parametrize(("change", "reason"), [
    ({"backend": "torch"}, "backend triton -> torch"),
    ({"tile": "64,0,8,2"}, "tile auto -> 64,0,8,2"),
    ({"launch": "triton", "interpret": False}, "launch direct -> triton, interpret True -> False"),
])
def test_cases_that_ran_other_kernels_are_never_unchanged(change, reason):
    """Same figures, other kernels: every case is incomparable and named so, the verdict says it
    and the gate fails; asked for as an A/B, the cases are compared and the change warned about.
    Agreeing records, or a side that recorded none (an older file), compare as before."""
    baseline = with_kernels(run())
    current = with_kernels(baseline, **change)
    comparison = compare_runs(baseline, current)
    assert statuses(comparison) == {"incomparable"} and comparison.failed
    assert all(row.reasons[0].startswith(f"kernels differ ({reason})") for row in comparison.rows)
    assert verdict_line(comparison).startswith(f"NOT COMPARABLE ({len(baseline.cases)} cases")
    assert comparison.matched == 0 and comparison.counts()["incomparable"] == len(baseline.cases)
    assert comparison_json(comparison, baseline="a", current="b")["verdict"] == "not comparable"
    ab = compare_runs(baseline, current, allow_config_change=True)
    assert statuses(ab) == {"warning"} and not ab.failed
    assert all(f"A/B: kernels differ ({reason})" in row.reasons for row in ab.rows)
    assert statuses(compare_runs(baseline, baseline.model_copy(deep=True))) == {"unchanged"}
    assert statuses(compare_runs(run(), current)) == {"unchanged"}


def test_the_command_fails_on_other_kernels_unless_allowed(tmp_path, capsys):
    baseline = with_kernels(run())
    base, cur = _dirs(tmp_path, baseline, with_kernels(baseline, backend="torch"))
    quiet = Console(file=io.StringIO())
    assert compare_command(base, cur, console=quiet) == 1
    assert "NOT COMPARABLE" in (cur / "compare.md").read_text()
    assert compare_command(base, cur, console=quiet, allow_config_change=True) == 0
    assert "A/B: kernels differ (backend triton -&gt; torch)" in (cur / "compare.md").read_text()


def test_a_newly_recorded_figure_only_warns():
    baseline = run()
    current = baseline.model_copy(deep=True)
    current.cases[0].deterministic = {**current.cases[0].deterministic, "breaks": 2}
    row = compare_runs(baseline, current).rows[0]
    assert row.status == "warning" and "deterministic.breaks only in current" in row.reasons


def test_different_environments_warn_and_do_not_gate_timing():
    baseline = run(seed=0)
    current = run(scale=1.10, seed=1)
    current.environment = {**current.environment, "gpu": "NVIDIA H200", "cuda": "12.8"}
    comparison = compare_runs(baseline, current)
    assert not comparison.regressed and not comparison.timing_gated
    assert any("environments differ" in w and "gpu" in w for w in comparison.warnings)
    assert statuses(comparison) == {"warning"}
    assert all("not gated: environments differ" in r
               for row in comparison.rows for r in row.reasons)


def test_timing_gate_off_reports_but_never_regresses():
    comparison = compare_runs(run(seed=0), run(scale=1.10, seed=1), gate_timing=False)
    assert not comparison.regressed and statuses(comparison) == {"warning"}
    assert all(t.verdict == "slower" for row in comparison.rows for t in row.timings)


def test_cases_match_by_params_not_position():
    baseline = run()
    current = baseline.model_copy(deep=True)
    current.cases.reverse()
    for index, case in enumerate(current.cases):
        case.index = index
    comparison = compare_runs(baseline, current)
    assert statuses(comparison) == {"unchanged"}
    assert len({case_key(c) for c in baseline.cases}) == len(baseline.cases)


# --- compare_command ----------------------------------------------------------------------------


def _dirs(tmp_path: Path, baseline: RunResults, current: RunResults) -> tuple[Path, Path]:
    base_dir, cur_dir = tmp_path / "base", tmp_path / "cur"
    base_dir.mkdir()
    cur_dir.mkdir()
    save_results(base_dir, baseline)
    save_results(cur_dir, current)
    return base_dir, cur_dir


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=200, color_system=None), buffer


def test_command_exit_codes_and_default_output(tmp_path):
    base_dir, cur_dir = _dirs(tmp_path, run(seed=0), run(scale=1.10, seed=1))
    console, buffer = _console()
    code = compare_command(base_dir, cur_dir / "results.json", max_slowdown=0.05, out=None,
                           gate_timing=True, console=console)
    assert code == 1
    markdown = (cur_dir / "compare.md").read_text()
    assert markdown.count("**regressed**") == len(run().cases)
    assert "REGRESSED" in buffer.getvalue()
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, max_slowdown=0.05, out=tmp_path / "c.md",
                           gate_timing=False, console=console) == 0
    assert "OK: 0 regressed" in (tmp_path / "c.md").read_text()


@pytest.mark.parametrize("case", ["missing", "broken", "negative", "clobber", "no-dir"])
def test_command_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    base_dir, cur_dir = _dirs(tmp_path, run(), run(seed=1))
    (cur_dir / "compare.md").write_text("earlier")
    baseline_text = (base_dir / "results.json").read_text()
    out, max_slowdown, baseline = None, 0.05, base_dir
    if case == "missing":
        baseline = tmp_path / "nowhere"
    elif case == "broken":
        (base_dir / "results.json").write_text('{"cases": [')
    elif case == "negative":
        max_slowdown = -0.1
    elif case == "clobber":
        out = base_dir / "results.json"
    else:
        out = tmp_path / "absent" / "compare.md"
    console, _ = _console()
    code = compare_command(baseline, cur_dir, max_slowdown=max_slowdown, out=out,
                           gate_timing=True, console=console)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (cur_dir / "compare.md").read_text() == "earlier"
    if case == "clobber":
        assert (base_dir / "results.json").read_text() == baseline_text
        assert "refusing" in err


# --- nothing compared, non-finite figures, machine-readable output ---------------------------


def test_runs_with_no_case_in_common_fail_the_gate(tmp_path):
    baseline = run()
    current = run()
    for case in current.cases:
        case.params = {**case.params, "renamed": True}
    comparison = compare_runs(baseline, current)
    assert comparison.matched == 0 and comparison.failed and not comparison.regressed
    base_dir, cur_dir = _dirs(tmp_path, baseline, current)
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 1
    assert "nothing compared" in buffer.getvalue()


def test_an_empty_current_run_fails_the_gate():
    baseline = run()
    current = baseline.model_copy(deep=True)
    current.cases = []
    assert compare_runs(baseline, current).failed


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_median_regresses(value):
    baseline = run()
    current = baseline.model_copy(deep=True)
    stats = current.cases[0].timing.replay
    current.cases[0].timing.replay = stats.model_copy(update={"median_ms": value})
    comparison = compare_runs(baseline, current, gate_timing=False)
    row = next(r for r in comparison.rows if r.label == current.cases[0].label)
    assert row.status == "regressed" and "not a finite number" in row.reasons[0]
    assert comparison.failed


def test_json_output_and_step_summary(tmp_path, capsys, monkeypatch):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    base_dir, cur_dir = _dirs(tmp_path, run(), run(seed=1))
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, console=console, as_json=True) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["verdict"] == "ok" and document["matched"] == len(run().cases)
    assert {row["status"] for row in document["rows"]} <= {"unchanged", "improved", "warning"}
    assert buffer.getvalue() == ""  # the table is not printed over the JSON
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "# swa-bench compare" in text


def test_a_read_only_run_folder_is_one_line_before_comparing(tmp_path, capsys, monkeypatch):
    """Root writes anywhere, so the pre-check is exercised through os.access."""
    base_dir, cur_dir = _dirs(tmp_path, run(), run(seed=1))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != cur_dir and real_access(p, mode))
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read-only" in err and "--out" in err
    assert buffer.getvalue() == "" and not (cur_dir / "compare.md").exists()


def test_a_write_failure_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import swa_bench.compare as compare_module

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compare_module, "write_text_atomic", full)
    base_dir, cur_dir = _dirs(tmp_path, run(), run(seed=1))
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 2
    assert "No space left on device" in capsys.readouterr().err


def test_deeply_nested_json_is_bad_input(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text('{"cases": ' + "[" * 50_000 + "]" * 50_000 + "}")
    console, _ = _console()
    assert compare_command(deep, deep, console=console) == 2
    assert "nested too deeply" in capsys.readouterr().err


# --- keys, impossible times, what --out may replace -----------------------------------------


def test_a_hash_in_a_param_round_trips_through_json(tmp_path, capsys):
    """The repeat count was appended to the key text as `#n` and split off at the first `#`."""
    baseline = run()
    for case in baseline.cases:
        case.params = {**case.params, "note": "tile#2 #3"}
    baseline.cases.append(baseline.cases[0].model_copy(deep=True))
    base_dir, cur_dir = _dirs(tmp_path, baseline, baseline.model_copy(deep=True))
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, console=console, as_json=True) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == len(baseline.cases)
    assert {row["key"]["params"]["note"] for row in rows} == {"tile#2 #3"}
    assert {row["status"] for row in rows} == {"unchanged"}


@pytest.mark.parametrize("side", ["baseline", "current"])
@pytest.mark.parametrize("value", [0.0, -1.5])
def test_a_time_of_zero_or_less_is_bad_input(tmp_path, capsys, side, value):
    """No timer measures it; it used to pass for an infinite speedup (or slowdown)."""
    runs = {"baseline": run(), "current": run(seed=1)}
    stats = runs[side].cases[2].timing.replay
    runs[side].cases[2].timing.replay = stats.model_copy(update={"median_ms": value})
    base_dir, cur_dir = _dirs(tmp_path, runs["baseline"], runs["current"])
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 2
    err = capsys.readouterr().err
    folder = base_dir if side == "baseline" else cur_dir
    assert err == (f"{folder / 'results.json'}: cases.2.timing.replay.median_ms: must be > 0 ms, "
                   f"got {value:g} (case {runs[side].cases[2].label})\n")
    assert not (cur_dir / "compare.md").exists()
    row = compare_runs(runs["baseline"], runs["current"]).rows[2]
    assert row.status == "regressed" and "not a finite number > 0" in row.reasons[0]


def test_any_run_folders_output_is_refused_but_a_compare_md(tmp_path, capsys):
    base_dir, cur_dir = _dirs(tmp_path, run(), run(seed=1))
    (tmp_path / "third").mkdir()
    save_results(tmp_path / "third", run(seed=2))
    for run_dir in (base_dir, cur_dir, tmp_path / "third"):
        for report in ("report.md", "report.html", "junit.xml", "compare.md"):
            (run_dir / report).write_text(f"{run_dir.name} {report}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for folder, name in [("third", "results.json"), ("cur", "results.csv"), ("cur", "report.md"),
                         ("base", "junit.xml"), ("third", "report.html")]:
        out = tmp_path / folder / name
        console, _ = _console()
        assert compare_command(base_dir, cur_dir, out=out, console=console) == 2
        assert capsys.readouterr().err == (
            f"{out}: --out: is the {name} of the run folder {tmp_path / folder}: refusing to "
            "replace a run's output (write it elsewhere)\n")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, out=base_dir / "compare.md", console=console) == 0
    assert (base_dir / "compare.md").read_text().startswith("# swa-bench compare")
