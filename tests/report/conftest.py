"""Fixtures over the synthetic run in synthetic.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from swa_bench.results import RunResults, save_results
from tests.report.synthetic import synthetic_run


@pytest.fixture
def make_run():
    """The factory itself, for tests that need a variant (a hostile name, no failures...)."""
    return synthetic_run


@pytest.fixture
def run_results() -> RunResults:
    return synthetic_run()


@pytest.fixture
def run_dir(tmp_path: Path, run_results: RunResults) -> Path:
    save_results(tmp_path, run_results)
    return tmp_path
