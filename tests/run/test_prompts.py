"""A prompt case end to end through the case runner, in PIECEWISE (the checks and the timed
paths share the runner's graph engines): E1 at every chunk, E2 on the halo's end state, the
approximation after the last chunk, E3 and E5 on the last chunk's step, then both paths timed
chunk by chunk; the result round-trips through results.json's schema and the reports show the
TTFT table."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from swa_bench.bench.timing import num_threads
from swa_bench.report.console import print_run_summary
from swa_bench.report.markdown import render_markdown
from swa_bench.results import RunResults
from swa_bench.run.cases import CaseRunner
from swa_bench.scenario import expand_cases, scenario_from_text

PROMPT_CASE = """\
name: prompt-case
device: cpu
model: {preset: tiny}
workload:
  prompts:
    - {length: 60, chunk_size: 24, decodes_beside: 1, decode_context: 12}
policy: halo
graph_mode: piecewise
capture_sizes: [8, 16, 32]
checks:
  e1: {}
  e2: {}
  e3: {}
  e4: {enabled: false}
  e5: {}
  approximation: {enabled: true, continuation_steps: 8}
timing: {enabled: true, warmup: 0, iters: 2, threads: 1}
"""


@pytest.fixture(scope="module")
def ran():
    scenario = scenario_from_text(PROMPT_CASE)
    (case,) = expand_cases(scenario)
    with num_threads(1):
        result = CaseRunner(scenario).run_case(case)
    return case, result


def test_a_prompt_case_checks_every_chunk_and_times_both_paths(ran):
    case, result = ran
    assert result.status == "ok", (result.error, [c.message for c in result.checks
                                                  if not c.passed])
    assert [c.id for c in result.checks] == ["E1", "E1", "E1", "E2", "approximation.S+1",
                                             "approximation", "visibility", "E3", "E5"]
    assert result.label == "piecewise/halo/T=60/chunks=24+1d"
    assert (result.tokens, result.num_requests, result.timing) == (60, 2, None)
    (prompt,) = result.prompts
    assert [(s.cached_len, s.query_len, s.tokens) for s in prompt.steps] == [
        (0, 24, 25), (24, 24, 25), (48, 12, 13)]
    # 25 rows: halo H = 29 keeps every row; the replay route says so, and the step ran a graph
    assert all(s.kept_rows == s.tokens for s in prompt.steps)
    assert all(s.reference and s.replay and len(s.replay.samples_ms) == 2 for s in prompt.steps)
    assert prompt.ttft.replay.median_ms > 0 and prompt.approximation is not None
    assert prompt.approximation.continuation_steps == 8


def test_a_prompt_case_round_trips_and_reports_its_ttft(ran):
    _, result = ran
    run = RunResults(scenario_name="prompt-case", scenario_file=None, scenario_hash="0",
                     scenario={}, environment={}, started_at="now", cases=[result])
    again = RunResults.model_validate_json(run.model_dump_json())
    assert again.cases[0].prompts == result.prompts
    markdown = render_markdown(again)
    assert "## Time to first token (whole prompts in chunks)" in markdown
    assert "| piecewise/halo/T=60/chunks=24+1d | 60/24 +1d" in markdown
    assert "### Prompt steps" in markdown and "[48, 60)" in markdown
    out = io.StringIO()
    print_run_summary(Console(file=out, width=80), again, run_dir=".")
    text = out.getvalue()
    assert "prompt-case: time to first token" in text
    assert "after the last chunk vs full prefill" in text
    tables = text[:text.index("PASS")]  # the verdict line wraps where the terminal does
    assert max(len(line) for line in tables.splitlines()) <= 80
