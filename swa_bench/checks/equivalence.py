"""The equivalence checks E1-E5 (SPEC section 3).

Each check runs the paths it compares on fresh caches filled with the same context and compares
tensors bitwise or within a tolerance (``comparison``), reporting every mismatching tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swa_bench.checks.comparison import Tolerance, check_result, compare
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.engine.step_inputs import StepInputs, decode_requests
from swa_bench.model.model import Transformer
from swa_bench.model.requests import RequestSpec
from swa_bench.results import CheckResult, Diagnostic


def _caches(prefix: str, a: Engine, b: Engine, tol: Tolerance | None) -> list[Diagnostic | None]:
    theirs = b.cache.tensors()
    return [compare(f"{prefix}{n}", t, theirs[n], tol) for n, t in a.cache.tensors().items()]


def engines(model: Transformer, inputs: StepInputs, *configs: EngineConfig) -> list[Engine]:
    """Engines with equal caches, each filled with the inputs' context once."""
    first = Engine(model, configs[0])
    inputs.fill_context(first)
    rest = []
    for config in configs[1:]:
        engine = Engine(model, config)
        engine.cache.copy_from(first.cache)
        rest.append(engine)
    return [first, *rest]


def decode(engine: Engine, workload: StepInputs, step: int, tokens: Sequence[int]) -> StepOutput:
    return engine.step(decode_requests(workload.requests, step), [[t] for t in tokens])


def check_e1(
    model: Transformer,
    workload: StepInputs,
    config: EngineConfig,
    *,
    decode_steps: int,
    tol: Tolerance,
) -> CheckResult:
    """Replay == the reference with decoder windows masked below the kept starts: kept-row
    outputs, logits, every cache after the step, then ``decode_steps`` decode steps."""
    policy = "bounded" if config.policy == "full" else config.policy
    eager = EngineConfig(policy=policy, halo_align=config.halo_align)
    replay, reference = engines(model, workload, eager, eager)
    out = replay.step(workload.requests, workload.step_tokens)
    ref = reference.reference_step(
        workload.requests,
        workload.step_tokens,
        window_kept_lens=reference.policy_kept_lens(workload.requests),
    )
    if out.replay_batch is None:
        return CheckResult(
            id="E1",
            name="replay == bounded reference",
            passed=True,
            mode="info",
            message=f"no request loses rows under {policy}: nothing to replay",
        )
    rows = out.replay_batch.rows
    # A request that keeps no row (final_window's earlier chunks) returns no meaningful logits.
    lens = out.replay_batch.kept_lens
    live = [j for j, (r, _) in enumerate(out.step.logit_rows()) if lens[r] > 0]
    live_rows = torch.tensor(live, dtype=torch.long, device=out.logits.device)
    diags = [compare("logits", out.logits.index_select(0, live_rows),
                     ref.logits.index_select(0, live_rows), tol)]
    diags += [
        compare(f"kept_rows.stream{i}", a.index_select(0, rows), b.index_select(0, rows), tol)
        for i, (a, b) in enumerate(zip(out.streams, ref.streams, strict=True))
    ]
    diags += _caches("cache.", replay, reference, tol)
    next_tokens = out.logits.argmax(-1).tolist()
    for step in range(decode_steps):
        a = decode(replay, workload, step, _last_tokens(out, next_tokens))
        b = decode(reference, workload, step, _last_tokens(out, next_tokens))
        diags.append(compare(f"decode{step}.logits", a.logits, b.logits, tol))
        next_tokens = b.logits.argmax(-1).tolist()
        out = b
    return check_result(
        "E1",
        f"{policy} replay == bounded reference",
        diags,
        tol,
        f"{rows.shape[0]} kept rows, {decode_steps} decode steps",
    )


def _last_tokens(out: StepOutput, argmax: list[int]) -> list[int]:
    """One next token per request: the argmax at each request's last logits row."""
    last: dict[int, int] = {}
    for (request, _), token in zip(out.step.logit_rows(), argmax, strict=True):
        last[request] = token
    return [last[i] for i in range(len(out.step.requests))]


def check_e2(model: Transformer, workload: StepInputs, config: EngineConfig, *, tol: Tolerance):
    """Halo replay == the full prefill on last-token logits and each decoder ring's last W slots."""
    halo_config = EngineConfig(policy="halo", halo_align=config.halo_align)
    halo, full = engines(model, workload, halo_config, EngineConfig(policy="full"))
    out = halo.step(workload.requests, workload.step_tokens)
    ref = full.reference_step(workload.requests, workload.step_tokens)
    args = model.args
    diags = [compare("last_token_logits", _last_rows(out), _last_rows(ref), tol)]
    for layer in range(args.last_kv_source + 1, args.n_layers):
        for i in range(len(workload.requests)):
            diags.append(
                compare(
                    f"ring.{layer}[request {i}]",
                    halo.cache.ring_window(layer, i),
                    full.cache.ring_window(layer, i),
                    tol,
                )
            )
    trimmed = 0 if out.replay_batch is None else workload.num_tokens - out.replay_batch.num_rows
    return check_result("E2", "halo replay == full prefill", diags, tol, f"{trimmed} rows trimmed")


def _last_rows(out: StepOutput) -> torch.Tensor:
    rows = out.step.logit_rows()
    keep = [j for j, (r, _) in enumerate(rows) if j + 1 == len(rows) or rows[j + 1][0] != r]
    return out.logits[keep]


def check_e3(
    model: Transformer, workload: StepInputs, config: EngineConfig, *, engine: Engine | None = None
) -> CheckResult:
    """Graph replay == eager at the same padded shape, bitwise: the step, then decode steps whose
    rows change, without re-capture. ``engine`` reuses an engine of ``config`` (and its graphs)."""
    if config.graph_mode == "eager":
        return CheckResult(
            id="E3",
            name="graph replay == eager",
            passed=True,
            mode="info",
            message="eager case: no graph to compare",
        )
    graph = engine if engine is not None else Engine(model, config)
    eager = Engine(model, EngineConfig(policy=config.policy, halo_align=config.halo_align))
    workload.fill_context(eager)
    graph.cache.copy_from(eager.cache)
    diags, sizes = [], []
    requests, tokens = list(workload.requests), workload.step_tokens
    for step in range(3):
        out = graph.step(requests, tokens)
        sizes.append(out.plan.graph_size)
        ref = graph.eager_equivalent(requests, tokens, on=eager)
        diags.append(compare(f"step{step}.logits", out.logits, ref.logits, None))
        diags += _caches(f"step{step}.cache.", graph, eager, None)
        next_tokens = _last_tokens(out, out.logits.argmax(-1).tolist())
        requests = decode_requests(workload.requests, step)
        tokens = [[t] for t in next_tokens]
    note = "padded sizes " + ", ".join("eager" if s is None else str(s) for s in sizes)
    return check_result("E3", f"{config.graph_mode} replay == eager", diags, None, note)


def check_e4(model: Transformer, workload: StepInputs, *, tol: Tolerance) -> CheckResult:
    """The reference is right: a prefill == the same tokens decoded one by one; chunked prefill
    (chunks below, at and above W) == one prefill. On the workload's longest prompt, capped."""
    w = model.args.window
    length = min(max(r.prompt_len for r in workload.requests), 3 * w + 1)
    seq = list(
        StepInputs.seeded([RequestSpec(prompt_len=length)], model.args.vocab_size, 7).sequences[0]
    )
    whole = Engine(model, EngineConfig(policy="full"))
    prefill = whole.reference_step(
        [RequestSpec(prompt_len=length, prompt_logprobs=True)], [seq], [0]
    )
    decode = Engine(model, EngineConfig(policy="full"))
    rows = []
    for pos in range(length):
        req = RequestSpec(prompt_len=pos, decode=True) if pos else RequestSpec(prompt_len=1)
        rows.append(decode.reference_step([req], [[seq[pos]]], [0]).logits)
    diags = [compare("prefill_vs_decode.logits", prefill.logits, torch.cat(rows), tol)]
    diags += _caches("prefill_vs_decode.cache.", whole, decode, tol)
    for chunk in sorted({max(1, w - 1), w, w + 1}):
        chunked = Engine(model, EngineConfig(policy="full"))
        rows = []
        for start in range(0, length, chunk):
            req = RequestSpec(
                prompt_len=length, cached_len=start, chunk_size=chunk, prompt_logprobs=True
            )
            rows.append(
                chunked.reference_step([req], [seq[start : start + req.query_len]], [0]).logits
            )
        diags.append(compare(f"chunk{chunk}.logits", torch.cat(rows), prefill.logits, tol))
        diags += _caches(f"chunk{chunk}.cache.", chunked, whole, tol)
    return check_result(
        "E4",
        "reference == token-by-token decode, chunked == one prefill",
        diags,
        tol,
        f"prompt of {length}",
    )


def check_e5(model: Transformer, workload: StepInputs, config: EngineConfig):
    """A step with nothing to trim (the decode rows after the workload) takes the whole-batch
    route and is bitwise equal to the reference."""
    eager = EngineConfig(policy=config.policy, halo_align=config.halo_align)
    replay, reference = engines(model, workload, eager, eager)
    requests = decode_requests(workload.requests, 0)
    tokens = [[seq[-1]] for seq in workload.sequences]
    for engine in (replay, reference):
        engine.reference_step(workload.requests, workload.step_tokens)
    out = replay.step(requests, tokens)
    ref = reference.reference_step(requests, tokens)
    diags = [compare("logits", out.logits, ref.logits, None)]
    diags += _caches("cache.", replay, reference, None)
    if out.plan.replays:
        diags.append(
            Diagnostic(
                tensor="route (a replay batch was built)",
                mismatched=1,
                total=1,
                share=1.0,
                max_abs=0.0,
                max_rel=0.0,
                worst_index=[],
            )
        )
    return check_result("E5", "nothing to trim == reference", diags, None, "decode-only step")
