"""``swa-bench export``: strict JSON for github-action-benchmark, and an --out that never replaces
what a run wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swa_bench.cli import app
from swa_bench.report.export import github_benchmark_entries
from swa_bench.results import save_results

try:  # click < 8.2 mixes stderr into stdout unless told not to
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()


def _reject(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON (JSON.parse refuses it)")


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_median_is_left_out_with_a_warning(tmp_path, run_results, value):
    case = next(c for c in run_results.cases if c.timing)
    index = run_results.cases.index(case)
    case.timing.replay = case.timing.replay.model_copy(update={"median_ms": value})
    save_results(tmp_path, run_results)
    result = runner.invoke(app, ["export", str(tmp_path)])
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout, parse_constant=_reject)
    names = {e["name"] for e in entries}
    assert f"synthetic/{case.label}/replay" not in names
    assert f"synthetic/{case.label}/reference" in names
    assert len(entries) == len(github_benchmark_entries(run_results))
    assert result.stderr == (f"warning: {tmp_path / 'results.json'}: cases.{index}.timing.replay"
                             f".median_ms: {value} is not a finite number; synthetic/"
                             f"{case.label}/replay left out of the export\n")


def test_a_runs_output_is_refused_and_an_earlier_export_replaced(tmp_path, run_results):
    for run_dir in (tmp_path / "run", tmp_path / "other"):
        run_dir.mkdir()
        save_results(run_dir, run_results)
        for report in ("report.md", "junit.xml", "compare.md"):
            (run_dir / report).write_text(report)
    before = _files(tmp_path)
    for folder, name in [("other", "results.json"), ("run", "results.csv"), ("other", "report.md"),
                         ("other", "junit.xml"), ("other", "compare.md")]:
        out = tmp_path / folder / name
        result = runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(out)])
        assert result.exit_code == 2
        assert result.stderr == (f"{out}: --out: is the {name} of the run folder "
                                 f"{tmp_path / folder}: refusing to replace a run's output "
                                 "(write it elsewhere)\n")
    assert _files(tmp_path) == before
    out = tmp_path / "run" / "benchmark.json"
    out.write_text("[]\n")
    result = runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == github_benchmark_entries(run_results)


def test_the_exported_results_file_is_refused_whatever_its_name(tmp_path, run_results):
    source = tmp_path / "baseline.json"
    source.write_text(run_results.model_dump_json())
    before = source.read_bytes()
    result = runner.invoke(app, ["export", str(source), "--out", str(source)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--out: is the results file being exported" in result.stderr
    assert source.read_bytes() == before
