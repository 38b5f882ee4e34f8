"""Where a host-bound PIECEWISE step's host time goes (issue 34): the small preset of
threshold-sweep.yaml (fp32, W = 32, trim threshold 33, a model graph per length, replay graphs on)
at a few lengths, the reference and the replay engine side by side.

    python3 scripts/host_profile_gpu.py [tokens ...]     # default 64 512

Per length: each path's step time (median of 30, synchronised) and its host time alone (the
same steps with no synchronisation inside the loop: the host's enqueue rate, which is the step
time when the GPU waits on the host); then cProfile over 30 steps of each path, the functions
whose own time differs most between the paths (per step, in us).
HOST_PROFILE_DRY=1: a CPU dry run (32 tokens, 5 steps).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

DRY = os.environ.get("HOST_PROFILE_DRY") == "1"
DEVICE = torch.device("cpu" if DRY else "cuda")
STEPS = 5 if DRY else 30
TABLE: list[str] = []
WATCH = ("method 'to' of", "method 'copy_' of", "_cuda_synchronize", "make_metadata",
         "method 'new_zeros'", "torch.index_select", "method 'index_copy_'")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def say(line: str) -> None:
    TABLE.append(line)
    print(line, flush=True)


def engines(model, tokens: int) -> dict[str, Engine]:
    out = {}
    for name, policy in (("reference", "full"), ("replay", "bounded")):
        config = EngineConfig.for_model(model.args, policy=policy, graph_mode="piecewise",
                                        trim_threshold=33, capture_sizes=[tokens])
        out[name] = Engine(model, config)
    return out


def run(eng: Engine, inputs: StepInputs) -> None:
    eng.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)


def _key(file: str, line: int, name: str) -> str:
    return f"{os.path.basename(file)}:{line}({name})"


def own_times(prof: cProfile.Profile) -> tuple[dict[str, float], dict[str, dict[str, tuple]]]:
    """Each function's own time in us per step, and per function its callers' (calls per step,
    us per step)."""
    stats = pstats.Stats(prof)
    out, callers = {}, {}
    for (file, line, name), (_, _, tottime, _, by) in stats.stats.items():
        key = _key(file, line, name)
        out[key] = out.get(key, 0.0) + tottime * 1e6 / STEPS
        callers[key] = {_key(*c): (v[1] / STEPS, v[2] * 1e6 / STEPS) for c, v in by.items()}
    return out, callers


def profile_length(model, tokens: int) -> None:
    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    engs = engines(model, tokens)
    for eng in engs.values():
        eng.capture()
        for _ in range(3):
            run(eng, inputs)
    sync()
    say(f"\n| {tokens} tokens | step ms (synced) | host ms (no sync) | route |")
    say("| --- | --- | --- | --- |")
    for name, eng in engs.items():
        synced = []
        for _ in range(STEPS):
            sync()
            t0 = time.perf_counter()
            run(eng, inputs)
            sync()
            synced.append((time.perf_counter() - t0) * 1e3)
        sync()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            run(eng, inputs)
        host = (time.perf_counter() - t0) * 1e3 / STEPS
        sync()
        say(f"| {name} | {statistics.median(synced):.2f} | {host:.2f} | "
            f"{eng.plan(inputs.requests).reason} |")
    profiles = {}
    for name, eng in engs.items():
        prof = cProfile.Profile()
        sync()
        prof.enable()
        for _ in range(STEPS):
            run(eng, inputs)
        sync()
        prof.disable()
        profiles[name], callers = own_times(prof)
        print(f"  cProfile {name}: {sum(profiles[name].values()):.0f} us of own time a step",
              flush=True)
        for key, by in callers.items():
            if any(w in key for w in WATCH) and by:
                print(f"    {name}: {key} called from:", flush=True)
                for caller, (calls, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:8]:
                    print(f"      {caller}: {calls:.1f} calls, {us:.0f} us a step", flush=True)
    ref, rep = profiles["reference"], profiles["replay"]
    keys = sorted(set(ref) | set(rep), key=lambda k: -abs(rep.get(k, 0) - ref.get(k, 0)))
    say(f"\n| function ({tokens} tokens, cProfile, us per step) | reference | replay |")
    say("| --- | --- | --- |")
    say(f"| all | {sum(ref.values()):.0f} | {sum(rep.values()):.0f} |")
    for k in keys[:25]:
        say(f"| {k} | {ref.get(k, 0):.0f} | {rep.get(k, 0):.0f} |")
    del engs


def main() -> int:
    lengths = [int(a) for a in sys.argv[1:]] or ([32] if DRY else [64, 512])
    model, _ = build_model(build_args("small"), seed=0, device=DEVICE, dtype=torch.float32)
    for tokens in lengths:
        t0 = time.time()
        profile_length(model, tokens)
        print(f"[{tokens} tokens: {time.time() - t0:.0f} s]", flush=True)
    print("\n".join(TABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
