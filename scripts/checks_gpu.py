"""E1, E2 and E5 at V4.1-Flash layer shapes on the GPU, in bf16 and float32, and one seeded
fault that must fail: the evidence that ``swa-bench check`` has no false failures at 16K-64K
tokens and still catches an off-by-one kept start there.

Run by scripts/checks_gpu.sh on the H200. Prints one table row per check: bitwise mismatches
against the oracle (must be none), the envelope of the oracle's forward against the full-batch
truth (max abs, and its share of the allowance: below 1 passes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

import swa_bench.replay.replay_batch as replay_batch
from swa_bench.checks import equivalence
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROWS = []


@contextlib.contextmanager
def kept_start_off_by_one():
    """The fault hook: every trimmed request's kept_kv_start one position too high."""
    real = replay_batch.kept_window_start

    def faulty(replay_start, seq_len, kept, query_len):
        start = real(replay_start, seq_len, kept, query_len)
        return start + 1 if kept < query_len else start

    replay_batch.kept_window_start = faulty
    try:
        yield
    finally:
        replay_batch.kept_window_start = real


def config_for(model, tokens, **kw):
    """The engine configuration of every check: eager, or GRAPH_MODE=piecewise (a model graph
    of the step's size and one of 8 for decode steps, vLLM's trim threshold 768, replay graphs
    at their default sizes)."""
    mode = os.environ.get("GRAPH_MODE", "eager")
    if mode == "eager":
        return EngineConfig.for_model(model.args, **kw)
    return EngineConfig.for_model(model.args, graph_mode=mode, capture_sizes=(8, tokens),
                                  trim_threshold=min(768, tokens), **kw)


def run(label, check, model, tokens, expect_pass=True, **kw):
    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    t0 = time.time()
    invariant = os.environ.get("INVARIANT") == "1"  # the batch-invariant mode (issue 29)
    if check == "E1":
        r = equivalence.check_e1(model, inputs, config_for(model, tokens),
                                 decode_steps=kw.get("decode_steps", 2 * model.args.window),
                                 invariant=invariant)
    elif check == "E2":
        r = equivalence.check_e2(model, inputs, config_for(model, tokens, policy="halo"),
                                 invariant=invariant)
    elif check == "E3":
        r = equivalence.check_e3(model, inputs, config_for(model, tokens))
    else:
        r = equivalence.check_e5(model, inputs, config_for(model, tokens))
    ok = r.passed == expect_pass
    verdict = ("PASS" if r.passed else "FAIL") + ("" if ok else "  <-- UNEXPECTED")
    row = f"| {label} | {check} | {verdict} | {time.time() - t0:.0f}s | {r.message[:400]} |"
    ROWS.append(row)
    print(row, flush=True)
    for d in r.diagnostics[:4]:
        print(f"    {d.tensor}: {d.mismatched}/{d.total} max abs {d.max_abs:.3g}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ok


def main() -> int:
    # Items: [flash-]{bf16,fp32,fault}-{16k,64k}; "flash-" runs the real v41-flash stack (top-512
    # indexer: E1/E2 also judge the top-k selections), otherwise v41-flash-shape.
    # CHECKS=e2,e5 narrows the checks run on each item (default: E1, E2, E5; e3 adds E3);
    # GRAPH_MODE=piecewise runs them on PIECEWISE engines (replay graphs on); PRECISION=fp8 in
    # the release's numerics (model.precision).
    plan = sys.argv[1:] or ["bf16-16k", "fault-16k", "fp32-16k", "bf16-64k", "flash-bf16-16k"]
    only = os.environ.get("CHECKS", "e1,e2,e5").split(",")
    # A CPU dry run of this script: CHECKS_GPU_DRY=1 (tiny / sparse-tiny, 40 and 60 tokens).
    dry = os.environ.get("CHECKS_GPU_DRY") == "1"
    device = torch.device("cpu" if dry else "cuda")
    good = True
    model = None
    built = None
    for item in plan:
        flash = item.startswith("flash-")
        dtype_name, size = item.removeprefix("flash-").split("-")
        dtype = DTYPES.get(dtype_name, torch.bfloat16)
        preset = ("sparse-tiny" if flash else "tiny") if dry else (
            "v41-flash" if flash else "v41-flash-shape")
        if built != (preset, dtype):
            model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            overrides = {"precision": os.environ.get("PRECISION", "bf16")}
            model, _ = build_model(build_args(preset, overrides), seed=0, device=device,
                                   dtype=dtype)
            built = (preset, dtype)
        tokens = {"16k": 40 if dry else 16384, "64k": 60 if dry else 65536}[size]
        label = f"{item} ({tokens} tokens)"
        if dtype_name == "fault":
            with kept_start_off_by_one():
                good &= run(label + " kept start +1", "E1", model, tokens, expect_pass=False,
                            decode_steps=2)
            continue
        if "e1" in only:
            good &= run(label, "E1", model, tokens)
        if "e2" in only:
            good &= run(label, "E2", model, tokens)
        if "e5" in only:
            good &= run(label, "E5", model, tokens)
        if "e3" in only:
            good &= run(label, "E3", model, tokens)
    print("\n| case | check | result | time | message |\n| --- | --- | --- | --- | --- |")
    print("\n".join(ROWS))
    print("ALL AS EXPECTED" if good else "SOMETHING UNEXPECTED")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
