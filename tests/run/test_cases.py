"""The case runner: which engine each check and timed path runs on (decided in
``CaseRunner.engine`` / ``engine_pair`` alone), and the one skeleton every case result starts
from."""

from __future__ import annotations

import dataclasses

import pytest

from swa_bench.engine.engine import Engine
from swa_bench.run.cases import CaseRunner, case_skeleton
from swa_bench.run.shards import lost_case
from swa_bench.scenario import expand_cases, scenario_from_text

PIECEWISE = """\
name: cases-test
device: cpu
model: {preset: tiny}
workload:
  requests:
    - {prompt_len: 40}
    - {prompt_len: 9, decode: true}
graph_mode: piecewise
capture_sizes: [8, 16, 32, 64]
checks:
  e1: {}
  e2: {}
  e3: {}
  e4: {enabled: false}
  e5: {}
timing: {enabled: true, warmup: 0, iters: 1, breakdown: false}
"""


def test_checks_and_timing_share_the_runners_graph_engines(monkeypatch):
    """Each check asks the runner for the engine of the configuration it checks; a graph mode's
    engine is the runner's, kept while its configuration is the one in use: E3, E5 and the
    timing run on one engine (E2's halo engine displaced E1's, one configuration's graph pools
    at a time)."""
    (case,) = expand_cases(scenario_from_text(PIECEWISE))
    runner = CaseRunner(case.scenario)
    given: list[tuple[str, Engine]] = []
    real = CaseRunner.engine

    def spy(self, model, config):
        engine = real(self, model, config)
        given.append((config.policy, engine))
        return engine

    monkeypatch.setattr(CaseRunner, "engine", spy)
    result = runner.run_case(case)
    assert result.status == "ok", result.error or [c.message for c in result.failed_checks()]
    config = case.engine_config()
    assert [policy for policy, _ in given] == ["bounded", "halo", "bounded", "bounded", "bounded"]
    timed = runner.engines[(config, False)]
    assert all(engine is timed for _, engine in given[2:]), "E3, E5 and the timing: one engine"
    assert given[0][1] is not timed
    assert (dataclasses.replace(config, policy="halo"), False) not in runner.engines, (
        "one graph configuration's pools at a time: the halo engine is dropped for the timing")


def test_eager_checks_get_fresh_engines_and_keep_none():
    (case,) = expand_cases(scenario_from_text(PIECEWISE.replace("piecewise", "eager")))
    runner = CaseRunner(case.scenario)
    model = runner.model(case)
    config = case.engine_config()
    assert runner.engine(model, config) is not runner.engine(model, config)
    assert runner.engines == {}


@pytest.mark.parametrize("status, error", [("ok", None), ("error", "boom")])
def test_every_case_result_starts_from_one_skeleton(status, error):
    (case,) = expand_cases(scenario_from_text(PIECEWISE))
    result = case_skeleton(case, status, error)
    assert (result.case_id, result.index, result.label, result.params) == (
        case.case_id, case.index, case.label(), case.params)
    assert (result.graph_mode, result.policy, result.trim_threshold) == (
        "piecewise", "bounded", case.model_args().window + 1)
    assert (result.tokens, result.num_requests, result.status, result.error) == (
        41, 2, status, error)
    lost = lost_case(case, -9)
    assert lost.model_copy(update={"error": None, "status": "ok"}) == case_skeleton(case, "ok")
    assert lost.error == "its worker process ended with exit code -9"
