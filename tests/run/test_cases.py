"""The case runner: which engine each check and timed path runs on (decided in
``CaseRunner.engine`` / ``engine_pair`` alone), and the one skeleton every case result starts
from."""

from __future__ import annotations

import dataclasses

import pytest

from swa_bench.bench.timing import num_threads
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


TASKS_IN_CHUNKS = """\
name: tasks-chunks
device: cpu
model: {preset: tiny}
workload:
  requests:
    - {prompt_len: 16}
checks:
  e1: {enabled: false}
  e2: {enabled: false}
  e3: {enabled: false}
  e4: {enabled: false}
  e5: {enabled: false}
  tasks: {enabled: true, windows: [1, 8], distances: [8], prompts: 2, continuation: 2}
sweep:
  grid:
    checks.tasks.chunk_size: [null, 24]
    policy: [full, bounded]
timing: {enabled: false}
"""


def test_each_chunk_size_is_graded_against_the_full_prefill_in_its_own_chunks(monkeypatch):
    """The runner caches the full prefill's task run by its settings, chunk size among them: a
    case in chunks of 24 is graded against the full prefill in chunks of 24, one of whole
    prompts against whole prompts, and each full run happens once."""
    from swa_bench.checks import tasks as task_checks
    from swa_bench.run import cases as case_module

    calls = []

    def spy(model, policy, settings, **kwargs):
        reference = kwargs.get("reference")
        calls.append((policy, settings.chunk_size,
                      None if reference is None else reference.results.chunk_size))
        return task_checks.run_tasks(model, policy, settings, **kwargs)

    monkeypatch.setattr(case_module, "run_tasks", spy)
    cases = expand_cases(scenario_from_text(TASKS_IN_CHUNKS))
    runner = CaseRunner(cases[0].scenario)
    model = runner.model(cases[0])
    recorded = []
    with num_threads(1):  # the tiny model's GEMMs: two threads only spin-wait (conftest)
        for case in cases:
            run, check = runner.tasks(case, model)
            recorded.append((case.scenario.policy, run.results.policy, run.results.chunk_size))
            assert check.passed, check.message
    assert recorded == [("full", "full", None), ("bounded", "bounded", None),
                        ("full", "full", 24), ("bounded", "bounded", 24)]
    assert calls == [("full", None, None), ("bounded", None, None), ("full", 24, None),
                     ("bounded", 24, 24)]
    assert len(runner.full_tasks) == 2
    assert [c.label() for c in cases] == [
        "eager/full/T=16/chunk_size=null", "eager/bounded/T=16/chunk_size=null",
        "eager/full/T=16/chunk_size=24", "eager/bounded/T=16/chunk_size=24"]
