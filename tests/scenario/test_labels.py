"""Case labels (issue 30): built from what the sweep varies, unique within every scenario, and
readable: ``graph_mode/policy/T=<tokens>`` then ``key=value`` parts, no JSON quoting."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import swa_bench
from swa_bench.scenario import expand_cases, load_scenario, scenario_from_text

SHIPPED = sorted((Path(swa_bench.__file__).parent / "scenarios").glob("*.yaml"))
PART = re.compile(r"^[A-Za-z0-9_.]+=[^/\s\"{}]+$")


def _readable(label: str) -> bool:
    mode, policy, tokens, *rest = label.split("#")[0].split("/")
    return (mode in ("eager", "piecewise", "full") and policy.isidentifier()
            and re.fullmatch(r"T=\d+", tokens) is not None and all(PART.match(p) for p in rest))


def test_scenarios_are_shipped():
    assert len(SHIPPED) >= 10, SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_no_two_cases_of_a_shipped_scenario_share_a_label(path):
    labels = [c.label() for c in expand_cases(load_scenario(path))]
    shared = [label for label, n in Counter(labels).items() if n > 1]
    assert not shared, f"{path.name}: {shared}"
    unreadable = [label for label in labels if not _readable(label) or len(label) > 160]
    assert not unreadable, f"{path.name}: {unreadable}"


def _labels(sweep: str) -> list[str]:
    text = f"name: labels\nworkload:\n  requests:\n    - {{prompt_len: 16}}\n{sweep}"
    return [c.label() for c in expand_cases(scenario_from_text(text, "labels.yaml"))]


def test_workloads_of_one_token_count_are_told_apart_by_their_requests():
    """The issue's sweep: three workloads of T = 16 labelled alike before."""
    labels = _labels("sweep:\n  grid:\n    workload.requests:\n"
                     "      - [{prompt_len: 16}]\n"
                     "      - [{prompt_len: 24, cached_len: 8}]\n"
                     "      - [{prompt_len: 8}, {prompt_len: 8}]\n"
                     "      - [{prompt_len: 40, chunk_size: 15}, {prompt_len: 9, decode: true}]\n")
    assert labels == ["eager/bounded/T=16/requests=16", "eager/bounded/T=16/requests=8+16",
                      "eager/bounded/T=16/requests=2x8",
                      "eager/bounded/T=16/requests=15of40,dec@9"]


def test_a_workload_value_is_shown_only_where_t_does_not_tell():
    assert _labels("sweep: {grid: {workload.requests.0.prompt_len: [16, 32]}}\n") == [
        "eager/bounded/T=16", "eager/bounded/T=32"]
    assert _labels("sweep: {grid: {workload.requests.0.prompt_logprobs: [false, true]}}\n") == [
        "eager/bounded/T=16/prompt_logprobs=false", "eager/bounded/T=16/prompt_logprobs=true"]
    # a prefix hit of the same query length: the first path that tells them apart is shown
    zipped = ("sweep:\n  zip:\n    - {workload.requests.0.prompt_len: [16, 24],"
              " workload.requests.0.cached_len: [0, 8]}\n")
    assert _labels(zipped) == ["eager/bounded/T=16/prompt_len=16",
                               "eager/bounded/T=16/prompt_len=24"]


def test_values_rendered_alike_fall_back_to_the_case_id():
    cases = expand_cases(scenario_from_text(
        "name: labels\nworkload:\n  requests:\n    - {prompt_len: 16}\nsweep:\n  grid:\n"
        "    workload.requests:\n      - [{prompt_len: 8, repeat: 2}]\n"
        "      - [{prompt_len: 8}, {prompt_len: 8}]\n", "labels.yaml"))
    assert [c.label() for c in cases] == [f"eager/bounded/T=16/requests=2x8#{c.case_id}"
                                         for c in cases]
