"""Scenario files: the schema, loading with one-line errors, and sweep expansion into cases."""

from swa_bench.scenario.errors import ScenarioError
from swa_bench.scenario.loader import default_scenario_path, load_scenario, scenario_from_text
from swa_bench.scenario.schema import DTYPE_TOLERANCES, Scenario, default_capture_sizes
from swa_bench.scenario.sweep import Case, case_id, expand_cases

__all__ = [
    "DTYPE_TOLERANCES",
    "Case",
    "Scenario",
    "ScenarioError",
    "case_id",
    "default_capture_sizes",
    "default_scenario_path",
    "expand_cases",
    "load_scenario",
    "scenario_from_text",
]
