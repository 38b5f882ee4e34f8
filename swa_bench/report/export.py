"""Exports of a run for other tools."""

from __future__ import annotations

from typing import Any

from swa_bench.results import RunResults


def github_benchmark_entries(results: RunResults) -> list[dict[str, Any]]:
    """github-action-benchmark's ``customSmallerIsBetter`` entries: one per case and timed path,
    named ``<scenario>/<case label>/<path>`` (stable while the sweep is), value the median in ms,
    range p10–p90, extra the sample count and the speedup."""
    entries = []
    for case in results.cases:
        if case.timing is None:
            continue
        for path in ("reference", "replay"):
            stats = getattr(case.timing, path)
            if stats is None:
                continue
            extra = f"n={len(stats.samples_ms)}; p10={stats.p10_ms:.4g} p90={stats.p90_ms:.4g} ms"
            if case.speedup is not None:
                extra += f"; speedup {case.speedup:.2f}x"
            entries.append({
                "name": f"{results.scenario_name}/{case.label}/{path}",
                "unit": "ms",
                "value": round(stats.median_ms, 6),
                "range": f"{stats.p10_ms:.4g}-{stats.p90_ms:.4g}",
                "extra": extra,
            })
    return entries
