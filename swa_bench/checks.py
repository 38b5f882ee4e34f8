"""The equivalence checks E1-E5 and the approximation metrics (SPEC section 3).

Each check runs the paths it compares on fresh caches filled with the same context, compares
tensors bitwise (integer views, so NaN and -0.0 count) or within a tolerance, and reports every
mismatching tensor: how many elements differ, their share, max abs and rel error, the worst index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from swa_bench.engine import Engine, StepOutput, run_eager
from swa_bench.model.model import Transformer
from swa_bench.model.requests import RequestSpec
from swa_bench.results import Approximation, CheckResult, Diagnostic
from swa_bench.workload import Workload, decode_requests

DEFAULT_TOLERANCES = {
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, rtol: float | None = None, atol: float | None = None):
        default_rtol, default_atol = DEFAULT_TOLERANCES.get(dtype, (1.3e-6, 1e-5))
        return cls(default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def _int_view(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def compare(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance | None
) -> Diagnostic | None:
    """None when equal (bitwise if ``tol`` is None); else what differs and where."""
    if actual.shape != expected.shape:
        return Diagnostic(
            tensor=f"{name} (shape {tuple(actual.shape)} != {tuple(expected.shape)})",
            mismatched=max(actual.numel(), expected.numel()),
            total=expected.numel(),
            share=1.0,
            max_abs=math.inf,
            max_rel=math.inf,
            worst_index=[],
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if tol is None:
        mismatch = _int_view(a) != _int_view(e)
    else:
        af, ef = a.double(), e.double()
        close = (af - ef).abs() <= tol.atol + tol.rtol * ef.abs()
        close |= (af == ef) | (af.isnan() & ef.isnan())
        mismatch = ~close
    count = int(mismatch.sum())
    if count == 0:
        return None
    diff = (a.double() - e.double()).abs().nan_to_num(nan=math.inf)
    rel = diff / e.double().abs().clamp_min(1e-30)
    worst = int(torch.where(mismatch, diff, torch.full_like(diff, -1.0)).flatten().argmax())
    return Diagnostic(
        tensor=name,
        mismatched=count,
        total=mismatch.numel(),
        share=count / mismatch.numel(),
        max_abs=float(diff[mismatch].max()),
        max_rel=float(rel[mismatch].max()),
        worst_index=[int(i) for i in torch.unravel_index(torch.tensor(worst), mismatch.shape)],
    )


def _result(
    check_id: str,
    name: str,
    diagnostics: Iterable[Diagnostic | None],
    tol: Tolerance | None,
    note: str = "",
) -> CheckResult:
    found = [d for d in diagnostics if d is not None]
    mode = "bitwise" if tol is None else "tolerance"
    if found:
        worst = max(found, key=lambda d: (d.share, d.max_abs))
        message = (
            f"{len(found)} tensor(s) differ; worst {worst.tensor}: "
            f"{worst.mismatched}/{worst.total} elements, max abs {worst.max_abs:.3g}, "
            f"max rel {worst.max_rel:.3g} at {worst.worst_index}"
        )
    else:
        message = f"equal ({mode})"
    if note:
        message = f"{message}; {note}"
    return CheckResult(
        id=check_id,
        name=name,
        passed=not found,
        mode=mode,
        rtol=None if tol is None else tol.rtol,
        atol=None if tol is None else tol.atol,
        message=message,
        diagnostics=found,
    )


def _caches(prefix: str, a: Engine, b: Engine, tol: Tolerance | None) -> list[Diagnostic | None]:
    theirs = b.cache.tensors()
    return [compare(f"{prefix}{n}", t, theirs[n], tol) for n, t in a.cache.tensors().items()]


def _engines(model: Transformer, workload: Workload, *configs: dict) -> list[Engine]:
    """Engines with equal caches, each filled with the workload's context once."""
    first = Engine(model, **configs[0])
    workload.fill_context(first)
    rest = []
    for config in configs[1:]:
        engine = Engine(model, **config)
        engine.cache.copy_from(first.cache)
        rest.append(engine)
    return [first, *rest]


def _decode(engine: Engine, workload: Workload, step: int, tokens: Sequence[int]) -> StepOutput:
    return engine.step(decode_requests(workload.requests, step), [[t] for t in tokens])


def check_e1(
    model: Transformer,
    workload: Workload,
    *,
    policy: str,
    halo_align: int,
    decode_steps: int,
    tol: Tolerance,
) -> CheckResult:
    """Replay == the reference with decoder windows masked below the kept starts: kept-row
    outputs, logits, every cache after the step, then ``decode_steps`` decode steps."""
    policy = "bounded" if policy == "full" else policy
    replay, reference = _engines(
        model,
        workload,
        {"policy": policy, "halo_align": halo_align},
        {"policy": policy, "halo_align": halo_align},
    )
    out = replay.step(workload.requests, workload.step_tokens)
    ref = reference.reference_step(workload.requests, workload.step_tokens, bounded=True)
    if out.replay_batch is None:
        return CheckResult(
            id="E1",
            name="replay == bounded reference",
            passed=True,
            mode="info",
            message=f"no request loses rows under {policy}: nothing to replay",
        )
    rows = out.replay_batch.rows
    diags = [compare("logits", out.logits, ref.logits, tol)]
    diags += [
        compare(f"kept_rows.stream{i}", a.index_select(0, rows), b.index_select(0, rows), tol)
        for i, (a, b) in enumerate(zip(out.streams, ref.streams, strict=True))
    ]
    diags += _caches("cache.", replay, reference, tol)
    next_tokens = out.logits.argmax(-1).tolist()
    for step in range(decode_steps):
        a = _decode(replay, workload, step, _last_tokens(out, next_tokens))
        b = _decode(reference, workload, step, _last_tokens(out, next_tokens))
        diags.append(compare(f"decode{step}.logits", a.logits, b.logits, tol))
        next_tokens = b.logits.argmax(-1).tolist()
        out = b
    return _result(
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


def check_e2(model: Transformer, workload: Workload, *, halo_align: int, tol: Tolerance):
    """Halo replay == the full prefill on last-token logits and each decoder ring's last W slots."""
    halo, full = _engines(model, workload, {"policy": "halo", "halo_align": halo_align}, {})
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
    return _result("E2", "halo replay == full prefill", diags, tol, f"{trimmed} rows trimmed")


def _last_rows(out: StepOutput) -> torch.Tensor:
    rows = out.step.logit_rows()
    keep = [j for j, (r, _) in enumerate(rows) if j + 1 == len(rows) or rows[j + 1][0] != r]
    return out.logits[keep]


def check_e3(
    model: Transformer,
    workload: Workload,
    *,
    graph_mode: str,
    policy: str,
    trim_threshold: int,
    capture_sizes: Sequence[int] | None,
    max_capture_size: int,
    halo_align: int,
    engine: Engine | None = None,
) -> CheckResult:
    """Graph replay == eager at the same padded shape, bitwise: the step, then decode steps whose
    rows change, without re-capture."""
    if graph_mode == "eager":
        return CheckResult(
            id="E3",
            name="graph replay == eager",
            passed=True,
            mode="info",
            message="eager case: no graph to compare",
        )
    config = dict(
        graph_mode=graph_mode,
        policy=policy,
        trim_threshold=trim_threshold,
        capture_sizes=capture_sizes,
        max_capture_size=max_capture_size,
        halo_align=halo_align,
    )
    graph = engine if engine is not None else Engine(model, **config)
    eager = Engine(model, policy=policy, halo_align=halo_align)
    workload.fill_context(eager)
    graph.cache.copy_from(eager.cache)
    diags, sizes = [], []
    requests, tokens = list(workload.requests), workload.step_tokens
    for step in range(3):
        out = graph.step(requests, tokens)
        size = graph.graph_size_for(requests)
        sizes.append(size)
        ref_logits, _ = eager_at_padded_shape(graph, eager, requests, tokens)
        diags.append(compare(f"step{step}.logits", out.logits, ref_logits, None))
        diags += _caches(f"step{step}.cache.", graph, eager, None)
        next_tokens = _last_tokens(out, out.logits.argmax(-1).tolist())
        requests = decode_requests(workload.requests, step)
        tokens = [[t] for t in next_tokens]
    note = "padded sizes " + ", ".join("eager" if s is None else str(s) for s in sizes)
    return _result("E3", f"{graph_mode} replay == eager", diags, None, note)


def eager_at_padded_shape(graph: Engine, eager: Engine, requests, tokens):
    """The eager forward E3 compares a graph step with: the graph's padded shape, replay
    decision and attention kernel, run on ``eager``'s cache. Returns (logits, streams)."""
    size = graph.graph_size_for(requests)
    if size is None:
        step = eager.prepare(requests, tokens)
        replay_batch = graph.eager_replay_batch(step)
        backend = "varlen"
    else:
        step = eager.prepare(requests, tokens, pad_to=size, logit_slots=eager.logit_slots)
        replay_batch = graph.graphs.replay_batch_for(step, size)
        backend = graph.graphs.attention_backend
    eager.model.attach_cache(eager.cache)
    logits, streams = run_eager(eager.model, step, replay_batch=replay_batch, backend=backend)
    return logits[: step.num_logits], tuple(s[: step.num_tokens] for s in streams)


def check_e4(model: Transformer, workload: Workload, *, tol: Tolerance) -> CheckResult:
    """The reference is right: a prefill == the same tokens decoded one by one; chunked prefill
    (chunks below, at and above W) == one prefill. On the workload's longest prompt, capped."""
    w = model.args.window
    length = min(max(r.prompt_len for r in workload.requests), 3 * w + 1)
    seq = list(
        Workload.seeded([RequestSpec(prompt_len=length)], model.args.vocab_size, 7).sequences[0]
    )
    whole = Engine(model)
    prefill = whole.reference_step(
        [RequestSpec(prompt_len=length, prompt_logprobs=True)], [seq], [0]
    )
    decode = Engine(model)
    rows = []
    for pos in range(length):
        req = RequestSpec(prompt_len=pos, decode=True) if pos else RequestSpec(prompt_len=1)
        rows.append(decode.reference_step([req], [[seq[pos]]], [0]).logits)
    diags = [compare("prefill_vs_decode.logits", prefill.logits, torch.cat(rows), tol)]
    diags += _caches("prefill_vs_decode.cache.", whole, decode, tol)
    for chunk in sorted({max(1, w - 1), w, w + 1}):
        chunked = Engine(model)
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
    return _result(
        "E4",
        "reference == token-by-token decode, chunked == one prefill",
        diags,
        tol,
        f"prompt of {length}",
    )


def check_e5(model: Transformer, workload: Workload, *, policy: str, halo_align: int):
    """A step with nothing to trim (the decode rows after the workload) takes the whole-batch
    route and is bitwise equal to the reference."""
    replay, reference = _engines(
        model,
        workload,
        {"policy": policy, "halo_align": halo_align},
        {"policy": policy},
    )
    requests = decode_requests(workload.requests, 0)
    tokens = [[seq[-1]] for seq in workload.sequences]
    for engine in (replay, reference):
        engine.reference_step(workload.requests, workload.step_tokens)
    out = replay.step(requests, tokens)
    ref = reference.reference_step(requests, tokens)
    diags = [compare("logits", out.logits, ref.logits, None)]
    diags += _caches("cache.", replay, reference, None)
    if out.replay_batch is not None:
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
    return _result("E5", "nothing to trim == reference", diags, None, "decode-only step")


def approximation(
    model: Transformer, workload: Workload, *, continuation_steps: int, halo_align: int = 1
) -> Approximation:
    """Bounded replay against the full prefill: last-token logits, window KV per decoder layer
    (error vs depth), and greedy continuations over ``continuation_steps`` decode steps."""
    bounded, full = _engines(model, workload, {"policy": "bounded"}, {"policy": "full"})
    out = bounded.step(workload.requests, workload.step_tokens)
    ref = full.reference_step(workload.requests, workload.step_tokens)
    a, b = _last_rows(out).double(), _last_rows(ref).double()
    log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    top1 = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    args = model.args
    rel = []
    for layer in range(args.last_kv_source + 1, args.n_layers):
        num = den = 0.0
        for i in range(len(workload.requests)):
            x = bounded.cache.ring_window(layer, i).double()
            y = full.cache.ring_window(layer, i).double()
            num += float((x - y).pow(2).sum())
            den += float(y.pow(2).sum())
        rel.append(math.sqrt(num / den) if den else 0.0)
    agree = total = 0
    tok_a = _last_tokens(out, out.logits.argmax(-1).tolist())
    tok_b = _last_tokens(ref, ref.logits.argmax(-1).tolist())
    for step in range(continuation_steps):
        agree += sum(x == y for x, y in zip(tok_a, tok_b, strict=True))
        total += len(tok_a)
        oa, ob = _decode(bounded, workload, step, tok_a), _decode(full, workload, step, tok_b)
        tok_a, tok_b = oa.logits.argmax(-1).tolist(), ob.logits.argmax(-1).tolist()
    return Approximation(
        logits_max_abs=float((a - b).abs().max()),
        kl=kl,
        top1_agreement=top1,
        window_kv_rel_error=rel,
        greedy_agreement=agree / total if total else 1.0,
        continuation_steps=continuation_steps,
    )


def check_bounds(
    metrics: Approximation,
    *,
    max_logits_abs_error: float | None,
    min_top1_agreement: float | None,
    min_greedy_agreement: float | None,
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
        name="bounded vs full prefill",
        passed=not failures,
        mode="bound" if bounded else "info",
        message="; ".join(failures) if failures else summary,
    )
