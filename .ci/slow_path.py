"""`swa-bench run` with one timed path made slower for real: the gate's positive control.

``python .ci/slow_path.py PATH FRACTION swa-bench-args...`` runs the CLI with every step of the
case's PATH engine ("reference" or "replay") followed by busy work on the same thread for
FRACTION of the step's own CPU time, so that path costs (1 + FRACTION) times as much and nothing
else changes. CI runs it once to show that `swa-bench compare` fails on a slowdown of that size.
"""

import sys
import time

import swa_bench.run.cases as cases
from swa_bench.cli import app


def slowed(step, fraction: float):
    def step_then_spin(*args, **kwargs):
        start = time.thread_time()
        out = step(*args, **kwargs)
        until = time.thread_time() + fraction * (time.thread_time() - start)
        while time.thread_time() < until:
            pass
        return out

    return step_then_spin


def main() -> None:
    path, fraction, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    measure_paths = cases.measure_paths

    def measure_slowed(reference, replay, *rest, **kwargs):
        engine = {"reference": reference, "replay": replay}[path]
        engine.step = slowed(engine.step, fraction)
        try:
            return measure_paths(reference, replay, *rest, **kwargs)
        finally:
            del engine.step

    cases.measure_paths = measure_slowed
    app(args, prog_name="swa-bench")


if __name__ == "__main__":
    main()
