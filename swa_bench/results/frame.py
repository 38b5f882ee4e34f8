"""results.csv: one row per case, the columns people sort and plot by (a pandas frame)."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from swa_bench.results.schema import CaseTiming, RunResults


def results_frame(results: RunResults) -> pd.DataFrame:
    """One row per case with the columns people sort and plot by; swept params as `param.<path>`."""
    rows = []
    for case in results.cases:
        timing = case.timing or CaseTiming()
        approx = case.approximation
        row: dict[str, Any] = {
            "case_id": case.case_id,
            "index": case.index,
            "label": case.label,
            "status": case.status,
            "graph_mode": case.graph_mode,
            "policy": case.policy,
            "trim_threshold": case.trim_threshold,
            "tokens": case.tokens,
            "num_requests": case.num_requests,
            "batch": case.batch,
            "checks_passed": sum(c.passed and c.mode != "info" for c in case.checks),
            "checks_failed": sum(not c.passed and c.mode != "info" for c in case.checks),
            "checks_info": sum(c.mode == "info" for c in case.checks),
            "failed_checks": " ".join(c.id for c in case.failed_checks()),
        }
        for path_name, stats in (("reference", timing.reference), ("replay", timing.replay)):
            row[f"{path_name}_median_ms"] = stats.median_ms if stats else None
            row[f"{path_name}_p10_ms"] = stats.p10_ms if stats else None
            row[f"{path_name}_p90_ms"] = stats.p90_ms if stats else None
            row[f"{path_name}_noisy"] = stats.noisy if stats else None
        row.update(
            speedup=case.speedup,
            ideal_speedup=case.ideal_speedup,
            efficiency=case.efficiency,
            roofline_ideal_speedup=case.roofline_ideal_speedup,
            roofline_efficiency=case.roofline_efficiency,
            bytes_reference=case.reference_bytes,
            bytes_replay=case.replay_bytes,
            flops_reference=case.flops.get("reference"),
            flops_replay=case.flops.get("replay"),
            peak_memory_reference=case.peak_memory_bytes.get("reference"),
            peak_memory_replay=case.peak_memory_bytes.get("replay"),
            logits_max_abs=approx.logits_max_abs if approx else None,
            kl=approx.kl if approx else None,
            top1_agreement=approx.top1_agreement if approx else None,
            greedy_agreement=approx.greedy_agreement if approx else None,
            error=case.error,
        )
        for name, value in sorted(case.params.items()):
            scalar = isinstance(value, (str, int, float, bool))
            row[f"param.{name}"] = value if scalar else json.dumps(value, sort_keys=True)
        rows.append(row)
    return pd.DataFrame(rows)
