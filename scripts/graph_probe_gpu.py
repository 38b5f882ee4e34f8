"""PIECEWISE against eager on the real v41-flash stack (issue 34): where a PIECEWISE step's time and
memory go beside the eager step of the same path.

    python3 scripts/graph_probe_gpu.py [ab-16k] [profile-16k] [mem-64k]

ab-16k: both paths eager and PIECEWISE (model graph of 16384, replay graphs on), plus the
PIECEWISE replay with every attention break copying its output into the break buffer (the code
before ``eager_break(writes_out=True)``); each round times one step of every engine, alternating,
and the median over the rounds is printed. profile-16k: one replay step eager and one PIECEWISE
under torch's profiler: GPU time per kernel name, the names whose totals differ most.
mem-64k: the reference and the replay engine in PIECEWISE with model graphs of 65536, device
memory after each capture, then each path's step time (median of 2) and peak; an out-of-memory
error is reported with the allocator's figures instead of ending the run.
GRAPH_PROBE_DRY=1: a CPU dry run on sparse-tiny (40 tokens, capture sizes of 40).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.graphs import breakable
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

DRY = os.environ.get("GRAPH_PROBE_DRY") == "1"
DEVICE = torch.device("cpu" if DRY else "cuda")
GB = 1e9
TABLE: list[str] = []


def say(line: str) -> None:
    TABLE.append(line)
    print(line, flush=True)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def memory(label: str) -> None:
    if DEVICE.type != "cuda":
        return
    sync()
    print(f"  memory {label}: allocated {torch.cuda.memory_allocated() / GB:.1f} GB, reserved "
          f"{torch.cuda.memory_reserved() / GB:.1f} GB, peak allocated "
          f"{torch.cuda.max_memory_allocated() / GB:.1f} GB", flush=True)


@contextlib.contextmanager
def copying_breaks():
    """Breaks captured inside copy their fresh outputs into the buffers (no ``out=``)."""
    original = breakable.SegmentedCapture.on_break

    def on_break(self, site, fn, args, writes_out=False):
        return original(self, site, fn, args, False)

    breakable.SegmentedCapture.on_break = on_break
    try:
        yield
    finally:
        breakable.SegmentedCapture.on_break = original


def engine(model, tokens: int, *, policy: str, mode: str) -> Engine:
    config = EngineConfig.for_model(model.args, policy=policy, graph_mode=mode,
                                    trim_threshold=768 if not DRY else None,
                                    capture_sizes=[tokens])
    return Engine(model, config)


def ready(eng: Engine, inputs: StepInputs, copy: bool = False) -> Engine:
    """Captured (model graphs and the step's replay graph) and warmed by one step."""
    with copying_breaks() if copy else contextlib.nullcontext():
        inputs.fill_context(eng)
        eng.capture()
        eng.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
    sync()
    return eng


def step_ms(eng: Engine, inputs: StepInputs) -> float:
    sync()
    t0 = time.perf_counter()
    out = eng.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    del out
    return ms


def ab(model, tokens: int, rounds: int) -> None:
    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    engines = {}
    for name, policy, mode, copy in (
        ("reference eager", "full", "eager", False),
        ("reference PIECEWISE", "full", "piecewise", False),
        ("replay eager", "bounded", "eager", False),
        ("replay PIECEWISE", "bounded", "piecewise", False),
        ("replay PIECEWISE, breaks copy", "bounded", "piecewise", True),
    ):
        engines[name] = ready(engine(model, tokens, policy=policy, mode=mode), inputs, copy)
        memory(f"after {name}")
    times = defaultdict(list)
    for _ in range(rounds):
        for name, eng in engines.items():
            times[name].append(step_ms(eng, inputs))
    say(f"\n| {tokens} tokens | median ms ({rounds} rounds) | min | max | route |")
    say("| --- | --- | --- | --- | --- |")
    for name, eng in engines.items():
        t = times[name]
        route = eng.plan(inputs.requests).reason
        say(f"| {name} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} | {route} |")
    del engines


def profile(model, tokens: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    totals = {}
    for mode in ("eager", "piecewise"):
        eng = ready(engine(model, tokens, policy="bounded", mode=mode), inputs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not DRY else [])
        with torch_profile(activities=activities) as prof:
            eng.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
            sync()
        by_name = defaultdict(float)
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                by_name[evt.name[:90]] += evt.device_time_total / 1e3
        totals[mode] = by_name
        print(f"  profile {mode}: {sum(by_name.values()):.1f} ms of GPU kernels, "
              f"{len(by_name)} names", flush=True)
        del eng
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    names = set(totals["eager"]) | set(totals["piecewise"])
    diffs = sorted(names, key=lambda n: -abs(totals["piecewise"].get(n, 0)
                                             - totals["eager"].get(n, 0)))
    say(f"\n| replay kernel ({tokens} tokens) | eager ms | PIECEWISE ms |")
    say("| --- | --- | --- |")
    say(f"| all kernels | {sum(totals['eager'].values()):.1f} | "
        f"{sum(totals['piecewise'].values()):.1f} |")
    for n in diffs[:14]:
        say(f"| {n} | {totals['eager'].get(n, 0):.2f} | {totals['piecewise'].get(n, 0):.2f} |")


def mem(model, tokens: int) -> None:
    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    engines = {}
    say(f"\n| {tokens} tokens PIECEWISE | model graphs GB | replay graphs GB | step ms | "
        f"peak allocated GB |")
    say("| --- | --- | --- | --- | --- |")
    try:
        for name, policy in (("reference", "full"), ("replay", "bounded")):
            engines[name] = eng = engine(model, tokens, policy=policy, mode="piecewise")
            inputs.fill_context(eng)
            eng.capture()
            memory(f"after the {name}'s model graphs")
            eng.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
            memory(f"after the {name}'s first step")
        for name, eng in engines.items():
            if DEVICE.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t = statistics.median(step_ms(eng, inputs) for _ in range(2))
            peak = torch.cuda.max_memory_allocated() / GB if DEVICE.type == "cuda" else 0
            replay_pool = (eng.replay_graphs.stats.pool_bytes / GB
                           if eng.replay_graphs is not None else 0)
            say(f"| {name} | {eng.graphs.stats.pool_bytes / GB:.1f} | {replay_pool:.2f} | "
                f"{t:.1f} | {peak:.1f} |")
    except torch.OutOfMemoryError as err:
        say(f"| out of memory | {str(err).splitlines()[0][:300]} |")
        memory("at the error")
    del engines


def main() -> int:
    plan = sys.argv[1:] or ["ab-16k", "profile-16k", "mem-64k"]
    model, _ = build_model(build_args("sparse-tiny" if DRY else "v41-flash"), seed=0,
                           device=DEVICE, dtype=torch.bfloat16)
    memory("after the model")
    small = 40 if DRY else 16384
    for item in plan:
        t0 = time.time()
        if item == "ab-16k":
            ab(model, small, rounds=2 if DRY else 5)
        elif item == "profile-16k":
            profile(model, small)
        elif item == "mem-64k":
            mem(model, 40 if DRY else 4 * small)
        else:
            raise SystemExit(f"unknown item {item!r}")
        print(f"[{item}: {time.time() - t0:.0f} s]", flush=True)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(TABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
