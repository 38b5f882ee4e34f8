"""results.frame: results.csv has a row per case and the columns people sort and plot by."""

import pandas as pd
import pytest

from swa_bench.results import RESULTS_CSV, save_results
from tests.report.synthetic import synthetic_run


def test_csv_has_one_row_per_case_with_key_columns(tmp_path):
    results = synthetic_run()
    save_results(tmp_path, results)
    frame = pd.read_csv(tmp_path / RESULTS_CSV)
    assert len(frame) == len(results.cases)
    for column in ("case_id", "label", "status", "graph_mode", "policy", "tokens",
                   "reference_median_ms", "replay_median_ms", "speedup", "ideal_speedup",
                   "flops_reference", "failed_checks", "param.policy"):
        assert column in frame.columns
    failing = frame[frame["status"] == "failed"]
    assert list(failing["failed_checks"]) == ["E3"]
    first = results.cases[0]
    assert frame.loc[0, "replay_median_ms"] == pytest.approx(first.timing.replay.median_ms)
    assert frame.loc[0, "flops_replay"] == first.flops["replay"]
