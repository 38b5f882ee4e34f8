"""run.compare, the compare command: exit codes, compare.md where it belongs, one line of
stderr for every bad input before anything is written, and --json."""

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from swa_bench.compare import compare_runs
from swa_bench.results import RunResults, save_results
from swa_bench.run.compare import compare_command
from tests.report.synthetic import clean_run, with_kernels


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
    base_dir, cur_dir = _dirs(tmp_path, clean_run(seed=0), clean_run(replay_scale=1.20, seed=1))
    console, buffer = _console()
    code = compare_command(base_dir, cur_dir / "results.json", max_slowdown=0.05, out=None,
                           gate_timing=True, console=console)
    assert code == 1
    assert "REGRESSED" in buffer.getvalue()
    assert not (cur_dir / "compare.md").exists()  # a failed gate writes nothing into CURRENT
    assert "not written" in buffer.getvalue()
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, out=tmp_path / "c.md", console=console) == 1
    markdown = (tmp_path / "c.md").read_text()  # --out given: the failed comparison is kept
    assert markdown.count("**regressed**") == len(clean_run().cases)
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, max_slowdown=0.05, out=tmp_path / "c.md",
                           gate_timing=False, console=console) == 0
    assert "OK: 0 regressed" in (tmp_path / "c.md").read_text()
    assert compare_command(base_dir, cur_dir, gate_timing=False, console=console) == 0
    assert "OK: 0 regressed" in (cur_dir / "compare.md").read_text()


@pytest.mark.parametrize("case", ["missing", "broken", "negative", "clobber", "no-dir"])
def test_command_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    base_dir, cur_dir = _dirs(tmp_path, clean_run(), clean_run(seed=1))
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


def test_runs_with_no_case_in_common_fail_the_gate(tmp_path):
    baseline = clean_run()
    current = clean_run()
    for case in current.cases:
        case.params = {**case.params, "renamed": True}
    comparison = compare_runs(baseline, current)
    assert comparison.matched == 0 and comparison.failed and not comparison.regressed
    base_dir, cur_dir = _dirs(tmp_path, baseline, current)
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 1
    assert "nothing compared" in buffer.getvalue()


def test_json_output_and_step_summary(tmp_path, capsys, monkeypatch):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    base_dir, cur_dir = _dirs(tmp_path, clean_run(), clean_run(seed=1))
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, console=console, as_json=True) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["verdict"] == "ok" and document["matched"] == len(clean_run().cases)
    assert {row["status"] for row in document["rows"]} <= {"unchanged", "improved", "warning"}
    assert buffer.getvalue() == ""  # the table is not printed over the JSON
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "# swa-bench compare" in text


def test_a_read_only_run_folder_is_one_line_before_comparing(tmp_path, capsys, monkeypatch):
    """Root writes anywhere, so the pre-check is exercised through os.access."""
    base_dir, cur_dir = _dirs(tmp_path, clean_run(), clean_run(seed=1))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != cur_dir and real_access(p, mode))
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read-only" in err and "--out" in err
    assert buffer.getvalue() == "" and not (cur_dir / "compare.md").exists()


def test_a_write_failure_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import swa_bench.run.compare as compare_module

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compare_module, "write_text_atomic", full)
    base_dir, cur_dir = _dirs(tmp_path, clean_run(), clean_run(seed=1))
    console, _ = _console()
    assert compare_command(base_dir, cur_dir, console=console) == 2
    assert "No space left on device" in capsys.readouterr().err


def test_deeply_nested_json_is_bad_input(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text('{"cases": ' + "[" * 50_000 + "]" * 50_000 + "}")
    console, _ = _console()
    assert compare_command(deep, deep, console=console) == 2
    assert "nested too deeply" in capsys.readouterr().err


def test_a_hash_in_a_param_round_trips_through_json(tmp_path, capsys):
    """The repeat count was appended to the key text as `#n` and split off at the first `#`."""
    baseline = clean_run()
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
    runs = {"baseline": clean_run(), "current": clean_run(seed=1)}
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
    base_dir, cur_dir = _dirs(tmp_path, clean_run(), clean_run(seed=1))
    (tmp_path / "third").mkdir()
    save_results(tmp_path / "third", clean_run(seed=2))
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



def test_the_command_fails_on_other_kernels_unless_allowed(tmp_path, capsys):
    baseline = with_kernels(clean_run())
    base, cur = _dirs(tmp_path, baseline, with_kernels(baseline, backend="torch"))
    quiet = Console(file=io.StringIO())
    assert compare_command(base, cur, console=quiet, out=tmp_path / "c.md") == 1
    assert "NOT COMPARABLE" in (tmp_path / "c.md").read_text()
    assert compare_command(base, cur, console=quiet, allow_config_change=True) == 0
    assert "A/B: kernels differ (backend triton -> torch)" in (cur / "compare.md").read_text()


def test_a_run_with_mfu_bases_compares_with_one_written_before(tmp_path):
    """An older results file (no mfu_basis) against a new one: compared as before."""
    from swa_bench.results import MfuBasis

    current = clean_run(seed=1)
    for case in current.cases:
        case.mfu_basis = MfuBasis(dtype="float32", dtype_tflops=0.1, note="no fp8 GEMMs ran",
                                  fp8_flops={"reference": 0, "replay": 0},
                                  dtype_flops=dict(case.flops))
    base_dir, cur_dir = _dirs(tmp_path, clean_run(seed=0), current)
    console, buffer = _console()
    assert compare_command(base_dir, cur_dir, gate_timing=False, console=console) == 0
    assert "OK: 0 regressed" in (cur_dir / "compare.md").read_text()
