"""Where a v41-flash prefill step spends its GPU time: torch.profiler over one reference and one
replay step (eager, bf16), kernels grouped by kind, after the step's wall time (median of 3, the
device synchronised), its kernel launches and its achieved TFLOP/s (the analytic FLOP model).
Writes the full tables under $OUT.

    python3 scripts/profile_gpu.py [tokens]
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from swa_bench.bench.flop_model import step_flops
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

KINDS = [
    ("grouped_gemm", r"grouped|group_gemm|GroupMM|grouped_mm"),
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|matmul|Gemm"),
    ("softmax", r"softmax"),
    ("topk/sort", r"topk|sort|radix|gatherTopK|bitonic"),
    ("reduce", r"reduce|Reduce|sum|norm|mean"),
    ("index/gather", r"index|gather|scatter|Index"),
    ("copy/cat", r"copy|cat|Cat|Copy|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
]


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name):
            return label
    return "other"


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    args = PRESETS["v41-flash"]
    model, _ = build_model(args, seed=0, device=dev, dtype=torch.bfloat16)
    requests = [RequestSpec(prompt_len=tokens)]
    inputs = StepInputs.seeded(requests, args.vocab_size, 0)
    config = EngineConfig.for_model(args, policy="bounded", graph_mode="eager", trim_threshold=768,
                          eager_trim_threshold=0, capture_sizes=(tokens,),
                          max_capture_size=tokens, halo_align=1)
    lines = []
    for name, cfg in (("reference", config.reference(args)), ("replay", config)):
        engine = Engine(model, cfg)
        inputs.fill_context(engine)
        step = lambda e=engine: e.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)  # noqa: E731
        step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            result = step()
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - start))
        wall = sorted(walls)[1]
        flops = step_flops(args, requests, result.plan.kept_lens, dev, engine.kernels)["total"]
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0
                  and e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time_total for e in events)
        by_kind: dict[str, float] = defaultdict(float)
        for e in events:
            by_kind[kind(e.key)] += e.device_time_total
        (out / f"profile-{name}.txt").write_text(
            prof.key_averages().table(sort_by="device_time_total", row_limit=60,
                                      max_name_column_width=90))
        launches = sum(e.count for e in events)
        lines.append(f"## {name}: {wall:.0f} ms wall, {total / 1e3:.0f} ms of kernel time, "
                     f"{launches} kernels, {flops / wall / 1e9:.0f} TFLOP/s")
        for label, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:14s} {us / 1e3:9.1f} ms  {100 * us / total:5.1f}%")
        top = sorted(events, key=lambda e: -e.device_time_total)[:25]
        for e in top:
            lines.append(f"    {e.device_time_total / 1e3:8.1f} ms x{e.count:5d}  {e.key[:110]}")
        del engine
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    (out / "profile-summary.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
