"""Host overhead of a small eager step on the GPU: graph-modes' small mixed batch (2 prefills of
48 + 8 decodes at context 24, fp32), reference and replay paths. Prints each path's wall time
per step (median of 20, the device synchronised), the host time to issue it, the device's busy
time (the sum of its kernels' times: a step is host-bound when this is well under the wall
time), its kernel launches by kind (torch.profiler; each in launch order in
``$OUT/hotpath-<preset>-<path>-kernels.txt``), and where the host time goes (cProfile, by
Python function, in ``$OUT/hotpath-<preset>-<path>-cprofile.txt``); then what one call costs
the host in this process (a one-element add, a small linear, a Triton launch, direct and on
Triton's own path: ``kernels.launch``): the floor a step's launches put under its wall time.
The target: an eager step under 15 ms. With a prompt length, one cold prefill of that length
instead of the mixed batch (threshold-sweep's cases: where replay's saved device time should
show).

    python3 scripts/hotpath_gpu.py [preset] [prompt_len]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from profile_gpu import kind
from torch.profiler import ProfilerActivity, profile

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

ITERS = 20


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    args = PRESETS[preset]
    model, _ = build_model(args, seed=0, device=dev, dtype=torch.float32)
    prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if prompt_len:
        requests, what, tag = [RequestSpec(prompt_len=prompt_len)], "prefill", f"-{prompt_len}"
    else:
        requests = [RequestSpec(prompt_len=48)] * 2 + [RequestSpec(prompt_len=25, decode=True)] * 8
        what, tag = "mixed step", ""
    inputs = StepInputs.seeded(requests, args.vocab_size, 0)
    # Eager: trim_threshold plays no part (its default, W + 1, is valid for every preset).
    config = EngineConfig.for_model(args, policy="bounded", graph_mode="eager",
                                    capture_sizes=(8, 16, 32, 64, 128, 256))
    lines = [f"{preset} eager {what} ({sum(r.query_len for r in requests)} tokens) on {dev}"]
    steps = {}
    for name, cfg in (("reference", config.reference(args)), ("replay", config)):
        engine = Engine(model, cfg)
        inputs.fill_context(engine)
        steps[name] = lambda e=engine: e.step(inputs.requests, inputs.step_tokens,
                                              inputs.cache_indices)
    # Every timing before any profiling: a torch.profiler session can leave launches costlier
    # for the rest of the process (the last line measures them again after it).
    timed = {name: time_steps(step, sync) for name, step in steps.items()}
    costs = launch_costs(dev) if dev.type == "cuda" else ""
    for name, step in steps.items():
        host = cProfile.Profile()
        host.enable()
        step()
        host.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(40)
        (out / f"hotpath-{preset}{tag}-{name}-cprofile.txt").write_text(text.getvalue())
        on_cuda = dev.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            step()
            sync()
        if on_cuda:
            events = [e for e in prof.key_averages() if e.device_time_total > 0
                      and e.device_type == torch.autograd.DeviceType.CUDA]
        else:
            events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        if on_cuda:  # every kernel in launch order: which op of which layer launched it
            launched = sorted((e for e in prof.events() if e.device_type ==
                               torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
            (out / f"hotpath-{preset}{tag}-{name}-kernels.txt").write_text(
                "\n".join(e.name[:160] for e in launched))
        by_kind: Counter[str] = Counter()
        for e in events:
            by_kind[kind(e.key)] += e.count
        busy = sum(e.self_device_time_total for e in events) / 1e3 if on_cuda else float("nan")
        (out / f"hotpath-{preset}{tag}-{name}.txt").write_text(
            prof.key_averages().table(sort_by="count", row_limit=40, max_name_column_width=90))
        wall, host_ms = timed[name]
        lines.append(f"  {name:9s} {wall:7.2f} ms/step (host {host_ms:6.2f} ms, device busy "
                     f"{busy:6.2f} ms), {sum(by_kind.values())} "
                     f"{'kernels' if on_cuda else 'aten ops'}: "
                     + ", ".join(f"{k} {n}" for k, n in by_kind.most_common()))
    if costs:
        lines += [costs, launch_costs(dev).replace("one call:", "one call after profiling:")]
    text = "\n".join(lines)
    (out / f"hotpath-{preset}{tag}.txt").write_text(text)
    print(text)


def time_steps(step, sync) -> tuple[float, float]:
    """Median wall and host ms of ``ITERS`` steps after three warm-up steps."""
    for _ in range(3):
        step()
    sync()
    walls, hosts = [], []
    for _ in range(ITERS):
        start = time.perf_counter()
        step()
        hosts.append(1e3 * (time.perf_counter() - start))
        sync()
        walls.append(1e3 * (time.perf_counter() - start))
    return statistics.median(walls), statistics.median(hosts)


def launch_costs(dev: torch.device) -> str:
    """Host microseconds per call, median of 5 runs of 2000 calls each."""
    from swa_bench.engine.config import kernel_settings_from_environment, resolve_kernels
    from swa_bench.kernels import KernelSettings, silu_mul

    x = torch.zeros(1, device=dev)
    a, w = torch.randn(104, 256, device=dev), torch.randn(256, 256, device=dev)
    h = torch.randn(1, 64, device=dev)
    fallback = kernel_settings_from_environment().launch == "triton"  # a fallback's "triton" stays
    direct, own = (resolve_kernels(KernelSettings("triton", launch=mode), dev.type)
                   for mode in ("triton" if fallback else "direct", "triton"))
    costs = []
    calls = (lambda: x.add_(1), lambda: torch.nn.functional.linear(a, w),
             lambda: silu_mul(direct, h), lambda: silu_mul(own, h))
    for fn in calls:
        for _ in range(50):
            fn()
        runs = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            runs.append(1e6 * (time.perf_counter() - start) / 2000)
        costs.append(statistics.median(runs))
    return ("  host cost of one call: add {:.1f} us, linear 104x256x256 {:.1f} us, "
            "Triton launch (silu_mul) {:.1f} us direct, {:.1f} us on Triton's path"
            .format(*costs))


if __name__ == "__main__":
    main()
