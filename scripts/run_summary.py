"""One line per case of ``swa-bench run`` folders: reference / replay median ms, speedup, MFU,
checks; then the trim-threshold advice. Used by the device scripts' printed summaries.

    python3 scripts/run_summary.py RUN_FOLDER [RUN_FOLDER ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    for folder in map(Path, sys.argv[1:]):
        path = folder / "results.json"
        if not path.exists():
            print(f"{folder.name}: no results")
            continue
        data = json.loads(path.read_text())
        for case in data["cases"]:
            timing = case.get("timing") or {}
            ref, rep = ((timing.get(p) or {}).get("median_ms") for p in ("reference", "replay"))
            checks = "".join("." if k["passed"] else "F" for k in case.get("checks", []))
            print(f"{folder.name} {case['label']}: ref {fmt(ref)} replay {fmt(rep)} ms, speedup "
                  f"{fmt(case.get('speedup'))}, mfu {case.get('mfu')}, checks {checks} "
                  f"{case['status']}")
        for advice in data.get("threshold_advice", []):
            print(f"{folder.name} advice {advice['graph_mode']} / {advice['batch']}: "
                  f"trim_threshold {advice['recommended_trim_threshold']} ({advice['note']})")


if __name__ == "__main__":
    main()
