"""run/check over a scenario's cases: end to end, resume after a kill, a raising case, the
results schema."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from swa_bench.checks import equivalence
from swa_bench.cli import app
from swa_bench.results import ResultsError, RunResults, load_results, save_results
from swa_bench.run.cases import CaseRunner
from swa_bench.run.commands import run_scenarios
from swa_bench.run.folder import Interrupted
from swa_bench.scenario import default_scenario_path, expand_cases, load_scenario

SMALL_SWEEP = """\
name: runner-test
device: cpu
model: {preset: tiny}
workload:
  requests:
    - {prompt_len: 20}
    - {prompt_len: 9, decode: true}
policy: bounded
sweep:
  grid:
    workload.requests.0.prompt_len: [12, 20, 30]
checks:
  e1: {}
  e2: {enabled: false}
  e3: {enabled: false}
  e4: {enabled: false}
  e5: {enabled: false}
timing: {enabled: true, warmup: 0, iters: 2, breakdown: true}
"""


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "runner-test.yaml"
    path.write_text(SMALL_SWEEP)
    return path


def quiet() -> Console:
    return Console(file=open("/dev/null", "w"), width=200)  # noqa: SIM115


def test_default_run_end_to_end(tmp_path, monkeypatch):
    """`swa-bench run` with no scenario: the smoke scenario, a table, a valid results.json. One
    case of it (``-k``): `.ci/run` runs all nine, and gates them against a baseline."""
    monkeypatch.chdir(tmp_path)
    label = "piecewise/halo/T=119"
    result = CliRunner().invoke(app, ["run", "-k", label, "--out", str(tmp_path / "smoke")])
    assert result.exit_code == 0, result.output
    assert "ref ms" in result.output and "PASS" in result.output
    results = load_results(tmp_path / "smoke")
    assert results.verdict() == "pass"
    everything = expand_cases(load_scenario(default_scenario_path()))
    assert [c.label for c in results.cases] == [c.label() for c in everything
                                                if c.matches(label)] == [label]
    for name in ("results.json", "results.csv", "report.md", "report.html", "junit.xml"):
        assert (tmp_path / "smoke" / name).exists()
    case = results.cases[0]
    assert case.timing.reference.samples_ms and case.flops["reference"] > case.flops["replay"] > 0


def test_results_json_validates_against_its_schema(scenario_file, tmp_path):
    out = tmp_path / "run"
    assert run_scenarios([scenario_file], out=out, console=quiet()) == 0
    raw = json.loads((out / "results.json").read_text())
    RunResults.model_validate(raw)
    schema = RunResults.model_json_schema()
    assert set(schema["required"]) <= set(raw)
    case = raw["cases"][0]
    assert set(case["timing"]["breakdown_ms"]) == {"prepare", "gather", "layers", "scatter"}
    assert case["deterministic"]["kept_rows"] == 8 + 1  # the prefill keeps W rows, the decode 1
    for path in ("reference", "replay"):  # each path's rate, and its share of the measured GEMM
        rate = case["flops"][path] / (case["timing"][path]["median_ms"] * 1e-3) / 1e12
        assert case["achieved_tflops"][path] == pytest.approx(rate)
        peak = raw["environment"]["gemm_tflops"]["float32"]
        assert case["mfu"][path] == pytest.approx(rate / peak)


def test_killed_run_resumes_without_redoing_finished_cases(scenario_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = CaseRunner.run_case
    calls: list[str] = []

    def killed_after_first(self, case, **kwargs):
        if calls:
            raise KeyboardInterrupt  # the process dies mid-sweep
        calls.append(case.case_id)
        return real(self, case, **kwargs)

    monkeypatch.setattr(CaseRunner, "run_case", killed_after_first)
    with pytest.raises(Interrupted, match=r"kept 1 finished case in .*--resume$"):
        run_scenarios([scenario_file], out=out, console=quiet())
    finished = load_results(out)
    assert [c.case_id for c in finished.cases] == calls

    resumed: list[str] = []

    def counting(self, case, **kwargs):
        resumed.append(case.case_id)
        return real(self, case, **kwargs)

    monkeypatch.setattr(CaseRunner, "run_case", counting)
    log = io.StringIO()  # a CI log: a line per case, counted from the case the kill kept
    console = Console(file=log, width=200, force_terminal=False)
    assert run_scenarios([scenario_file], out=out, resume=True, console=console) == 0
    progress = [line.split()[0] for line in log.getvalue().splitlines() if line.startswith("[")]
    assert progress == ["[2/3]", "[3/3]"]
    all_ids = [c.case_id for c in expand_cases(load_scenario(scenario_file))]
    assert sorted(resumed) == sorted(set(all_ids) - set(calls))
    assert sorted(c.case_id for c in load_results(out).cases) == sorted(all_ids)


def test_check_json_keeps_stdout_json_and_stderr_free_of_blank_lines(scenario_file):
    """`check --json` wrote one blank line to stderr (a bar that never showed); off a terminal
    stderr now holds one progress line per case and nothing else."""
    result = CliRunner().invoke(app, ["check", "--json", str(scenario_file)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verdict"] == "pass"
    lines = result.stderr.splitlines()
    assert len(lines) == 3 and all(line.strip() for line in lines), lines
    assert lines[0].startswith("[1/3] ") and lines[-1].startswith("[3/3] ")


def test_a_resume_under_other_kernels_is_refused(scenario_file, tmp_path, monkeypatch):
    """One results.json is one measurement: a resumed run whose kernels differ from those its
    finished cases recorded (a changed SWA_BENCH_* default) is refused, naming the case and
    what differs, before any case runs."""
    out = tmp_path / "run"
    real = CaseRunner.run_case

    def killed_after_first(self, case, **kwargs):
        if load_results_or_none(out):
            raise KeyboardInterrupt
        return real(self, case, **kwargs)

    def load_results_or_none(folder):
        return (folder / "results.json").exists() and load_results(folder).cases

    monkeypatch.setattr(CaseRunner, "run_case", killed_after_first)
    with pytest.raises(Interrupted):
        run_scenarios([scenario_file], out=out, console=quiet())
    finished = load_results(out)
    assert finished.cases[0].kernels.backend == "torch"
    finished.cases[0].kernels.backend = "triton"  # as if the first run had run Triton's kernels
    save_results(out, finished)
    monkeypatch.setattr(CaseRunner, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    with pytest.raises(ResultsError, match=r"kernels: case .* ran other kernels than this run "
                                           r"would \(backend triton -> torch"):
        run_scenarios([scenario_file], out=out, resume=True, console=quiet())


def test_a_case_that_raises_is_recorded_and_the_others_run(scenario_file, tmp_path, monkeypatch):
    real = equivalence.check_e1

    def flaky(model, inputs, config, **kwargs):
        if inputs.requests[0].prompt_len == 20:
            raise RuntimeError("boom in the middle case")
        return real(model, inputs, config, **kwargs)

    monkeypatch.setattr(equivalence, "check_e1", flaky)
    out = tmp_path / "run"
    assert run_scenarios([scenario_file], out=out, console=quiet()) == 1
    results = load_results(out)
    statuses = {c.params["workload.requests.0.prompt_len"]: c.status for c in results.cases}
    assert statuses == {12: "ok", 20: "error", 30: "ok"}
    broken = next(c for c in results.cases if c.status == "error")
    assert "boom in the middle case" in broken.error
    assert results.verdict() == "error"
