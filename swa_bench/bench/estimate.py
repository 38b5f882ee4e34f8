"""What a case will cost before it runs: the dry run's duration estimate, from the FLOP model.

A step costs a fixed overhead per layer (kernel launches, Python, the CPU tape) plus its FLOPs at
the device's GEMM rate; a case runs the timed steps of both paths (warmup + iters each) and, per
enabled check, about ``CHECK_STEPS`` steps' worth of work (its reference and replay passes, the
graph capture, the continuation of the approximation check). Every step is priced at the full
(reference) step's FLOPs from ``flop_model.step_flops``: an upper bound on replay's.

The constants are per device kind and calibrated from committed runs (no measurement at dry-run
time, so a dry run stays a second long on a loaded machine):

* CPU, from ``ci/smoke-baseline.json`` (2-core VM, one thread): GEMM rate 0.104 TFLOP/s (its
  ``environment.gemm_tflops``); 2.3 ms a layer (its eager reference medians less their FLOPs at
  that rate, over 8 layers); its 9 cases took 33 s, 3.7 s a case: 186 steps of 19.3 ms, of
  which 24 timed, so about 27 steps per enabled check (6 in smoke). The process's own start
  (imports: 5-15 s) is not counted.
* GPU, from ``reports/h200-v41-flash-eager-16k`` (one H200): 794 TFLOP/s bf16, whose 16k-token
  eager reference (555 TFLOP in 1424 ms) puts the rate actually reached at 390 TFLOP/s; the
  per-layer overhead is the CPU's launch cost, 0.2 ms.

The estimate is a planning figure (a factor of about 3 either way), never a result: it is
printed by ``--dry-run`` with its basis, and never written to results.
"""

from __future__ import annotations

from dataclasses import dataclass

from swa_bench.bench.flop_model import step_flops
from swa_bench.model.args import ModelArgs
from swa_bench.model.requests import RequestSpec

CHECK_STEPS = 27
CHECK_NAMES = ("e1", "e2", "e3", "e4", "e5", "approximation", "tasks")


@dataclass(frozen=True)
class DeviceRate:
    """What a step costs on one kind of device: FLOP/s reached and seconds per layer."""

    name: str
    flops_per_s: float
    layer_s: float
    basis: str


CPU_RATE = DeviceRate("cpu", 0.104e12, 2.3e-3,
                      "CPU constants from ci/smoke-baseline.json (0.104 TFLOP/s, 2.3 ms/layer)")
GPU_RATE = DeviceRate("cuda", 390e12, 0.2e-3,
                      "GPU constants from reports/h200-v41-flash-eager-16k (390 TFLOP/s, "
                      "0.2 ms/layer)")


@dataclass(frozen=True)
class CaseEstimate:
    step_flops: int
    step_s: float
    steps: int  # step-equivalents: timed steps plus CHECK_STEPS per enabled check
    seconds: float


def step_seconds(args: ModelArgs, flops: int, rate: DeviceRate) -> float:
    return args.n_layers * rate.layer_s + flops / rate.flops_per_s


def case_steps(*, checks_enabled: int, timing_enabled: bool, warmup: int, iters: int) -> int:
    """Step-equivalents a case runs: both paths' timed calls and ``CHECK_STEPS`` per check."""
    timed = 2 * (warmup + iters) if timing_enabled else 0
    return timed + CHECK_STEPS * checks_enabled


def estimate_case(args: ModelArgs, requests: list[RequestSpec], *, checks_enabled: int,
                  timing_enabled: bool, warmup: int, iters: int,
                  rate: DeviceRate) -> CaseEstimate:
    """The case's estimated duration; pure (the FLOP model runs no model)."""
    flops = step_flops(args, requests, [r.query_len for r in requests])["total"]
    step = step_seconds(args, flops, rate)
    steps = case_steps(checks_enabled=checks_enabled, timing_enabled=timing_enabled,
                       warmup=warmup, iters=iters)
    return CaseEstimate(flops, step, steps, step * steps)


def format_duration(seconds: float) -> str:
    """``40 s``, ``3.5 min``, ``2.1 h``: two figures, as precise as an estimate is."""
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
