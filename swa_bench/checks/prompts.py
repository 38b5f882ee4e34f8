"""The checks of a whole chunked prompt (``engine.chunked_prompt``): E1 at every step on the
caches the replay's earlier steps left, the halo's end state against the full prefill (E2's
comparison after the last chunk), and the approximation after the last chunk.

The full prefill here is the reference path run in the same chunks (policy full: every layer on
every row of every chunk), which E4 shows equals one prefill of the prompt within the rounding
envelope; it is what a server without replay computes for the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from swa_bench.checks.approximation import _first_decoder_kv, compare_after
from swa_bench.checks.comparison import check_result
from swa_bench.checks.equivalence import (
    EngineSource,
    _envelope,
    _last_rows,
    _source,
    check_e1_carried,
    check_precision,
    e1_config,
    reset,
)
from swa_bench.checks.tolerance import ENVELOPE, Allowance
from swa_bench.engine.chunked_prompt import ChunkedPrompt
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.kernels.config import KernelSettings
from swa_bench.model.model import Transformer
from swa_bench.results import Approximation, CheckResult


def check_prompt_e1(
    model: Transformer, prompt: ChunkedPrompt, config: EngineConfig, *,
    tol: Allowance = ENVELOPE, engines: EngineSource | None = None,
) -> list[CheckResult]:
    """E1 at every chunk, in order, on one engine of the case's configuration whose caches only
    the prompt's own steps fill (from zero, the decode rows' contexts aside): each step bitwise
    against the oracle's forward from a copy of those caches and within the envelope of the
    bounded reference from another; after the last chunk 2W decode steps, as E1 runs them."""
    eng = _source(model, engines)(e1_config(config))
    reset(eng)
    prompt.fill_context(eng)
    out = []
    with check_precision():
        for i, inputs in enumerate(prompt.steps()):
            last = i == prompt.num_chunks - 1
            result = check_e1_carried(eng, inputs, decode_steps=2 * model.args.window if last
                                      else 0, tol=tol)
            chunk = inputs.requests[0]
            result.name += f", chunk {i + 1}/{prompt.num_chunks} of {prompt.length}"
            result.message = (f"chunk [{chunk.cached_len}, {chunk.seq_len}) after "
                              f"{i} carried steps: {result.message}")
            out.append(result)
    return out


@dataclass
class ChunkedRun:
    """Both engines after the prompt's last chunk (``out``: the replay's last step, ``ref``: the
    full prefill's), each having run every chunk on its own carried caches."""

    replay: Engine
    full: Engine
    out: StepOutput
    ref: StepOutput


def run_chunked(model: Transformer, prompt: ChunkedPrompt, *, policy: str, halo_align: int,
                kernels: KernelSettings) -> ChunkedRun:
    """Every chunk under ``policy`` (eager) and under the full prefill, each on its own caches."""
    replay = Engine(model, EngineConfig.for_model(model.args, policy=policy,
                                                  halo_align=halo_align, kernels=kernels))
    full = Engine(model, EngineConfig.for_model(model.args, policy="full", kernels=kernels))
    for engine in (replay, full):
        prompt.fill_context(engine)
    with check_precision():
        for inputs in prompt.steps():
            args = (inputs.requests, inputs.step_tokens, inputs.cache_indices)
            out, ref = replay.step(*args), full.step(*args)
    return ChunkedRun(replay, full, out, ref)


def check_halo_end_state(run: ChunkedRun, prompt: ChunkedPrompt, *,
                         tol: Allowance = ENVELOPE) -> CheckResult:
    """E2 after a halo run's last chunk: its last-token logits, every decoder layer's ring (the
    last W slots) and the DSpark draft rings of every request equal the full prefill's within
    ``tol`` (default: the rounding envelope), as ``check_e2`` compares one step. Each chunk's
    halo makes its last W rows exact, so the rings the next chunk reads are the full prefill's
    and the error does not build up from chunk to chunk."""
    args, dtype = run.replay.args, run.replay.model.embed.weight.dtype
    indices = prompt.step(0).indices
    pairs = [("last_token_logits", _last_rows(run.out), _last_rows(run.ref))]
    for layer in range(args.last_kv_source + 1, args.n_layers):
        pairs += [(f"ring.{layer}[request {i}]", run.replay.cache.ring_window(layer, ci),
                   run.full.cache.ring_window(layer, ci)) for i, ci in enumerate(indices)]
    for stage in range(args.dspark_layers):
        pairs += [(f"draft_ring.{stage}[request {i}]",
                   run.replay.cache.draft_ring_window(stage, ci),
                   run.full.cache.draft_ring_window(stage, ci)) for i, ci in enumerate(indices)]
    env, ratio, max_abs = _envelope("full_prefill:", pairs, dtype, tol)
    note = (f"after {prompt.num_chunks} chunks of {prompt.chunk_size} (prompt {prompt.length}): "
            f"full prefill envelope max abs {max_abs:.3g}, {ratio:.3g} of the allowance")
    return check_result("E2", f"halo chunked prompt == full prefill ({prompt.length}/"
                              f"{prompt.chunk_size})", env, None, note,
                        enveloped=True)


def prompt_approximation(run: ChunkedRun, prompt: ChunkedPrompt, *, policy: str, halo_align: int,
                         continuation_steps: int) -> tuple[Approximation, CheckResult]:
    """After the last chunk: the prompt's approximation figures (the decode rows beside it do
    not count) and the layer S+1 window-KV check of the last step; the continuation's decode
    steps move both engines on, so this comes after any end-state check."""
    last = prompt.step(prompt.num_chunks - 1)
    first_kv = _first_decoder_kv(run.replay, run.full, last, policy, halo_align)
    with check_precision():
        approx = compare_after(run.replay, run.full, run.out, run.ref, last, continuation_steps,
                               requests=[0])
    return approx, first_kv
