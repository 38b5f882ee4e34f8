"""The approximation of bounded replay, measured against the full prefill (SPEC section 3).

Pass/fail only where a scenario sets a bound: the figures themselves are what a user reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swa_bench.checks import oracle
from swa_bench.checks.comparison import Tolerance, check_result, compare, envelope_tolerance
from swa_bench.checks.equivalence import _last_rows, _last_tokens, decode, engines
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels.config import KernelSettings
from swa_bench.model.model import Transformer
from swa_bench.results import Approximation, CheckResult


def approximation(
    model: Transformer,
    workload: StepInputs,
    *,
    continuation_steps: int,
    kernels: KernelSettings,
    halo_align: int = 1,
    policy: str = "bounded",
) -> Approximation:
    """Replay under ``policy`` (the case's) against the full prefill, both on ``kernels``:
    last-token logits, window KV per decoder layer (error vs depth), and greedy continuations
    over ``continuation_steps`` decode steps."""
    return measure(model, workload, continuation_steps=continuation_steps, kernels=kernels,
                   halo_align=halo_align, policy=policy)[0]


def measure(
    model: Transformer,
    workload: StepInputs,
    *,
    continuation_steps: int,
    kernels: KernelSettings,
    halo_align: int = 1,
    policy: str = "bounded",
) -> tuple[Approximation, CheckResult]:
    """``approximation`` and ``check_first_decoder_kv`` from one pair of runs."""
    bounded, full = engines(
        model,
        workload,
        EngineConfig.for_model(model.args, policy=policy, halo_align=halo_align, kernels=kernels),
        EngineConfig.for_model(model.args, policy="full", kernels=kernels),
    )
    idx = workload.cache_indices
    out = bounded.step(workload.requests, workload.step_tokens, idx)
    ref = full.reference_step(workload.requests, workload.step_tokens, idx)
    first_kv = _first_decoder_kv(bounded, full, workload, policy, halo_align)
    return compare_after(bounded, full, out, ref, workload, continuation_steps), first_kv


def compare_after(
    bounded: Engine, full: Engine, out: StepOutput, ref: StepOutput, workload: StepInputs,
    continuation_steps: int, requests: Sequence[int] | None = None,
) -> Approximation:
    """The approximation figures of one step both engines ran (``out``: the replay's, ``ref``:
    the full prefill's, from caches that held the same context): last-token logits, window KV
    per decoder layer, then ``continuation_steps`` greedy decode steps on both (which move
    their caches on). ``requests``: the batch positions that count (default every one)."""
    counted = list(range(len(workload.requests))) if requests is None else list(requests)
    a, b = _last_rows(out).double()[counted], _last_rows(ref).double()[counted]
    log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    top1 = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    args = bounded.args
    rel = []
    for layer in range(args.last_kv_source + 1, args.n_layers):
        num = den = 0.0
        for i in [workload.indices[j] for j in counted]:
            x = bounded.cache.ring_window(layer, i).double()
            y = full.cache.ring_window(layer, i).double()
            num += float((x - y).pow(2).sum())
            den += float(y.pow(2).sum())
        rel.append(math.sqrt(num / den) if den else 0.0)
    agree = total = 0
    tok_a = _last_tokens(out, out.logits.argmax(-1).tolist())
    tok_b = _last_tokens(ref, ref.logits.argmax(-1).tolist())
    for step in range(continuation_steps):
        agree += sum(tok_a[j] == tok_b[j] for j in counted)
        total += len(counted)
        oa, ob = decode(bounded, workload, step, tok_a), decode(full, workload, step, tok_b)
        tok_a, tok_b = oa.logits.argmax(-1).tolist(), ob.logits.argmax(-1).tolist()
    return Approximation(
        logits_max_abs=float((a - b).abs().max()),
        kl=kl,
        top1_agreement=top1,
        window_kv_rel_error=rel,
        greedy_agreement=agree / total if total else 1.0,
        continuation_steps=continuation_steps,
    )


def check_first_decoder_kv(
    model: Transformer, workload: StepInputs, *, kernels: KernelSettings, halo_align: int = 1,
    policy: str = "bounded",
) -> CheckResult:
    """SPEC section 2's argument, asserted: under any policy, decoder layer S+1's window KV of
    every request that keeps rows equals the full prefill's (layer S's outputs at kept rows are
    exact, its window read every row's KV), within the rounding envelope. The approximation
    starts one layer later; if it starts here, layer S ran on the wrong window or rows."""
    replay, full = engines(
        model,
        workload,
        EngineConfig.for_model(model.args, policy=policy, halo_align=halo_align, kernels=kernels),
        EngineConfig.for_model(model.args, policy="full", kernels=kernels),
    )
    idx = workload.cache_indices
    replay.step(workload.requests, workload.step_tokens, idx)
    full.reference_step(workload.requests, workload.step_tokens, idx)
    return _first_decoder_kv(replay, full, workload, policy, halo_align)


def _first_decoder_kv(replay, full, workload: StepInputs, policy: str, halo_align: int):
    args = replay.args
    if args.n_decoder_layers == 0:
        return CheckResult(id="approximation.S+1", name="layer S+1 window KV exact",
                           passed=True, mode="info", message="no decoder layer: nothing compared")
    layer = args.last_kv_source + 1
    dtype = replay.model.embed.weight.dtype
    diags = []
    for r, ci in zip(workload.requests, workload.indices, strict=True):
        kept = oracle.kept_len(r, policy, args.window, args.n_decoder_layers, halo_align)
        if kept == 0:
            continue  # keeps no rows: its decoder rings are not this step's to write
        a, b = replay.cache.ring_window(layer, ci), full.cache.ring_window(layer, ci)
        diags.append(compare(f"ring.{layer}[cache {ci}]", a, b, envelope_tolerance(b, dtype)))
    return check_result("approximation.S+1", f"layer S+1 window KV exact under {policy}", diags,
                        Tolerance.for_dtype(dtype), "the approximation starts after layer S+1")


def check_bounds(
    metrics: Approximation,
    *,
    max_logits_abs_error: float | None,
    min_top1_agreement: float | None,
    min_greedy_agreement: float | None,
    policy: str = "bounded",
) -> CheckResult:
    """The approximation as a check: pass/fail only against the bounds a scenario sets."""
    failures = []
    if max_logits_abs_error is not None and metrics.logits_max_abs > max_logits_abs_error:
        failures.append(f"logits max abs {metrics.logits_max_abs:.3g} > {max_logits_abs_error}")
    if min_top1_agreement is not None and metrics.top1_agreement < min_top1_agreement:
        failures.append(f"top-1 agreement {metrics.top1_agreement:.3f} < {min_top1_agreement}")
    if min_greedy_agreement is not None and metrics.greedy_agreement < min_greedy_agreement:
        failures.append(f"greedy agreement {metrics.greedy_agreement:.3f} < {min_greedy_agreement}")
    bounded = any(
        v is not None for v in (max_logits_abs_error, min_top1_agreement, min_greedy_agreement)
    )
    summary = (
        f"logits max abs {metrics.logits_max_abs:.3g}, KL {metrics.kl:.3g}, top-1 "
        f"{metrics.top1_agreement:.3f}, greedy {metrics.greedy_agreement:.3f} over "
        f"{metrics.continuation_steps} steps, window-KV rel error by depth "
        + ", ".join(f"{e:.2g}" for e in metrics.window_kv_rel_error)
    )
    return CheckResult(
        id="approximation",
        name=f"{policy} vs full prefill",
        passed=not failures,
        mode="bound" if bounded else "info",
        message="; ".join(failures) if failures else summary,
    )
