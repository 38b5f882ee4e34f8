"""Scenario files: the schema, loading with one-line errors, and sweep expansion into cases."""

from swa_bench.scenario.errors import ScenarioError
from swa_bench.scenario.loader import (
    default_scenario_path,
    load_cases,
    load_scenario,
    resolve_scenario_path,
    scenario_from_text,
    shipped_scenarios,
)
from swa_bench.scenario.schema import MAX_CASES, MAX_CASES_LIMIT, Scenario
from swa_bench.scenario.sweep import Case, case_id, count_cases, expand_cases

__all__ = [
    "MAX_CASES",
    "MAX_CASES_LIMIT",
    "Case",
    "Scenario",
    "ScenarioError",
    "case_id",
    "count_cases",
    "default_scenario_path",
    "expand_cases",
    "load_cases",
    "load_scenario",
    "resolve_scenario_path",
    "scenario_from_text",
    "shipped_scenarios",
]
