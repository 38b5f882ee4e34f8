"""The figures in results.json describe the path that ran: kept rows, FLOPs and the ideal speedup
of each case equal those of the step the SPEC says runs, over policy x graph mode x thresholds x
step sizes, including steps that did not trim (eager_trim_threshold above the step, a PIECEWISE
graph below trim_threshold, FULL graphs) and FULL's eager fallback above the largest capture."""

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from swa_bench.bench.byte_model import WeightFormats, layer_bytes
from swa_bench.bench.flop_model import layer_flops
from swa_bench.bench.flops import count_flops
from swa_bench.checks import oracle
from swa_bench.engine.engine import run_forward
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import TORCH_KERNELS
from swa_bench.model.args import PRESETS
from swa_bench.model.batch import build_step
from swa_bench.model.forward_context import ForwardContext
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.replay.replay_batch import build_replay_batch
from swa_bench.results import load_results
from swa_bench.run.commands import run_scenarios

# (policy, graph mode, eager_trim_threshold, prompt length); W = 8, halo 29, graphs 8..64.
CASES = [
    ("bounded", "eager", 0, 20),  # trims
    ("bounded", "eager", 50, 20),  # below eager_trim_threshold: whole batch
    ("halo", "eager", 0, 60),  # halo trims
    ("halo", "eager", 0, 20),  # halo keeps everything: whole batch
    ("full", "eager", 0, 60),
    ("bounded", "piecewise", 0, 20),  # graph of 32 < trim_threshold 64: whole batch
    ("bounded", "piecewise", 0, 60),  # graph of 64: replay batch
    ("halo", "piecewise", 0, 60),
    ("bounded", "piecewise", 0, 90),  # above the largest graph: eager, trims
    ("bounded", "piecewise", 100, 90),  # ... below eager_trim_threshold: whole batch
    ("bounded", "full", 0, 20),  # FULL graph: whole batch
    ("bounded", "full", 0, 90),  # FULL's eager fallback: trims
    ("full", "full", 0, 60),
]
SCENARIO = f"""\
name: figures
device: cpu
model: {{preset: tiny}}
workload:
  requests:
    - {{prompt_len: 20}}
    - {{prompt_len: 9, decode: true}}
capture_sizes: [8, 16, 32, 64]
trim_threshold: 64
sweep:
  zip:
    - policy: {json.dumps([c[0] for c in CASES])}
      graph_mode: {json.dumps([c[1] for c in CASES])}
      eager_trim_threshold: {json.dumps([c[2] for c in CASES])}
      workload.requests.0.prompt_len: {json.dumps([c[3] for c in CASES])}
checks: {{e1: {{enabled: false}}, e2: {{enabled: false}}, e3: {{enabled: false}},
         e4: {{enabled: false}}, e5: {{enabled: false}}}}
timing: {{warmup: 0, iters: 1, breakdown: false}}
"""
ARGS = PRESETS["tiny"]
CAPTURE_SIZES = (8, 16, 32, 64)


def spec_path(prompt_len: int, policy: str, mode: str, eager_threshold: int):
    """(padded size or None, kept lens or None for the whole batch), in the SPEC's words."""
    tokens = prompt_len + 1
    size = None if mode == "eager" else next((s for s in CAPTURE_SIZES if s >= tokens), None)
    halo = ARGS.window + (ARGS.n_decoder_layers - 1) * (ARGS.window - 1)
    keep = min(prompt_len, ARGS.window if policy == "bounded" else halo)
    if policy == "full" or (size is not None and (mode == "full" or size < 64)):
        return size, None
    if size is None and (tokens < eager_threshold or keep == prompt_len):
        return size, None
    return size, (keep, 1)


def replay_pad(kept, mode) -> int | None:
    """A PIECEWISE replay batch pads to the smallest replay capture size holding it (the
    oracle's restatement of vLLM's table: 8, 16, ..., 64 here)."""
    if kept is None or mode != "piecewise":
        return None
    table = oracle.replay_capture_size_table(ARGS.window, max(CAPTURE_SIZES), ARGS.max_requests)
    return next((s for s in table if s >= sum(kept)), None)


def flops_of(model, cache, inputs: StepInputs, size, kept, mode) -> int:
    step = build_step(inputs.requests, inputs.step_tokens, [0, 1], ARGS, "cpu", pad_to=size,
                      logit_slots=None if size is None else ARGS.max_requests)
    replay_batch = (None if kept is None
                    else build_replay_batch(step, kept, ARGS, cache, TORCH_KERNELS,
                                            pad_to=replay_pad(kept, mode)))
    ctx = ForwardContext(step.metadata, step.logits_indices, cache, TORCH_KERNELS,
                         replay_batch=replay_batch,
                         shape_mode="static" if size and mode == "full" else "varlen")
    return count_flops(lambda: run_forward(model, step, ctx))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("figures")
    path = Path(root / "figures.yaml")
    path.write_text(SCENARIO)
    run_scenarios([path], out=root / "run", console=Console(file=open("/dev/null", "w")))  # noqa: SIM115
    return load_results(root / "run")


def test_figures_describe_the_path_that_ran(run):
    model, cache = build_model(ARGS, seed=0)
    assert len(run.cases) == len(CASES) and all(c.status == "ok" for c in run.cases), [
        c.error for c in run.cases if c.error]
    seen = set()
    for case in run.cases:
        p = case.params
        prompt = p["workload.requests.0.prompt_len"]
        inputs = StepInputs.seeded([RequestSpec(prompt_len=prompt),
                                    RequestSpec(prompt_len=9, decode=True)], ARGS.vocab_size, 0)
        size, kept = spec_path(prompt, p["policy"], p["graph_mode"], p["eager_trim_threshold"])
        where = f"{case.label}: {case.replay_route}"
        assert case.deterministic["kept_rows"] == (prompt + 1 if kept is None else sum(kept)), where
        ref_size = None if p["graph_mode"] == "eager" else size
        mode = p["graph_mode"]
        ref_flops = flops_of(model, cache, inputs, ref_size, None, mode)
        assert case.flops["reference"] == ref_flops, where
        assert case.flops["replay"] == flops_of(model, cache, inputs, size, kept, mode), where
        assert case.ideal_speedup == pytest.approx(case.flops["reference"] / case.flops["replay"])
        assert (case.ideal_speedup > 1) == (kept is not None and sum(kept) < prompt + 1), where
        seen.add((p["graph_mode"], size is None, kept is None))
    # The three paths issue 9 found misreported, each present: an eager step below
    # eager_trim_threshold, a PIECEWISE graph below trim_threshold, FULL's eager fallback trimming.
    assert ("eager", True, True) in seen and ("piecewise", False, True) in seen
    assert ("full", True, False) in seen


def test_roofline_figures_describe_the_path_that_ran(run):
    """Each path's bytes are the byte model's on the SPEC's kept rows (the whole batch where the
    step did not trim), its roofline time restated here from the layers' FLOPs and bytes at the
    GEMM rate and copy bandwidth the run recorded, the ideal their ratio."""
    tflops = run.environment["gemm_tflops"]["float32"]
    gbps = run.environment["copy_gbytes_per_s"]["float32"]
    assert gbps > 0
    for case in run.cases:
        p = case.params
        prompt = p["workload.requests.0.prompt_len"]
        requests = [RequestSpec(prompt_len=prompt), RequestSpec(prompt_len=9, decode=True)]
        _, kept = spec_path(prompt, p["policy"], p["graph_mode"], p["eager_trim_threshold"])
        where = f"{case.label}: {case.replay_route}"
        times = {}
        for name, lens in (("reference", (prompt, 1)), ("replay", kept or (prompt, 1))):
            flops = layer_flops(ARGS, requests, lens)
            moved = layer_bytes(ARGS, requests, lens, formats=WeightFormats.of_dtype(
                torch.float32))
            assert getattr(case, f"{name}_bytes") == sum(
                sum(parts.values()) for parts in moved.values()), where
            times[name] = 1e3 * sum(
                max(sum(flops.get(k, {}).values()) / (tflops * 1e12),
                    sum(moved[k].values()) / (gbps * 1e9)) for k in moved)
            assert case.roofline_ms[name] == pytest.approx(times[name]), where
        assert case.roofline_ideal_speedup == pytest.approx(times["reference"] / times["replay"])
        assert (case.roofline_ideal_speedup > 1) == (kept is not None), where
        assert case.roofline_efficiency == pytest.approx(
            case.speedup / case.roofline_ideal_speedup)
