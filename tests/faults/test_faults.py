"""Check the checker: every seeded fault makes ``swa-bench check`` fail on its shipped case."""

from __future__ import annotations

from functools import cache

import pytest

from swa_bench.engine.step_inputs import StepInputs
from swa_bench.run.cases import CaseRunner
from swa_bench.scenario import expand_cases, load_scenario
from tests.faults.faults import FAULTS

pytestmark = pytest.mark.filterwarnings("ignore")


@cache
def _cases(path: str):
    return expand_cases(load_scenario(path))


def run_case_checks(path: str, label: str) -> list[str]:
    """The checks of one shipped case, as ``swa-bench check`` runs them, up to the first that
    fails: its id (``error`` when a check raised); empty when every check passed."""
    (case,) = [c for c in _cases(path) if c.label() == label]
    runner = CaseRunner(case.scenario)
    model = runner.model(case)
    sc = case.scenario
    requests = case.requests()
    indices = sc.workload.cache_indices(len(requests), model.args.max_requests, sc.seed)
    inputs = StepInputs.seeded(requests, model.args.vocab_size, sc.seed, indices)
    try:
        for check in runner.iter_checks(case, model, inputs):
            if not check.passed:
                return [check.id]
    except Exception as err:  # a crash fails `swa-bench check` too
        return [f"error: {type(err).__name__}"]
    return []


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_is_caught(fault, monkeypatch):
    fault.apply(monkeypatch)
    failed = run_case_checks(*fault.case)
    assert failed, f"{fault.name} ({fault.breaks}) passed every check on {fault.case}"
    assert not failed[0].startswith("error"), (
        f"{fault.name} crashed the checks ({failed[0]}) instead of failing one: a broken fault "
        "or a check that cannot run")
