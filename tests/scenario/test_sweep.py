"""Sweep expansion: grid products, zipped groups, stable ids, resolved cases, located errors."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from swa_bench.scenario import ScenarioError, case_id, expand_cases, scenario_from_text

BASE = """\
name: sweep
workload:
  requests:
    - {prompt_len: 20}
  generators:
    - {prefills: 1, prompt_len: 32, decodes: 0}
"""


def cases_of(sweep: str, extra: str = ""):
    return expand_cases(scenario_from_text(BASE + extra + sweep, "s.yaml"))


def error_of(sweep: str, extra: str = "") -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        cases_of(sweep, extra)
    return info.value


def test_no_sweep_is_one_base_case():
    (case,) = cases_of("")
    assert (case.case_id, case.index, case.params) == ("base", 0, {})
    assert case.num_tokens() == 20 + 32
    assert case.label() == "eager/bounded/T=52"


def test_grid_is_the_cartesian_product_in_file_order():
    cases = cases_of("sweep:\n  grid:\n    graph_mode: [eager, piecewise, full]\n"
                     "    policy: [bounded, halo]\n")
    got = [(c.params["graph_mode"], c.params["policy"]) for c in cases]
    assert got == list(itertools.product(["eager", "piecewise", "full"], ["bounded", "halo"]))
    assert [c.index for c in cases] == list(range(6))


def test_zip_groups_move_together_and_cross_the_grid():
    cases = cases_of("sweep:\n  grid: {policy: [bounded, halo]}\n  zip:\n"
                     "    - {trim_threshold: [16, 32], model.overrides.window: [8, 16]}\n"
                     "    - {seed: [1, 2, 3]}\n")
    assert len(cases) == 2 * 2 * 3
    for c in cases:
        pair = (c.params["trim_threshold"], c.params["model.overrides.window"])
        assert pair in [(16, 8), (32, 16)]
    combos = {(c.params["policy"], c.params["trim_threshold"], c.params["seed"]) for c in cases}
    assert combos == set(itertools.product(["bounded", "halo"], [16, 32], [1, 2, 3]))


def test_resolved_scenarios_carry_the_swept_values():
    cases = cases_of("sweep:\n  grid:\n    workload.requests.0.prompt_len: [40, 60]\n"
                     "    workload.generators.0.decodes: [0, 3]\n  zip:\n"
                     "    - {model.overrides.window: [8, 16], checks.e1.rtol: [0.1, 0.2]}\n")
    for c in cases:
        s = c.scenario
        assert s.sweep.is_empty
        assert s.source_path == Path("s.yaml")
        assert s.workload.requests[0].prompt_len == c.params["workload.requests.0.prompt_len"]
        assert c.model_args().window == c.params["model.overrides.window"]
        assert c.trim_threshold() == c.params["model.overrides.window"] + 1
        assert s.checks.e1.rtol == c.params["checks.e1.rtol"]
        decodes = c.params["workload.generators.0.decodes"]
        assert len(c.requests()) == 2 + decodes
        assert c.num_tokens() == c.params["workload.requests.0.prompt_len"] + 32 + decodes


def test_expansion_does_not_touch_the_input_scenario():
    scenario = scenario_from_text(BASE + "sweep: {grid: {policy: [full, halo]}}\n")
    before = scenario.model_dump()
    expand_cases(scenario)
    assert scenario.model_dump() == before


def test_case_ids_are_stable_distinct_and_hash_only_the_params():
    sweep = "sweep:\n  grid: {policy: [bounded, halo], graph_mode: [eager, full]}\n"
    first, second = cases_of(sweep), cases_of(sweep, extra="description: other text\n")
    assert [c.case_id for c in first] == [c.case_id for c in second]
    assert len({c.case_id for c in first}) == len(first)
    for c in first:
        blob = json.dumps(c.params, sort_keys=True).encode()
        assert c.case_id == hashlib.sha1(blob).hexdigest()[:10]
    assert case_id({"a": 1, "b": 2}) == case_id({"b": 2, "a": 1})


def test_labels_name_the_mode_policy_tokens_and_other_swept_values():
    cases = cases_of("sweep:\n  grid: {graph_mode: [piecewise], trim_threshold: [16, 32]}\n")
    assert [c.label() for c in cases] == ["piecewise/bounded/T=52/trim_threshold=16",
                                         "piecewise/bounded/T=52/trim_threshold=32"]


def test_whole_subtrees_can_be_swept():
    cases = cases_of("sweep:\n  grid:\n    workload.requests:\n"
                     "      - [{prompt_len: 8}]\n      - [{prompt_len: 9}, {prompt_len: 10}]\n")
    assert [len(c.requests()) for c in cases] == [2, 3]


def test_zip_length_mismatch_names_the_group_and_path():
    err = error_of("sweep:\n  zip:\n    - trim_threshold: [16, 32]\n"
                   "      seed: [1, 2, 3]\n")
    assert err.field == "sweep.zip[0].seed"
    assert "3 values" in err.message and err.line == 10


@pytest.mark.parametrize(("sweep", "field", "words"), [
    ("sweep: {grid: {timing.repeats: [1]}}\n", "sweep.grid.timing.repeats", "no field 'repeats'"),
    ("sweep: {grid: {colour: [1]}}\n", "sweep.grid.colour", "no field 'colour'"),
    ("sweep: {grid: {workload.requests.1.prompt_len: [1]}}\n",
     "sweep.grid.workload.requests.1.prompt_len", "no item '1'"),
    ("sweep: {grid: {workload.requests.x: [1]}}\n", "sweep.grid.workload.requests.x", "no item"),
    ("sweep: {grid: {seed.low: [1]}}\n", "sweep.grid.seed.low", "value with no field"),
    ("sweep: {grid: {model.overrides.colour: [1]}}\n", "sweep.grid.model.overrides.colour",
     "not a model field"),
    ("sweep: {grid: {name: [a, b]}}\n", "sweep.grid.name", "cannot be swept"),
    ("sweep: {zip: [{sweep.grid: [{}]}]}\n", "sweep.zip[0].sweep.grid", "cannot be swept"),
    ("sweep: {grid: {policy: [halo, full, halo]}}\n", "sweep.grid.policy", "duplicate value"),
    ("sweep: {grid: {seed: [1]}, zip: [{seed: [2]}]}\n", "sweep.zip[0].seed", "overlaps"),
    ("sweep: {grid: {model.overrides: [{}], model.overrides.window: [9]}}\n",
     "sweep.grid.model.overrides.window", "overlaps"),
])
def test_bad_axes_are_named(sweep, field, words):
    err = error_of(sweep)
    assert err.field == field
    assert words in err.message
    assert str(err).startswith(f"s.yaml: {field}: ")


def test_a_bad_value_names_the_sweep_entry_value_and_line():
    err = error_of("sweep:\n  grid:\n    trim_threshold:\n      - 16\n      - 4\n")
    assert err.field == "sweep.grid.trim_threshold"
    assert err.message.startswith("value 4: ") and "W=8" in err.message
    assert err.line == 11
    err = error_of("sweep: {grid: {policy: [bounded, sideways]}}\n")
    assert err.field == "sweep.grid.policy" and "value \"sideways\"" in err.message
    err = error_of("sweep: {grid: {workload.requests: [[{prompt_len: 0}]]}}\n")
    assert err.field == "sweep.grid.workload.requests"
    assert "workload.requests.0.prompt_len: must be >= 1" in err.message


def test_an_indirect_failure_names_the_field_and_the_sweep_case():
    err = error_of("sweep: {grid: {model.overrides.window: [8, 16]}}\n",
                   extra="trim_threshold: 12\n")
    assert err.field == "trim_threshold"
    assert "W=16" in err.message and "model.overrides.window=16" in err.message
    assert err.line == 7


@settings(max_examples=30, deadline=None)
@given(grid=st.lists(st.integers(1, 4), max_size=3), zips=st.lists(st.integers(1, 3), max_size=2))
def test_case_count_is_the_product_of_axis_lengths(grid, zips):
    grid_paths = ["seed", "halo_align", "timing.threads"][: len(grid)]
    zip_paths = ["timing.warmup", "timing.iters"][: len(zips)]
    sweep = {
        "grid": {p: list(range(1, n + 1)) for p, n in zip(grid_paths, grid, strict=True)},
        "zip": [{p: list(range(1, n + 1))} for p, n in zip(zip_paths, zips, strict=True)],
    }
    cases = cases_of(yaml.safe_dump({"sweep": sweep}))
    assert len(cases) == math.prod(grid + zips)
    assert len({c.case_id for c in cases}) == len(cases)
    assert all(set(c.params) == set(grid_paths + zip_paths) for c in cases)
