"""Two runs of one scenario on one machine must advise the same trim_threshold in each group
both ran, or one of them none ("not enough evidence"): three default runs once advised 119,
none, 119 for eager/halo. CI checks the default run against the timing gate's A/A run of its
eager cases (a test that timed the scenario twice more took two minutes of the suite).

``python .ci/same_advice.py RUN_A RUN_B``: exit 0 when the advice agrees, 1 (each group that
flipped named) when it does not or when no group is in both runs."""

from __future__ import annotations

import sys

from swa_bench.results import load_results


def advice(run_dir: str) -> dict[tuple[str, str], tuple[int | None, bool]]:
    results = load_results(run_dir)
    return {(a.graph_mode, a.batch): (a.recommended_trim_threshold, a.decided)
            for a in results.threshold_advice}


def main(first_dir: str, second_dir: str) -> int:
    first, second = advice(first_dir), advice(second_dir)
    shared = sorted(first.keys() & second.keys())  # the second run may time a subset
    if not shared:
        print(f"no advice group in both runs: {sorted(first)} vs {sorted(second)}",
              file=sys.stderr)
        return 1
    flipped = [f"{mode}/{batch}: {first[key][0]} vs {second[key][0]}"
               for key in shared for mode, batch in [key]
               if first[key][1] and second[key][1] and first[key] != second[key]]
    for line in flipped:
        print(f"threshold advice flipped between two runs: {line}", file=sys.stderr)
    print(f"threshold advice: {len(shared)} groups in both runs, {len(flipped)} flipped")
    return 1 if flipped else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
